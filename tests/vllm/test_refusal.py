"""A request the vLLM server refuses ends at the client with the server's message: the front
door (max_model_len 1024) lets a 100-token prompt through, ``lumen agent``'s server
(``--max-model-len 64``) answers its ``/v1/completions`` with a 400, the agent reports that as
the request's error, and the official ``openai`` client gets it instead of hanging. A prompt
the server takes is served after it."""

from __future__ import annotations

import os
import signal
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import openai
import pytest
from engines import TLS, build_model

from lumen_core.gateway.config import GatewayConfig
from lumen_core.gateway.http.config import FrontDoorConfig
from lumen_core.gateway.http.front_door import FrontDoor
from lumen_core.gateway.server import GatewayServer

KEY = "refusal-test-key-0123456789abcdef"
MODEL = "tiny"
SERVER_ARGS = "--skip-tokenizer-init --enforce-eager --max-model-len 64 --seed 0"


@pytest.mark.timeout(600)
def test_a_prompt_past_the_servers_max_model_len_ends_with_its_message(
    tmp_path: Path, secret: bytes, secret_file: Path, spawn: Callable[[list[str]], Any]
) -> None:
    model = build_model(tmp_path / "model")
    gateway = GatewayServer(GatewayConfig(policy="S&R"), secret, port=0).start()
    server_pid = 0
    try:
        agent = spawn(
            [sys.executable, "-m", "lumen_core.cli", "agent", "--worker-id", "0",
             "--gateway", gateway.address, "--secret-file", str(secret_file), "--model", str(model),
             "--workdir", str(tmp_path), "--tls", TLS, "--kv-space-gib", "1", "--server-args", SERVER_ARGS,
             "--start-timeout-s", "400"]
        )  # fmt: skip
        registered = agent.read()
        assert registered["event"] == "registered"
        server_pid = registered["server_pid"]
        config = FrontDoorConfig(MODEL, vocab_size=512, max_model_len=1024, engine="vllm")
        with FrontDoor(gateway, config, frozenset([KEY])) as door:
            client = openai.OpenAI(base_url=door.url, api_key=KEY, max_retries=0, timeout=120.0)
            with pytest.raises(openai.BadRequestError) as refused:  # 400: the openai client does not retry
                client.completions.create(model=MODEL, prompt=[5] * 100, max_tokens=8)
            message = refused.value.body["message"]
            assert message.startswith("request 1 lost: worker 0 refused it: the server answered 400: ")
            assert "maximum context length is 64 tokens" in message
            served = client.completions.create(model=MODEL, prompt=[5] * 20, max_tokens=8)
            assert len(served.choices[0].token_ids) == 8
        with gateway.condition:
            assert gateway.coordinator.failures == ()  # the worker was not failed over it
    finally:
        if server_pid:
            try:
                os.killpg(server_pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        gateway.stop(grace_s=0.1)
