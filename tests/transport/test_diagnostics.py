"""UCX's own diagnostics stay off stdout, which belongs to the program (JSON lines here)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from conftest import PEER_PATH, TLS


def test_ucx_logs_go_to_stderr_so_stdout_stays_the_programs(
    secret_file: Path, issuer_public_key_file: Path
) -> None:
    env = {k: v for k, v in os.environ.items() if k != "UCX_LOG_FILE"}
    env["UCX_LOG_LEVEL"] = "debug"  # UCX logs plenty at start-up at this level
    proc = subprocess.Popen(
        [sys.executable, str(PEER_PATH), "serve", "--secret-file", str(secret_file),
         "--issuer-key-file", str(issuer_public_key_file), "--tls", TLS],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
    )  # fmt: skip
    try:
        assert proc.stdout is not None
        assert "port" in json.loads(proc.stdout.readline())
    finally:
        proc.kill()
        _, stderr = proc.communicate(timeout=10)
    assert "UCX  DEBUG" in stderr
