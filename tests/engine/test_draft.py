"""Speculative decoding with the draft: identical greedy output, the target's distribution
at temperature > 0, rollback of rejected drafts, and the measured acceptance."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy import stats

from lumen_core.engine import (
    CacheConfig,
    DraftProposer,
    Engine,
    HostCheckpointConnector,
    Llama,
    ModelConfig,
    SamplingParams,
    SchedulerConfig,
    SpeculativeDecoder,
    build_draft_pair,
    forward_contiguous,
    model_fingerprint,
    truncated_draft,
)

PROMPTS = [[(5 * i + j) % 256 for i in range(n)] for j, n in enumerate((3, 11, 26, 7))]


@pytest.mark.parametrize(("late_layer_scale", "k"), [(0.3, 1), (0.3, 3), (1.0, 4)])
def test_greedy_speculative_output_is_identical(late_layer_scale: float, k: int) -> None:
    target, draft = build_draft_pair(
        ModelConfig(),
        seed=1,
        draft_num_layers=2,
        late_layer_scale=late_layer_scale,
        dtype="float64",
    )
    params = SamplingParams(max_tokens=24)
    expected = Engine(target).generate(PROMPTS, params)
    spec = SpeculativeDecoder(
        Engine(target, CacheConfig(64, 4), SchedulerConfig(max_num_batched_tokens=20)),
        DraftProposer(draft, CacheConfig(64, 4)),
        k,
    )
    assert spec.generate(PROMPTS, params) == expected
    s = spec.stats
    assert 0.0 < s.acceptance_rate < 1.0
    assert s.num_emitted == s.num_accepted + s.num_verify_steps
    assert spec.engine.block_manager.num_free_blocks == 64
    assert spec.proposer.block_manager.num_free_blocks == 64


def test_identical_draft_is_always_accepted() -> None:
    target, draft = build_draft_pair(
        ModelConfig(), seed=2, draft_num_layers=3, late_layer_scale=0.0, dtype="float64"
    )
    spec = SpeculativeDecoder(Engine(target), DraftProposer(draft), 3)
    spec.generate(PROMPTS, SamplingParams(max_tokens=17))
    assert spec.stats.acceptance_rate == 1.0
    assert spec.stats.tokens_per_verify_step == 4.0


def test_acceptance_falls_as_the_late_layers_grow() -> None:
    rates = []
    for scale in (0.1, 0.5, 1.5):
        target, draft = build_draft_pair(
            ModelConfig(), seed=3, draft_num_layers=2, late_layer_scale=scale, dtype="float32"
        )
        spec = SpeculativeDecoder(Engine(target), DraftProposer(draft), 2)
        spec.generate(PROMPTS, SamplingParams(max_tokens=32))
        rates.append(spec.stats.acceptance_rate)
    assert rates[0] > rates[1] > rates[2]


def test_target_distribution_at_temperature() -> None:
    """The tokens emitted by a verify step follow the target's distribution (chi-square at a
    16-token vocabulary), not the draft's."""
    config = ModelConfig(vocab_size=16, hidden_size=32, intermediate_size=64, num_layers=3)
    target, draft = build_draft_pair(
        config, seed=4, draft_num_layers=1, late_layer_scale=1.0, dtype="float64"
    )
    temperature, n, prompt = 1.0, 3000, [3, 1, 4, 1]
    engine = Engine(
        target,
        CacheConfig(num_blocks=n + 8, block_size=8),
        SchedulerConfig(max_num_batched_tokens=8 * n, max_num_seqs=n),
    )
    spec = SpeculativeDecoder(engine, DraftProposer(draft, CacheConfig(num_blocks=n + 8, block_size=8)), 2)
    outputs = spec.generate(
        [prompt] * n,
        [SamplingParams(temperature=temperature, seed=s, max_tokens=3) for s in range(n)],
    )
    assert spec.stats.num_verify_steps == n
    samples = np.array(outputs)  # [n, 3]: token 0 sampled after prefill, 1 and 2 verified

    def marginals(model) -> tuple[np.ndarray, np.ndarray]:
        p1 = torch.softmax(forward_contiguous(model, [prompt])[0][-1] / temperature, -1)
        seqs2 = [prompt + [a] for a in range(16)]
        p2 = torch.stack([torch.softmax(x[-1] / temperature, -1) for x in forward_contiguous(model, seqs2)])
        seqs3 = [prompt + [a, b] for a in range(16) for b in range(16)]
        p3 = torch.stack([torch.softmax(x[-1] / temperature, -1) for x in forward_contiguous(model, seqs3)])
        joint12 = p1[:, None] * p2  # [a, b]
        m2 = joint12.sum(0)
        m3 = (joint12.reshape(-1, 1) * p3).sum(0)
        return m2.numpy(), m3.numpy()

    target_m2, target_m3 = marginals(target)
    draft_m2, draft_m3 = marginals(draft)
    for column, good, bad in ((1, target_m2, draft_m2), (2, target_m3, draft_m3)):
        counts = np.bincount(samples[:, column], minlength=16)
        assert stats.chisquare(counts, good / good.sum() * n).pvalue > 1e-3
        # The draft's distribution is rejected: the test can tell the two apart.
        assert stats.chisquare(counts, bad / bad.sum() * n).pvalue < 1e-6


