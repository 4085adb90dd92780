"""The connector's control channel in a real engine: ``stats`` sees the worker's figures,
``release`` stops one request's checkpoint while vLLM serves it on (its blocks still freed
when it ends), ``flush`` answers once nothing saved is short of durable, a bad command is an
error reply. Under a control channel (a ``lumen agent``'s server) a request that ends leaves
its checkpoint to the gateway, which releases it (a server cut off from the gateway may end a
request the gateway moves and restores)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from engines import controlled_llm, params
from vllm import SamplingParams

from lumen_core.integrations.vllm.control import ControlError, ask


@pytest.mark.timeout(600)
def test_stats_release_and_flush_over_the_control_socket(
    tmp_path: Path, holder: Callable[..., Any], secret_file: Path, issuer_key_file: Path
) -> None:
    server = holder()
    llm, sock = controlled_llm(tmp_path, secret_file, issuer_key_file, server.port)
    engine = llm.llm_engine
    scheduler = engine.engine_core.engine_core.scheduler
    rng = np.random.default_rng(5)
    for request_id in ("kept", "released"):
        sampling = SamplingParams(max_tokens=400, temperature=0.0, extra_args=params(request_id))
        engine.add_request(request_id, {"prompt_token_ids": rng.integers(1, 500, 100).tolist()}, sampling)
    outputs: dict[str, int] = {}

    def step(n: int) -> None:
        for _ in range(n):
            for out in engine.step():
                outputs[out.request_id] = len(out.outputs[0].token_ids)

    deadline = time.monotonic() + 60
    while server.ask("stats")["store"]["checkpoints"] < 2 and time.monotonic() < deadline:
        step(1)  # the holder's appends land asynchronously
    stats = ask(sock, "stats")
    assert (stats["requests"], stats["streaming"], stats["restoring"], stats["lookups"]) == (2, 2, 0, [])
    # Both prompts' whole lines of K (6 x 16 fp32 tokens of 100 each), from the steps' outputs.
    assert stats["worker"]["saved_tokens"] >= 192
    assert server.ask("stats")["store"]["checkpoints"] == 2

    assert ask(sock, "release", request_id="released") == {"request_id": "released", "known": True}
    assert ask(sock, "release", request_id="unknown")["known"] is False
    while server.ask("stats")["store"]["checkpoints"] > 1 and time.monotonic() < deadline:
        step(1)
    assert server.ask("stats")["store"]["checkpoints"] == 1  # released on the gateway's word
    before = outputs["released"]
    step(3)
    assert outputs["released"] > before  # vLLM serves it on

    flushed: list[dict[str, Any]] = []
    flusher = threading.Thread(target=lambda: flushed.append(ask(sock, "flush", timeout_s=30, wait_s=20)))
    flusher.start()
    while flusher.is_alive() and time.monotonic() < deadline:
        step(1)  # a flush is answered from the steps' lag samples
    assert flushed == [{"flushed": True, "durable_lag_tokens": 0}]

    with pytest.raises(
        ControlError,
        match=r"`command` must be one of 'stats', 'release', 'renew', 'flush', 'abandon', got 'drop'",
    ):
        ask(sock, "drop")
    with pytest.raises(ControlError, match=r"`wait_s` must be a number in \[0, 30.0\], got 60"):
        ask(sock, "flush", wait_s=60)
    with pytest.raises(ControlError, match=r"`request_id` must be a non-empty str, got 5"):
        ask(sock, "release", request_id=5)

    engine.abort_request(["kept", "released"])
    while scheduler.requests and time.monotonic() < deadline:
        step(1)
    assert not scheduler.requests  # both freed: the released one's blocks were not kept for it
    time.sleep(1.0)  # a release sent at the finish would have landed (the holder is local)
    assert server.ask("stats")["store"]["checkpoints"] == 1  # "kept"'s: the gateway's to release
