"""The engine end to end: greedy output against the contiguous model, batch invariance in
float64, chunked prefill, preemption by recompute, stopping, and argument checks."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lumen_core.engine import (
    CacheConfig,
    Engine,
    Llama,
    SamplingParams,
    SchedulerConfig,
    forward_contiguous,
)


def prompts(n: int, seed: int = 0) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, 40, (n,), generator=generator).tolist()
    return [torch.randint(0, 256, (m,), generator=generator).tolist() for m in lengths]


def greedy_reference(model: Llama, prompt: list[int], num_tokens: int) -> list[int]:
    seq = list(prompt)
    for _ in range(num_tokens):
        seq.append(int(forward_contiguous(model, [seq])[0][-1].argmax()))
    return seq[len(prompt) :]


def test_greedy_output_equals_the_contiguous_model(model64: Llama) -> None:
    ps = prompts(3, seed=1)
    engine = Engine(model64, CacheConfig(64, 4), SchedulerConfig(max_num_batched_tokens=16))
    outputs = engine.generate(ps, SamplingParams(max_tokens=6))
    assert outputs == [greedy_reference(model64, p, 6) for p in ps]
    assert engine.block_manager.num_free_blocks == 64


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_batch_invariance_float64(model64: Llama, temperature: float) -> None:
    """A request's tokens are identical alone or in any batch, in any order, with any budget."""
    ps = prompts(8, seed=2)
    params = [SamplingParams(temperature=temperature, seed=100 + i, max_tokens=12) for i in range(8)]
    alone = [Engine(model64).generate([p], [q])[0] for p, q in zip(ps, params, strict=True)]
    together = Engine(model64).generate(ps, params)
    assert together == alone
    order = [5, 2, 7, 0, 3, 6, 1, 4]
    shuffled = Engine(model64, CacheConfig(256, 1), SchedulerConfig(max_num_batched_tokens=13)).generate(
        [ps[i] for i in order], [params[i] for i in order]
    )
    assert shuffled == [alone[i] for i in order]
    if temperature > 0:
        # Different seeds give different streams: the sampling really is seeded per request.
        reseeded = Engine(model64).generate([ps[0]], [SamplingParams(temperature=1.0, seed=7, max_tokens=12)])
        assert reseeded[0] != alone[0]


def test_chunked_prefill_budget_is_respected_and_output_unchanged(model64: Llama) -> None:
    ps = [list(range(50)), list(range(100, 130))]
    engine = Engine(model64, CacheConfig(64, 16), SchedulerConfig(max_num_batched_tokens=8))
    for i, p in enumerate(ps):
        engine.add_request(str(i), p, SamplingParams(max_tokens=5))
    outputs: dict[str, list[int]] = {"0": [], "1": []}
    while engine.has_unfinished():
        step = engine.step()
        assert 0 < step.num_batched_tokens <= 8
        for rid, tokens in step.new_token_ids.items():
            outputs[rid].extend(tokens)
    assert [outputs["0"], outputs["1"]] == [greedy_reference(model64, p, 5) for p in ps]


def test_preemption_by_recompute_keeps_the_output(model64: Llama) -> None:
    """A cache too small for all requests at once forces preemption; outputs do not change."""
    ps = prompts(6, seed=3)
    params = [SamplingParams(temperature=0.8, seed=i, max_tokens=20) for i in range(6)]
    expected = Engine(model64).generate(ps, params)
    small = Engine(model64, CacheConfig(num_blocks=16, block_size=4))
    ids = []
    for i, (p, q) in enumerate(zip(ps, params, strict=True)):
        small.add_request(f"r{i}", p, q)
        ids.append(f"r{i}")
    outputs: dict[str, list[int]] = {i: [] for i in ids}
    num_preempted = 0
    while small.has_unfinished():
        step = small.step()
        num_preempted += len(step.preempted)
        for rid, tokens in step.new_token_ids.items():
            outputs[rid].extend(tokens)
    assert num_preempted > 0
    assert [outputs[i] for i in ids] == expected
    assert small.block_manager.num_free_blocks == 16


def test_admission_waits_for_kv_capacity(model64: Llama) -> None:
    engine = Engine(model64, CacheConfig(num_blocks=4, block_size=4))
    engine.add_request("a", list(range(12)), SamplingParams(max_tokens=4))
    engine.add_request("b", list(range(8)), SamplingParams(max_tokens=4))
    engine.step()
    assert [r.request_id for r in engine.scheduler.running] == ["a"]
    assert [r.request_id for r in engine.scheduler.waiting] == ["b"]


def test_max_num_seqs_caps_the_running_batch(model64: Llama) -> None:
    engine = Engine(model64, scheduler_config=SchedulerConfig(max_num_seqs=2))
    for i in range(3):
        engine.add_request(str(i), [i + 1], SamplingParams(max_tokens=3))
    engine.step()
    assert len(engine.scheduler.running) == 2