def test_sampled_speculative_decoding_is_seeded_per_request() -> None:
    """At temperature > 0 the output depends on the seed only, not on the batch (float64),
    including seeds that do not fit a signed 64-bit integer."""
    target, draft = build_draft_pair(
        ModelConfig(), seed=8, draft_num_layers=2, late_layer_scale=0.3, dtype="float64"
    )
    params = [SamplingParams(temperature=0.9, seed=s, max_tokens=12) for s in (2**64 - 1, 2**63, 5, 6)]
    together = SpeculativeDecoder(Engine(target), DraftProposer(draft), 3).generate(PROMPTS, params)
    alone = [
        SpeculativeDecoder(Engine(target), DraftProposer(draft), 3).generate([p], [q])[0]
        for p, q in zip(PROMPTS, params, strict=True)
    ]
    assert together == alone
    assert all(len(o) == 12 for o in together)


def test_proposer_rolls_back_rejected_drafts() -> None:
    target, draft = build_draft_pair(
        ModelConfig(), seed=5, draft_num_layers=2, late_layer_scale=0.5, dtype="float64"
    )
    proposer = DraftProposer(draft, CacheConfig(32, 4))
    tokens = [1, 2, 3, 4, 5]
    first = proposer.propose({"r": tokens}, 3)["r"]
    assert len(first) == 3
    # The target accepted one draft and emitted its own token: the draft KV of the other two
    # is dropped and the proposal continues from the new tokens.
    accepted = tokens + first[:1] + [(first[1] + 1) % 256]
    second = proposer.propose({"r": accepted}, 2)["r"]
    fresh = DraftProposer(draft, CacheConfig(32, 4)).propose({"r": accepted}, 2)["r"]
    assert second == fresh
    assert proposer._requests["r"].num_computed_tokens == len(accepted) + 1
    proposer.release("r")
    assert proposer.block_manager.num_free_blocks == 32


def test_proposer_without_room_gives_shorter_drafts() -> None:
    _, draft = build_draft_pair(ModelConfig(), seed=6, draft_num_layers=1, late_layer_scale=0.5)
    proposer = DraftProposer(draft, CacheConfig(2, 4))
    assert len(proposer.propose({"r": [1] * 6}, 4)["r"]) == 3


def test_truncated_draft_shares_the_first_layers() -> None:
    target, draft = build_draft_pair(ModelConfig(), seed=7, draft_num_layers=2, late_layer_scale=0.0)
    seq = [list(range(20))]
    torch.testing.assert_close(
        forward_contiguous(draft, seq)[0], forward_contiguous(target, seq)[0], atol=1e-5, rtol=0
    )
    assert truncated_draft(target, 4).config.num_layers == 4


