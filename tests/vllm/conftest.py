"""Fixtures of the vLLM tests (marker ``vllm``; ``make test-vllm`` runs them in .venv-vllm).

Without vLLM installed the files here are not collected, so the default suite never imports
it; under ``make test-vllm`` (LUMEN_VLLM=ON) a missing vLLM fails instead.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

if importlib.util.find_spec("vllm") is None:
    if os.environ.get("LUMEN_VLLM") == "ON":
        raise RuntimeError("LUMEN_VLLM=ON but vLLM is not importable: run `make vllm-env`")
    collect_ignore_glob = ["test_*.py"]
# The tests import their helpers (engines.py) by name; engine_a.py runs as a script beside them.
sys.path.insert(0, str(Path(__file__).parent))
# Both connector roles in this process (2-5 s engine starts); the multiprocess test sets its own.
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Every test here runs vLLM code: mark it ``vllm``, so the default suite deselects it (and
    tests/conftest.py gives it the filters for what vLLM warns about on its own)."""
    for item in items:
        if "tests/vllm/" in str(item.path):
            item.add_marker(pytest.mark.vllm)


@pytest.fixture(autouse=True)
def _ucx_module(ucx_module: None) -> None:
    """The connector streams over the UCX module (tests/conftest.py)."""


@pytest.fixture
def holder(
    spawn: Callable[[list[str]], Any], secret_file: Path, issuer_public_key_file: Path
) -> Callable[..., Any]:
    """holder(budget_bytes, *extra) -> a `lumen holder` process on loopback (holder id 0,
    trusting the `issuer` fixture, whose key file the engines are configured with); .port is
    its port."""

    def _holder(budget_bytes: int = 1 << 30, *extra: str) -> Any:
        proc = spawn(
            [sys.executable, "-m", "lumen_core.cli", "holder", "--port", "0",
             "--budget-bytes", str(budget_bytes), "--secret-file", str(secret_file),
             "--issuer-key-file", str(issuer_public_key_file), "--tls", "tcp", *extra]
        )  # fmt: skip
        proc.port = proc.read()["port"]
        return proc

    return _holder
