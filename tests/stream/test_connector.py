"""The reference engine (float64) streaming through StreamingConnector to a `lumen holder`
process, then a fresh engine restoring from it (over the transport, or from a local
HolderStore) and continuing with exactly the tokens of an uninterrupted run."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch

from lumen_core.engine import (
    CacheConfig,
    Engine,
    Llama,
    ModelConfig,
    SamplingParams,
    model_fingerprint,
    random_weights,
)
from lumen_core.stream import HolderStore, RestoreStatus, StreamingConnector
from lumen_core.transport import Client

pytestmark = [pytest.mark.ucx, pytest.mark.timeout(90)]

PROMPTS = [[(7 * i + 3 + j) % 256 for i in range(29 + 3 * j)] for j in range(3)]


@pytest.fixture(scope="module")
def model() -> Iterator[Llama]:
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield random_weights(ModelConfig(), seed=0, dtype="float64")
    torch.set_num_threads(previous)


def run_until(engine: Engine, outputs: dict[str, list[int]], count: int) -> None:
    while min(len(v) for v in outputs.values()) < count:
        for rid, new in engine.step().new_token_ids.items():
            outputs[rid].extend(new)


def finish(engine: Engine, outputs: dict[str, list[int]]) -> None:
    while engine.has_unfinished():
        for rid, new in engine.step().new_token_ids.items():
            outputs[rid].extend(new)


@pytest.mark.parametrize("source", ["remote", "local"])
def test_engine_restores_streamed_checkpoints_and_continues_identically(
    model: Llama, holder: Any, secret: bytes, source: str
) -> None:
    params = SamplingParams(temperature=0.7, seed=5, max_tokens=24)
    expected = Engine(model).generate(PROMPTS, params)
    fingerprint = model_fingerprint(model)

    store = HolderStore()
    server = store.serve(secret, tls="tcp") if source == "local" else None
    port = server.port if server is not None else holder().port
    saver = StreamingConnector(
        secret, fingerprint, holders=[("127.0.0.1", port)], streamer_options={"tls": "tcp", "max_queued_steps": 256}
    )
    worker = Engine(model, CacheConfig(64, 4), connector=saver)
    before: dict[str, list[int]] = {f"r{j}": [] for j in range(len(PROMPTS))}
    for j, prompt in enumerate(PROMPTS):
        worker.add_request(f"r{j}", prompt, params)
    run_until(worker, before, 10)
    assert saver.streamer is not None and saver.streamer.flush(timeout_s=10)
    assert saver.streamer.stats().coverage == 1.0
    saver.close()
    del worker  # the worker dies with its KV cache

    client = Client("127.0.0.1", port, secret, tls="tcp")
    try:
        restorer = StreamingConnector(
            secret, fingerprint, restore_from=store if source == "local" else client
        )
        survivor = Engine(model, CacheConfig(128, 8), connector=restorer)
        after: dict[str, list[int]] = {rid: [] for rid in before}
        for j, prompt in enumerate(PROMPTS):
            survivor.add_request(f"r{j}", prompt, params, output_token_ids=before[f"r{j}"])
        first = survivor.step()
        for rid, new in first.new_token_ids.items():
            after[rid].extend(new)
        # Every checkpointed token was restored: only each request's last sampled token ran.
        assert first.num_batched_tokens == len(PROMPTS)
        for j, rid in enumerate(before):
            result = restorer.restores[rid]
            assert result.status is RestoreStatus.COMPLETE
            assert result.restored_tokens == len(PROMPTS[j]) + len(before[rid]) - 1
        finish(survivor, after)
        for j, rid in enumerate(before):
            assert before[rid] + after[rid] == expected[j]
    finally:
        client.close()
        if server is not None:
            server.close()


def test_mismatched_model_falls_back_to_reprefill(model: Llama, secret: bytes) -> None:
    params = SamplingParams(max_tokens=16)
    expected = Engine(model).generate(PROMPTS[:1], params)[0]
    store = HolderStore()
    server = store.serve(secret, tls="tcp")
    try:
        saver = StreamingConnector(
            secret, model_fingerprint(model), holders=[("127.0.0.1", server.port)],
            streamer_options={"tls": "tcp", "max_queued_steps": 256},
        )
        worker = Engine(model, CacheConfig(64, 4), connector=saver)
        worker.add_request("r0", PROMPTS[0], params)
        before: dict[str, list[int]] = {"r0": []}
        run_until(worker, before, 6)
        assert saver.streamer is not None and saver.streamer.flush(timeout_s=10)
        saver.close()

        restorer = StreamingConnector(secret, "another-model", restore_from=store)
        survivor = Engine(model, CacheConfig(64, 4), connector=restorer)
        survivor.add_request("r0", PROMPTS[0], params, output_token_ids=before["r0"])
        first = survivor.step()
        assert restorer.restores["r0"].status is RestoreStatus.FINGERPRINT_MISMATCH
        assert first.num_batched_tokens == len(PROMPTS[0]) + len(before["r0"])  # re-prefill
        after: dict[str, list[int]] = {"r0": list(first.new_token_ids.get("r0", []))}
        finish(survivor, after)
        assert before["r0"] + after["r0"] == expected
    finally:
        server.close()


def test_connector_arguments_are_checked(secret: bytes) -> None:
    with pytest.raises(TypeError, match="secret must be bytes"):
        StreamingConnector("s", "m")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="model_fingerprint must be a non-empty str"):
        StreamingConnector(secret, "")
    with pytest.raises(TypeError, match="restore_from must be a HolderStore or a Client"):
        StreamingConnector(secret, "m", restore_from=object())  # type: ignore[arg-type]
