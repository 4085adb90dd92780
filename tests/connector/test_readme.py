"""The README's connector example runs as written."""

import re
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[2] / "README.md"

pytestmark = [pytest.mark.ucx, pytest.mark.timeout(60)]


def test_connector_example_runs(ucx_module: None) -> None:
    section = README.read_text().split("## Quick start", 1)[1].split("\n## ", 1)[0]
    [block] = re.findall(r"```python\n(.*?)```", section, re.DOTALL)
    assert "ConnectorCore" in block
    exec(compile(block, str(README), "exec"), {})
