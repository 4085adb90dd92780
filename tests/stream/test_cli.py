"""`lumen holder`: argument checks, idle checkpoints expiring in a running holder (its reserve
mapped at start), the holder id capabilities name it by; `lumen keygen`."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from lumen_core.auth import CapabilityIssuer, read_issuer_key_file, read_issuer_public_key_file
from lumen_core.cli import main
from lumen_core.ops import checksum
from lumen_core.transport import Client, Rejected

pytestmark = [pytest.mark.ucx, pytest.mark.timeout(60)]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--port", "70000"], "--port must be in"),
        (["--budget-bytes", "-1"], "--budget-bytes must be >= 0"),
        (["--reserve-bytes", "2048"], "--reserve-bytes must be in [0, --budget-bytes], got 2048"),
        (["--idle-expiry-s", "0"], "--idle-expiry-s must be > 0"),
        (["--holder-id", "-1"], "--holder-id must be in [0, 2**64)"),
    ],
)
def test_holder_arguments_are_checked(
    issuer: CapabilityIssuer,
    secret_file: Path,
    capsys: pytest.CaptureFixture[str],
    args: list[str],
    message: str,
) -> None:
    base = ["holder", "--budget-bytes", "1024", "--secret-file", str(secret_file), "--issuer-key-file", "-"]
    with pytest.raises(SystemExit):
        main(base + args)
    assert message in capsys.readouterr().err


def test_idle_checkpoints_expire_and_are_counted(
    issuer: CapabilityIssuer, holder: Any, secret: bytes
) -> None:
    h = holder(1 << 20, "--idle-expiry-s", "0.3", "--reserve-bytes", str(1 << 20))
    assert h.ask("stats")["store"]["arena_bytes"] >= 1 << 20  # mapped at start
    cap = issuer.issue(5, 0, 0, holder_id=0)
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


def test_keygen_writes_a_key_pair_a_holder_trusts(
    issuer: CapabilityIssuer, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    key_path, public_path = tmp_path / "gateway.key", tmp_path / "gateway.pub"
    assert main(["keygen", "--issuer-key", str(key_path), "--public-key", str(public_path)]) == 0
    assert key_path.stat().st_mode & 0o777 == 0o600
    issuer = CapabilityIssuer(read_issuer_key_file(key_path))
    assert read_issuer_public_key_file(public_path) == issuer.public_key
    assert json.loads(capsys.readouterr().out)["hex"] == issuer.public_key.hex()
    with pytest.raises(FileExistsError):  # a key in use is never overwritten
        main(["keygen", "--issuer-key", str(key_path), "--public-key", str(public_path)])


def test_a_holder_refuses_capabilities_for_another_holder_id(
    issuer: CapabilityIssuer, holder: Any, secret: bytes
) -> None:
    h = holder(1 << 20, "--holder-id", "7")
    with Client("127.0.0.1", h.port, secret, tls="tcp") as client:
        with pytest.raises(Rejected):
            client.open(5, 0, 0, 64, b"L" * 32, b"M" * 32, issuer.issue(5, 0, 0, holder_id=0))
        assert client.open(5, 0, 0, 64, b"L" * 32, b"M" * 32, issuer.issue(5, 0, 0, holder_id=7)) == 0
    assert h.ask("stats")["server"]["capability_refused"] == 1
