"""`lumen gateway`: refuses to start without a secret, writes one, serves until SIGTERM."""

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
from lumen_core.auth import read_secret_file
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