@pytest.mark.parametrize(
    ("call", "match"),
    [
        (lambda t: truncated_draft(t, 0), r"`num_layers` must be in \[1, 4\], got 0"),
        (
            lambda t: build_draft_pair(ModelConfig(), seed=0, draft_num_layers=4, late_layer_scale=0.5),
            r"`draft_num_layers` must be in \[1, 3\], got 4",
        ),
        (
            lambda t: build_draft_pair(ModelConfig(), seed=0, draft_num_layers=2, late_layer_scale=-1.0),
            "`late_layer_scale` must be >= 0, got -1.0",
        ),
        (lambda t: DraftProposer(t).propose({}, -1), "`num_draft_tokens` must be >= 0, got -1"),
        (
            lambda t: SpeculativeDecoder(Engine(t), DraftProposer(t), 0),
            "`num_draft_tokens` must be >= 1, got 0",
        ),
    ],
)
def test_draft_argument_checks(model32: Llama, call, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        call(model32)


def test_speculative_saves_only_accepted_tokens_and_restores() -> None:
    """With drafts, each step checkpoints the fed token and the accepted drafts only; a
    checkpoint taken mid-run restores on a plain engine and continues with the same tokens."""
    target, draft = build_draft_pair(
        ModelConfig(), seed=9, draft_num_layers=2, late_layer_scale=0.5, dtype="float64"
    )
    params = SamplingParams(max_tokens=30)
    prompt = PROMPTS[2]
    expected = Engine(target).generate([prompt], params)[0]
    saver = HostCheckpointConnector(model_fingerprint(target))
    spec = SpeculativeDecoder(Engine(target, connector=saver), DraftProposer(draft), 4)
    spec.engine.add_request("r", prompt, params)
    outputs: list[int] = []
    rejected_any = False
    while len(outputs) < 15:
        step = spec.step()
        outputs.extend(step.new_token_ids.get("r", []))
        rejected_any |= step.num_accepted.get("r", 4) < step.num_draft_tokens.get("r", 0)
        request = spec.engine.requests["r"]
        held = saver.checkpoint("r")
        assert list(held.token_ids) == request.token_ids[: request.num_computed_tokens]
        assert request.num_computed_tokens == request.num_tokens - 1
    assert rejected_any
    holder = HostCheckpointConnector(model_fingerprint(target))
    survivor = Engine(target, connector=holder)
    holder.put("r", saver.checkpoint("r"))
    survivor.add_request("r", prompt, params, output_token_ids=outputs)
    while survivor.has_unfinished():
        outputs.extend(survivor.step().new_token_ids.get("r", []))
    assert outputs == expected


def test_drafts_with_probabilities_equal_to_the_target_are_all_accepted(model64: Llama) -> None:
    """``set_drafts`` with draft probabilities: where q equals the target's p at every draft
    position, ``u * q(d) < p(d)`` always holds, so all k drafts are accepted; a request in the
    same step with a one-hot draft is verified alongside."""
    temperature, k = 0.8, 3
    prompts = [[4, 8, 15, 16], [23, 42]]
    engine = Engine(model64)
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, SamplingParams(temperature=temperature, seed=i, max_tokens=9))
    engine.step()  # prefill: one sampled token each
    seq = engine.requests["r0"].token_ids
    drafts: list[int] = []
    rows = []
    for _ in range(k):
        probs = torch.softmax(forward_contiguous(model64, [seq + drafts])[0][-1] / temperature, -1)
        rows.append(probs)
        drafts.append(int(probs.argmin()))  # even the least likely token is accepted when q = p
    engine.set_drafts("r0", drafts, torch.stack(rows))
    engine.set_drafts("r1", [0, 1])
    out = engine.step()
    assert out.num_draft_tokens == {"r0": k, "r1": 2}
    assert out.num_accepted["r0"] == k
    assert out.new_token_ids["r0"][:k] == drafts
    assert len(out.new_token_ids["r1"]) == out.num_accepted["r1"] + 1
