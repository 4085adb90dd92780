"""`lumen holder`: argument checks, and idle checkpoints expiring in a running holder."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from lumen_core.cli import main
from lumen_core.ops import checksum
from lumen_core.transport import Client, issue_capability

pytestmark = [pytest.mark.ucx, pytest.mark.timeout(60)]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--port", "70000"], "--port must be in"),
        (["--budget-bytes", "-1"], "--budget-bytes must be >= 0"),
        (["--idle-expiry-s", "0"], "--idle-expiry-s must be > 0"),
    ],
)
def test_holder_arguments_are_checked(
    secret_file: Path, capsys: pytest.CaptureFixture[str], args: list[str], message: str
) -> None:
    base = ["holder", "--budget-bytes", "1024", "--secret-file", str(secret_file)]
    with pytest.raises(SystemExit):
        main(base + args)
    assert message in capsys.readouterr().err


def test_idle_checkpoints_expire_and_are_counted(holder: Any, secret: bytes) -> None:
    h = holder(1 << 20, "--idle-expiry-s", "0.3")
    cap = issue_capability(secret, 5, 0, 0)
    records = np.arange(4 * 64, dtype=np.uint8).reshape(4, 64)
    crcs = checksum(torch.from_numpy(records)).numpy()
    with Client("127.0.0.1", h.port, secret, tls="tcp") as client:
        client.open(5, 0, 0, 64, b"L" * 32, b"M" * 32, cap)
        assert client.append(5, 0, 0, 0, np.arange(4, dtype=np.uint32), crcs, records, cap) == 4
        assert h.ask("stats")["store"]["checkpoints"] == 1
        deadline = time.monotonic() + 10
        while h.ask("stats")["store"]["expirations"] == 0:
            assert time.monotonic() < deadline, "the idle checkpoint never expired"
            time.sleep(0.2)
        store = h.ask("stats")["store"]
        assert store["checkpoints"] == 0 and store["bytes_charged"] == 0