def test_eos_stops_and_max_tokens_caps(model64: Llama) -> None:
    p = [1, 2, 3]
    free_run = greedy_reference(model64, p, 6)
    eos = free_run[2]
    out = Engine(model64).generate([p], SamplingParams(max_tokens=6, eos_token_id=eos))[0]
    assert out == free_run[: free_run.index(eos) + 1]
    engine = Engine(model64)
    engine.add_request("x", p, SamplingParams(max_tokens=2))
    reasons = {}
    while engine.has_unfinished():
        reasons.update(engine.step().finished)
    assert reasons == {"x": "length"}


def test_saves_report_every_written_token_once(model64: Llama) -> None:
    engine = Engine(model64, CacheConfig(32, 4), SchedulerConfig(max_num_batched_tokens=5))
    engine.add_request("r", list(range(11)), SamplingParams(max_tokens=4))
    positions: list[int] = []
    tokens: list[int] = []
    final: list[int] = []
    while engine.has_unfinished():
        request = engine.requests["r"]
        final = request.token_ids
        step = engine.step()
        for s in step.saves:
            assert s.start_position == len(positions)
            assert len(s.slot_ids) == len(s.token_ids)
            positions.extend(range(s.start_position, s.start_position + len(s.slot_ids)))
            tokens.extend(s.token_ids)
    # Every token except the last sampled one went through the cache, in order.
    assert tokens == final[:-1]


def test_output_token_ids_resume_a_request(model64: Llama) -> None:
    p = [9, 8, 7, 6]
    full = greedy_reference(model64, p, 8)
    engine = Engine(model64)
    engine.add_request("r", p, SamplingParams(max_tokens=8), output_token_ids=full[:3])
    out: list[int] = []
    while engine.has_unfinished():
        out.extend(engine.step().new_token_ids.get("r", []))
    assert out == full[3:]


def test_abort_frees_pages(model64: Llama) -> None:
    engine = Engine(model64, CacheConfig(16, 4))
    engine.add_request("r", list(range(20)), SamplingParams(max_tokens=8))
    engine.step()
    assert engine.block_manager.num_free_blocks < 16
    engine.abort("r")
    assert engine.block_manager.num_free_blocks == 16 and not engine.has_unfinished()


@pytest.mark.parametrize(
    ("call", "error", "match"),
    [
        (lambda e: e.add_request(1, [1]), TypeError, "`request_id` must be a str, got int"),
        (lambda e: e.add_request("a", []), ValueError, "`prompt_token_ids` must be non-empty"),
        (
            lambda e: e.add_request("a", "abc"),
            TypeError,
            "`prompt_token_ids` must be a sequence of ints",
        ),
        (
            lambda e: e.add_request("a", [256]),
            ValueError,
            r"`prompt_token_ids` must be token ids in \[0, 256\), got 256",
        ),
        (lambda e: e.add_request("a", [1], object()), TypeError, "`params` must be SamplingParams"),
        (
            lambda e: e.add_request("a", [1], SamplingParams(max_tokens=2), output_token_ids=[1, 2]),
            ValueError,
            "`output_token_ids` must be shorter than max_tokens=2, got 2",
        ),
        (
            lambda e: e.add_request("a", [1] * 60, SamplingParams(max_tokens=8)),
            ValueError,
            "must fit the cache's 4 blocks, got 5 blocks",
        ),
        (lambda e: e.set_drafts("nope", [1]), KeyError, "nope"),
    ],
)
def test_argument_checks(model32: Llama, call, error: type, match: str) -> None:
    engine = Engine(model32, CacheConfig(num_blocks=4, block_size=16))
    with pytest.raises(error, match=match):
        call(engine)


def test_duplicate_request_and_bad_draft_probs(model32: Llama) -> None:
    engine = Engine(model32)
    engine.add_request("a", [1])
    with pytest.raises(ValueError, match="`request_id` must be new, got 'a'"):
        engine.add_request("a", [1])
    with pytest.raises(ValueError, match=r"`draft_probs` must have shape \(2, 256\), got \(2, 3\)"):
        engine.set_drafts("a", [1, 2], torch.zeros(2, 3))


@settings(max_examples=8, deadline=None)
@given(
    lengths=st.lists(st.integers(1, 30), min_size=1, max_size=6),
    max_tokens=st.integers(1, 12),
    block_size=st.sampled_from([1, 4, 16]),
    budget=st.integers(1, 64),
    max_num_seqs=st.integers(1, 6),
)
def test_scheduling_never_changes_outputs_or_leaks_pages(
    model64: Llama,
    lengths: list[int],
    max_tokens: int,
    block_size: int,
    budget: int,
    max_num_seqs: int,
) -> None:
    """Any budget, page size, batch cap and a cache barely larger than one request (so
    requests wait and get preempted): every request's tokens equal its solo run, and every
    page comes back."""
    ps = [[(13 * i + 7 * n) % 256 for i in range(n)] for n in lengths]
    params = [SamplingParams(temperature=1.0, seed=n, max_tokens=max_tokens) for n in lengths]
    alone = [Engine(model64).generate([p], [q])[0] for p, q in zip(ps, params, strict=True)]
    num_blocks = -(-(max(lengths) + max_tokens) // block_size) + 1
    engine = Engine(
        model64,
        CacheConfig(num_blocks, block_size),
        SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=max_num_seqs),
    )
    assert engine.generate(ps, params) == alone
    assert engine.block_manager.num_free_blocks == num_blocks
