"""Checkpoint with gather_tokens, evict, restore with scatter_tokens: the request continues
with exactly the tokens it would have produced (float64, greedy and sampled)."""

from __future__ import annotations

import pytest
import torch

from lumen_core.engine import (
    CacheConfig,
    Checkpoint,
    Engine,
    HostCheckpointConnector,
    Llama,
    SamplingParams,
    SchedulerConfig,
    model_fingerprint,
    random_weights,
)
from lumen_core.ops import gather_tokens

PROMPT = [(7 * i + 3) % 256 for i in range(37)]


def run_until(engine: Engine, request_id: str, num_outputs: int) -> list[int]:
    outputs: list[int] = []
    while len(outputs) < num_outputs:
        outputs.extend(engine.step().new_token_ids.get(request_id, []))
    return outputs


def finish(engine: Engine, request_id: str) -> list[int]:
    outputs: list[int] = []
    while engine.has_unfinished():
        outputs.extend(engine.step().new_token_ids.get(request_id, []))
    return outputs


@pytest.mark.parametrize("temperature", [0.0, 0.9])
@pytest.mark.parametrize("restore_block_size", [1, 16])
def test_restore_continues_with_the_same_tokens(
    model64: Llama, temperature: float, restore_block_size: int
) -> None:
    params = SamplingParams(temperature=temperature, seed=42, max_tokens=30)
    expected = Engine(model64).generate([PROMPT], params)[0]

    saver = HostCheckpointConnector(model_fingerprint(model64))
    worker = Engine(model64, CacheConfig(64, 4), SchedulerConfig(max_num_batched_tokens=16), connector=saver)
    worker.add_request("r", PROMPT, params)
    before = run_until(worker, "r", 12)
    checkpoint = saver.checkpoint("r")
    # Every token that went through the cache is checkpointed: all but the last sampled one.
    assert list(checkpoint.token_ids) == PROMPT + before[:-1]
    del worker  # the worker dies with its KV cache

    holder = HostCheckpointConnector(model_fingerprint(model64))
    survivor = Engine(model64, CacheConfig(256, restore_block_size), connector=holder)
    holder.put("r", checkpoint)
    survivor.add_request("r", PROMPT, params, output_token_ids=before)
    first = survivor.step()
    request = survivor.requests["r"]
    # Restored all checkpointed tokens; only the last sampled token was run (no re-prefill).
    assert request.num_loaded_tokens == len(checkpoint.token_ids)
    assert first.num_batched_tokens == 1
    # The restored pages hold exactly the checkpointed bytes.
    slots = torch.tensor(survivor.block_manager.slot_ids(request, 0, len(checkpoint.token_ids)))
    assert torch.equal(gather_tokens(survivor.cache.layout(), slots), checkpoint.records)
    after = first.new_token_ids["r"] + finish(survivor, "r")
    assert before + after == expected


def test_corrupt_record_is_a_load_error_and_its_block_is_recomputed(model64: Llama) -> None:
    params = SamplingParams(max_tokens=20)
    expected = Engine(model64).generate([PROMPT], params)[0]
    saver = HostCheckpointConnector(model_fingerprint(model64))
    worker = Engine(model64, CacheConfig(64, 4), connector=saver)
    worker.add_request("r", PROMPT, params)
    before = run_until(worker, "r", 6)
    checkpoint = saver.checkpoint("r")
    records = checkpoint.records.clone()
    records[21, 5] ^= 0x10  # a flipped bit in token 21's record
    corrupt = Checkpoint(
        checkpoint.token_ids,
        records,
        checkpoint.crcs,
        checkpoint.layout_fingerprint,
        checkpoint.model_fingerprint,
    )

    holder = HostCheckpointConnector(model_fingerprint(model64))
    survivor = Engine(model64, CacheConfig(64, 8), connector=holder)
    holder.put("r", corrupt)
    survivor.add_request("r", PROMPT, params, output_token_ids=before)
    first = survivor.step()
    # Token 21 sits in the third page (block size 8): pages from there on are recomputed.
    assert survivor.requests["r"].num_loaded_tokens == 16
    assert first.num_batched_tokens == len(PROMPT) + len(before) - 16
    assert before + first.new_token_ids["r"] + finish(survivor, "r") == expected


def test_only_the_matching_prefix_is_restored(model64: Llama) -> None:
    params = SamplingParams(max_tokens=10)
    saver = HostCheckpointConnector(model_fingerprint(model64))
    worker = Engine(model64, connector=saver)
    worker.add_request("r", PROMPT, params)
    before = run_until(worker, "r", 4)
    holder = HostCheckpointConnector(model_fingerprint(model64))
    survivor = Engine(model64, connector=holder)
    holder.put("r", saver.checkpoint("r"))
    other_prompt = PROMPT[:30] + [1] * 7
    survivor.add_request("r", other_prompt, params, output_token_ids=before)
    survivor.step()
    assert survivor.requests["r"].num_loaded_tokens == 30


