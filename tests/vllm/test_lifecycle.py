"""A finished and an aborted request leave nothing on the holder: their blocks are kept until
their gathers are done, then their checkpoints released."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from engines import build_model, engine_kwargs, params, transfer_config
from vllm import LLM, SamplingParams


@pytest.mark.timeout(600)
def test_finish_and_abort_release_their_checkpoints(
    tmp_path: Path, holder: Callable[..., Any], secret_file: Path, issuer_key_file: Path
) -> None:
    server = holder()
    streamed = {"holders": [{"address": "127.0.0.1", "port": server.port}]}
    # No default holders: only the requests that name the holder are checkpointed.
    llm = LLM(
        **engine_kwargs(
            build_model(tmp_path / "model"),
            kv_transfer_config=transfer_config(secret_file, issuer_key_file, None),
        )
    )
    engine = llm.llm_engine
    rng = np.random.default_rng(3)
    for request_id, max_tokens, lumen in (
        ("done", 8, streamed),
        ("aborted", 400, streamed),
        ("idle", 400, {}),
    ):
        sampling = SamplingParams(
            max_tokens=max_tokens, temperature=0.0, extra_args=params(request_id, **lumen)
        )
        engine.add_request(request_id, {"prompt_token_ids": rng.integers(1, 500, 150).tolist()}, sampling)

    def held() -> dict[str, int]:
        return server.ask("stats")["store"]

    finished: set[str] = set()
    deadline = time.monotonic() + 120
    while "done" not in finished and time.monotonic() < deadline:
        finished |= {o.request_id for o in engine.step() if o.finished}
    assert "done" in finished
    engine.abort_request(["aborted"])
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    worker = get_kv_transfer_group().worker
    # The "idle" request (not checkpointed) keeps the engine stepping while the releases land.
    while (worker.counters["released"] < 2 or held()["checkpoints"]) and time.monotonic() < deadline:
        engine.step()
    store = held()
    assert worker.counters["released"] == 2
    assert (store["checkpoints"], store["releases"], store["tokens_held"]) == (0, 2, 0)
    assert store["tokens_committed"] > 150 + 8  # the requests were streamed before they went
    engine.abort_request(["idle"])
