"""`lumen gateway`: refuses to start without a secret, writes one, serves until SIGTERM, keeps its
issuer key across restarts when given a file for it."""

import os
import select
import signal
import stat
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest

import lumen_core
from lumen_core.auth import CapabilityIssuer, read_issuer_key_file, read_secret_file
from lumen_core.cli import main
from lumen_core.gateway.client import GatewayClient

pytestmark = pytest.mark.timeout(60)


def test_gateway_refuses_to_start_without_a_secret(capsys):
    assert main(["gateway", "--port", "0"]) == 2
    assert "--secret-file is required: there is no default cluster secret" in capsys.readouterr().err


def test_gateway_refuses_a_secret_file_others_can_read(tmp_path, capsys):
    path = tmp_path / "open.secret"
    path.write_bytes(b"x" * 32)
    os.chmod(path, 0o644)
    assert main(["gateway", "--secret-file", str(path), "--port", "0"]) == 2
    assert "owner only (0600), got 0o644" in capsys.readouterr().err


def test_gateway_refuses_an_inconsistent_configuration(tmp_path, capsys):
    path = tmp_path / "cluster.secret"
    assert main(["gateway", "--write-secret", str(path)]) == 0
    assert main(["gateway", "--secret-file", str(path), "--lease-s", "1", "--heartbeat-s", "2"]) == 2
    assert "heartbeat_s must be < lease_s (1.0), got 2.0" in capsys.readouterr().err
    assert main(["gateway", "--secret-file", str(path), "--kv-bytes-per-token", "0"]) == 2
    assert "`kv_bytes_per_token` must be >= 1, got 0" in capsys.readouterr().err
    assert main(["gateway", "--secret-file", str(path), "--park-leases", "-1"]) == 2
    assert "`park_leases` must be >= 0.0, got -1.0" in capsys.readouterr().err
    assert main(["gateway", "--secret-file", str(path), "--max-parked", "-3"]) == 2
    assert "`max_parked` must be >= 0, got -3" in capsys.readouterr().err


def test_write_secret_creates_a_private_file_once(tmp_path, capsys):
    path = tmp_path / "cluster.secret"
    assert main(["gateway", "--write-secret", str(path)]) == 0
    assert stat.S_IMODE(path.stat().st_mode) == 0o600 and len(read_secret_file(path)) == 32
    assert "mode 0600" in capsys.readouterr().out
    with pytest.raises(FileExistsError):
        main(["gateway", "--write-secret", str(path)])


def read_line(process: subprocess.Popen, timeout_s: float) -> str:
    ready, _, _ = select.select([process.stdout], [], [], timeout_s)
    assert ready, f"no output within {timeout_s} s"
    return process.stdout.readline()


def test_gateway_process_serves_on_loopback_until_sigterm(tmp_path):
    secret_path = tmp_path / "cluster.secret"
    assert main(["gateway", "--write-secret", str(secret_path)]) == 0
    log_path = tmp_path / "events.jsonl"
    env = dict(os.environ, PYTHONPATH=str(Path(lumen_core.__file__).parent.parent))
    command = [sys.executable, "-m", "lumen_core.cli", "gateway", "--secret-file", str(secret_path)]
    command += ["--port", "0", "--metrics-port", "0", "--policy", "FC", "--event-log", str(log_path)]
    command += ["--first-request-id", "500"]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        line = read_line(process, 30.0)
        assert line.startswith("gateway listening on 127.0.0.1:") and "policy FC, lease 10.0 s" in line
        address = line.split()[3]
        metrics_url = line.split("metrics on ")[1].strip()
        with GatewayClient(address, read_secret_file(secret_path)) as client:
            assert client.register(0, budget_bytes=1 << 30).epoch == 1
            assert client.status().policy == "FC"
            assert next(client.submit([1, 2], 2, timeout_s=10.0)).request_id == 500
        text = urllib.request.urlopen(metrics_url, timeout=5).read().decode()
        assert 'lumen_worker_state{state="serving",worker="0"} 1.0' in text
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=20) == 0
        assert "gateway stopped" in process.stdout.read()
    finally:
        if process.poll() is None:
            process.kill()
            process.wait(timeout=10)
        process.stdout.close()
        process.stderr.close()
    assert '"WorkerJoined"' in log_path.read_text()


def _serve_once(secret_path: Path, issuer_key_path: Path) -> tuple[str, bytes]:
    """Starts `lumen gateway --issuer-key-file`, registers a worker, stops it: the public key
    it printed and the one its RegisterReply handed over."""
    env = dict(os.environ, PYTHONPATH=str(Path(lumen_core.__file__).parent.parent))
    command = [sys.executable, "-m", "lumen_core.cli", "gateway", "--secret-file", str(secret_path)]
    command += ["--port", "0", "--metrics-port", "-1", "--issuer-key-file", str(issuer_key_path)]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        address = read_line(process, 30.0).split()[3]
        printed = process.stdout.readline()  # printed with the first: select() may not see it
        assert printed.startswith("capability issuer public key ")
        handed_over: list[bytes] = []
        with GatewayClient(
            address, read_secret_file(secret_path), on_issuer_key=handed_over.append
        ) as client:
            client.register(0, budget_bytes=1 << 30)
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=20) == 0
    finally:
        if process.poll() is None:
            process.kill()
            process.wait(timeout=10)
        process.stdout.close()
        process.stderr.close()
    assert len(handed_over) == 1
    return printed.split()[-1], handed_over[0]


def test_issuer_key_file_is_created_once_and_survives_a_restart(tmp_path, ucx_module):
    """A restarted gateway signs with the same key, so a holder that trusted the first run's
    still verifies the capabilities the second issues (and those in flight from the first)."""
    secret_path, key_path = tmp_path / "cluster.secret", tmp_path / "issuer.key"
    assert main(["gateway", "--write-secret", str(secret_path)]) == 0
    first = _serve_once(secret_path, key_path)
    assert stat.S_IMODE(key_path.stat().st_mode) == 0o600
    public_key = CapabilityIssuer(read_issuer_key_file(key_path)).public_key
    assert first == (public_key.hex(), public_key)
    assert _serve_once(secret_path, key_path) == first


def test_gateway_refuses_an_issuer_key_file_others_can_read(tmp_path, capsys, ucx_module):
    secret_path, key_path = tmp_path / "cluster.secret", tmp_path / "issuer.key"
    assert main(["gateway", "--write-secret", str(secret_path)]) == 0
    key_path.write_bytes(bytes(32))
    os.chmod(key_path, 0o644)
    assert main(["gateway", "--secret-file", str(secret_path), "--issuer-key-file", str(key_path)]) == 2
    assert f"cannot use {key_path} as the issuer key" in capsys.readouterr().err