def test_checkpoint_follows_preemption_and_finish(model64: Llama) -> None:
    saver = HostCheckpointConnector(model_fingerprint(model64))
    engine = Engine(model64, CacheConfig(16, 4), connector=saver)
    for i in range(3):
        engine.add_request(f"r{i}", PROMPT[: 10 + i], SamplingParams(max_tokens=14, temperature=1.0, seed=i))
    preempted = 0
    while engine.has_unfinished():
        step = engine.step()
        preempted += len(step.preempted)
        for rid in engine.requests:
            if rid in {s.request_id for s in step.saves}:
                request = engine.requests[rid]
                held = saver.checkpoint(rid)
                assert list(held.token_ids) == request.token_ids[: request.num_computed_tokens]
    assert preempted > 0
    with pytest.raises(KeyError):
        saver.checkpoint("r0")  # released when the request finished


def test_put_rejects_another_record_format_or_model(model64: Llama, model32: Llama) -> None:
    saver = HostCheckpointConnector(model_fingerprint(model32))
    worker = Engine(model32, connector=saver)
    worker.add_request("r", PROMPT, SamplingParams(max_tokens=3))
    run_until(worker, "r", 2)
    holder = HostCheckpointConnector(model_fingerprint(model64))
    Engine(model64, connector=holder)
    with pytest.raises(ValueError, match="`checkpoint` layout must be"):
        holder.put("r", saver.checkpoint("r"))
    # Same shapes and dtype (so the same record format), other weights: refused too.
    other = random_weights(model64.config, seed=1, dtype="float64")
    assert model_fingerprint(other) != model_fingerprint(model64)
    stranger = HostCheckpointConnector(model_fingerprint(other))
    other_worker = Engine(other, connector=stranger)
    other_worker.add_request("r", PROMPT, SamplingParams(max_tokens=3))
    run_until(other_worker, "r", 2)
    with pytest.raises(ValueError, match="`checkpoint` model must be"):
        holder.put("r", stranger.checkpoint("r"))


def test_checkpoint_shape_checks() -> None:
    with pytest.raises(ValueError, match="`records` must be a 2-d uint8 tensor"):
        Checkpoint((1,), torch.zeros(1, 4), torch.zeros(1, dtype=torch.uint32), "x", "m")
    with pytest.raises(ValueError, match=r"`records` and `crcs` must have one row per token id \(2\)"):
        Checkpoint(
            (1, 2),
            torch.zeros(1, 4, dtype=torch.uint8),
            torch.zeros(1, dtype=torch.uint32),
            "x",
            "m",
        )


def test_connector_checks(model64: Llama) -> None:
    with pytest.raises(RuntimeError, match="register_kv_caches has not been called"):
        _ = HostCheckpointConnector(model_fingerprint(model64)).layout
    with pytest.raises(TypeError, match="`model_fingerprint` must be a non-empty str, got ''"):
        HostCheckpointConnector("")


def test_a_batch_restored_into_a_busy_survivor_continues_identically(model64: Llama) -> None:
    """Four requests decode together; the worker dies; all four resume on a survivor that is
    already serving its own requests, and every request's tokens equal an undisturbed run."""
    prompts = [PROMPT[i : i + 9 + 5 * i] for i in range(4)]
    own = [[200 + i, 3, 5] for i in range(3)]
    params = [SamplingParams(temperature=0.7 * (i % 2), seed=i, max_tokens=18) for i in range(4)]
    expected = Engine(model64).generate(prompts, params)
    expected_own = Engine(model64).generate(own, SamplingParams(max_tokens=18))

    saver = HostCheckpointConnector(model_fingerprint(model64))
    worker = Engine(model64, CacheConfig(64, 4), connector=saver)
    for i, (p, q) in enumerate(zip(prompts, params, strict=True)):
        worker.add_request(f"r{i}", p, q)
    before: dict[str, list[int]] = {f"r{i}": [] for i in range(4)}
    for _ in range(7):
        for rid, tokens in worker.step().new_token_ids.items():
            before[rid].extend(tokens)
    checkpoints = {rid: saver.checkpoint(rid) for rid in before}
    del worker

    holder = HostCheckpointConnector(model_fingerprint(model64))
    survivor = Engine(model64, CacheConfig(128, 16), connector=holder)
    after: dict[str, list[int]] = {f"own{i}": [] for i in range(3)}
    for i, p in enumerate(own):
        survivor.add_request(f"own{i}", p, SamplingParams(max_tokens=18))
    for _ in range(3):
        for rid, tokens in survivor.step().new_token_ids.items():
            after[rid].extend(tokens)
    for i, rid in enumerate(before):
        holder.put(rid, checkpoints[rid])
        survivor.add_request(rid, prompts[i], params[i], output_token_ids=before[rid])
        after[rid] = []
    for rid, tokens in survivor.step().new_token_ids.items():
        after[rid].extend(tokens)
    for rid in before:  # restored, not re-prefilled
        assert survivor.requests[rid].num_loaded_tokens == len(checkpoints[rid].token_ids) > 0
    while survivor.has_unfinished():
        for rid, tokens in survivor.step().new_token_ids.items():
            after[rid].extend(tokens)
    assert [before[f"r{i}"] + after[f"r{i}"] for i in range(4)] == expected
    assert [after[f"own{i}"] for i in range(3)] == expected_own
