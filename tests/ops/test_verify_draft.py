"""verify_draft: native CPU against the loop reference (bit-exact on identical uniforms),
layouts, dtypes, greedy verification, batch invariance, Philox, and every validation branch.
The statistical proofs of exactness are in test_verify_draft_stats.py."""

import re
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lumen_core import VerifyResult, _native, rng, verify, verify_draft
from lumen_core.reference import sample_chunked, verify_draft_reference

pytestmark = pytest.mark.skipif(_native.C is None, reason="native CPU module not built")


def make_problem(seed: int, num_requests: int, k: int, vocab_size: int, *, closeness: float = 0.8):
    """Target probabilities [B, k+1, V] and draft probabilities [B, k, V] near them (so that
    acceptances happen), drafts sampled from the draft probabilities."""
    gen = torch.Generator().manual_seed(seed)
    p = torch.rand(num_requests, k + 1, vocab_size, generator=gen, dtype=torch.float64) ** 4
    p = p / p.sum(-1, keepdim=True)
    noise = torch.rand(num_requests, k, vocab_size, generator=gen, dtype=torch.float64) ** 4
    noise = noise / noise.sum(-1, keepdim=True)
    q = closeness * p[:, :k] + (1 - closeness) * noise
    if k:
        drafts = torch.multinomial(q.reshape(-1, vocab_size), 1, generator=gen).reshape(num_requests, k)
    else:
        drafts = torch.zeros(num_requests, 0, dtype=torch.int64)
    uniforms = torch.rand(num_requests, k + 1, 2, generator=gen, dtype=torch.float64)
    return p, q, drafts, uniforms


def sparse_of(q: torch.Tensor, drafts: torch.Tensor, topk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-K of q (the draft always among them), renormalised."""
    ids = q.topk(topk, dim=-1).indices
    has = (ids == drafts.unsqueeze(-1)).any(-1)
    ids[..., -1] = torch.where(has, ids[..., -1], drafts)
    probs = torch.gather(q, -1, ids)
    return ids, probs / probs.sum(-1, keepdim=True)


def assert_same(a: VerifyResult, b: VerifyResult) -> None:
    assert torch.equal(a.output_token_ids, b.output_token_ids)
    assert torch.equal(a.num_accepted, b.num_accepted)
    assert torch.equal(a.num_emitted, b.num_emitted)


# ---- bit-exact against the reference --------------------------------------------------------
@pytest.mark.parametrize("vocab_size", [1, 3, 17, 257, 5000])
@pytest.mark.parametrize("draft", ["one_hot", "dense", "sparse"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_matches_reference_on_probabilities(vocab_size, draft, dtype):
    p, q, drafts, u = make_problem(vocab_size, 6, 3, vocab_size)
    draft_probs = {"one_hot": None, "dense": q.to(dtype), "sparse": sparse_of(q, drafts, min(4, vocab_size))}[
        draft
    ]
    got = verify_draft(p.to(dtype), drafts, draft_probs, uniforms=u)
    want = verify_draft_reference(p.to(dtype), drafts, draft_probs, uniforms=u)
    assert_same(got, want)
    assert got.output_token_ids.dtype == torch.int64 and got.output_token_ids.shape == (6, 4)
    assert torch.equal(got.num_emitted, got.num_accepted + 1)


@pytest.mark.parametrize("draft", ["one_hot", "dense"])
def test_matches_reference_on_logits_with_mixed_temperatures(draft):
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(5, 3, 300, generator=gen) * 2
    logits[0, :, 7] = -torch.inf  # masked logits are allowed
    temps = torch.tensor([0.5, 1.0, 0.0, 2.5, 1e-3], dtype=torch.float64)
    probs = torch.softmax(logits.double() / temps.clamp_min(1e-3).view(-1, 1, 1), -1)
    drafts = torch.multinomial(probs[:, :2].reshape(-1, 300), 1, generator=gen).view(5, 2)
    q = 0.9 * probs[:, :2] + 0.1 / 300
    draft_probs = None if draft == "one_hot" else q.float()
    u = torch.rand(5, 3, 2, generator=gen, dtype=torch.float64)
    got = verify_draft(logits, drafts, draft_probs, temperature=temps, uniforms=u)
    want = verify_draft_reference(logits, drafts, draft_probs, temperature=temps, uniforms=u)
    assert_same(got, want)
    assert int(got.num_accepted.sum()) > 0


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_targets_are_read_as_float32(dtype):
    p, q, drafts, u = make_problem(3, 4, 2, 64)
    got = verify_draft(p.to(dtype), drafts, q.to(dtype), uniforms=u)
    want = verify_draft(p.to(dtype).float(), drafts, q.to(dtype).float(), uniforms=u)
    assert_same(got, want)


def test_philox_path_matches_reference_and_numpy_generator():
    p, q, drafts, _ = make_problem(4, 8, 3, 500)
    seeds = torch.tensor([0, 1, -1, 2**62, 5, 6, 7, 8])
    positions = torch.tensor([0, 10, 2**40, 3, 3, 3, 100, 7])
    got = verify_draft(p, drafts, q, seeds=seeds, positions=positions)
    assert_same(got, verify_draft_reference(p, drafts, q, seeds=seeds, positions=positions))
    rows = positions.unsqueeze(1).numpy() + np.arange(4)
    u = np.stack(
        [rng.uniforms(seeds.numpy().astype(np.uint64)[:, None], rows, index) for index in (0, 1)], -1
    )
    assert_same(got, verify_draft(p, drafts, q, uniforms=torch.from_numpy(u)))


def test_packed_layout_with_zero_drafts_matches_padded():
    p, q, drafts, u = make_problem(5, 4, 3, 40)
    ks = [3, 0, 2, 1]
    packed_target = torch.cat([p[b, : ks[b] + 1] for b in range(4)])
    packed_drafts = torch.cat([drafts[b, : ks[b]] for b in range(4)])
    packed_q = torch.cat([q[b, : ks[b]] for b in range(4)])
    packed_u = torch.cat([u[b, : ks[b] + 1] for b in range(4)])
    got = verify_draft(packed_target, packed_drafts, packed_q, num_draft_tokens=ks, uniforms=packed_u)
    padded = verify_draft(p, drafts, q, num_draft_tokens=torch.tensor(ks), uniforms=u)
    assert_same(got, padded)
    assert_same(
        got,
        verify_draft_reference(
            packed_target, packed_drafts, packed_q, num_draft_tokens=ks, uniforms=packed_u
        ),
    )
    assert int(got.num_emitted[1]) == 1 and int(got.num_accepted[1]) == 0


def test_padded_slots_beyond_num_draft_tokens_are_never_read():
    p, q, drafts, u = make_problem(12, 3, 3, 20)
    ks = torch.tensor([1, 3, 0])
    ids, probs = sparse_of(q, drafts, 4)
    want = verify_draft(p, drafts, (ids, probs), num_draft_tokens=ks, uniforms=u)
    garbage = torch.arange(3).unsqueeze(0) >= ks.unsqueeze(1)  # [b, i]: i >= k_b
    drafts, ids, probs = drafts.clone(), ids.clone(), probs.clone()
    drafts[garbage] = -7
    ids[garbage] = 99  # duplicated and out of range, but unused
    probs[garbage] = float("nan")
    got = verify_draft(p, drafts, (ids, probs), num_draft_tokens=ks, uniforms=u)
    assert_same(got, want)
    assert got.num_emitted.tolist()[2] == 1


def test_noncontiguous_inputs_and_int32_ids():
    p, q, drafts, u = make_problem(6, 5, 2, 33)
    p_nc = p.transpose(0, 1).contiguous().transpose(0, 1)
    assert not p_nc.is_contiguous()
    got = verify_draft(p_nc, drafts.to(torch.int32), q, uniforms=u)
    assert_same(got, verify_draft(p, drafts, q, uniforms=u))


def test_empty_batch_is_a_no_op():
    res = verify_draft(
        torch.empty(0, 3, 10),
        torch.empty(0, 2, dtype=torch.int64),
        uniforms=torch.empty(0, 3, 2, dtype=torch.float64),
    )
    assert res.output_token_ids.shape == (0, 3) and res.num_accepted.numel() == 0


@settings(max_examples=30, deadline=None)
@given(
    num_requests=st.integers(1, 5),
    k=st.integers(0, 4),
    vocab_size=st.sampled_from([2, 5, 1023, 1025, 4100]),
    closeness=st.floats(0.0, 1.0),
    seed=st.integers(0, 2**31),
    draft=st.sampled_from(["one_hot", "dense", "sparse"]),
    threads=st.integers(1, 3),
)
def test_matches_reference_property(num_requests, k, vocab_size, closeness, seed, draft, threads):
    p, q, drafts, u = make_problem(seed, num_requests, k, vocab_size, closeness=closeness)
    draft_probs = {
        "one_hot": None,
        "dense": q,
        "sparse": sparse_of(q, drafts, min(3, vocab_size)) if k else None,
    }[draft]
    got = verify_draft(p, drafts, draft_probs, uniforms=u, num_threads=threads)
    assert_same(got, verify_draft_reference(p, drafts, draft_probs, uniforms=u))


# ---- the sampling rule ------------------------------------------------------------------------
def test_sampling_rule_inverts_the_cdf():
    w = torch.tensor([0.0, 0.25, 0.0, 0.5, 0.25], dtype=torch.float64)
    assert [sample_chunked(w, u) for u in (0.0, 0.2499, 0.25, 0.7499, 0.75, 0.9999)] == [1, 1, 3, 3, 4, 4]
    many = torch.zeros(3000, dtype=torch.float64)
    many[[5, 1500, 2999]] = 1.0
    assert [sample_chunked(many, u) for u in (0.1, 0.5, 0.9)] == [5, 1500, 2999]


def test_one_hot_target_always_emits_its_token():
    p = torch.zeros(3, 2, 50)
    p[:, :, 42] = 1.0
    drafts = torch.tensor([[42], [3], [42]])
    res = verify_draft(p, drafts, uniforms=torch.rand(3, 2, 2, dtype=torch.float64))
    assert res.output_token_ids.tolist() == [[42, 42], [42, -1], [42, 42]]


def test_zero_draft_probability_rejects():
    p = torch.full((1, 2, 4), 0.25)
    q = torch.tensor([[[0.0, 0.5, 0.5, 0.0]]])
    res = verify_draft(p, torch.tensor([[0]]), q, uniforms=torch.zeros(1, 2, 2, dtype=torch.float64))
    # Rejected although the residual max(p - q, 0) = [0.25, 0, 0, 0.25] resamples token 0 itself.
    assert res.output_token_ids.tolist() == [[0, -1]] and res.num_accepted.tolist() == [0]


def test_residual_falls_back_to_p_when_its_mass_vanishes():
    # p = q one-hot at token 1, draft 2 has q = 0 and is rejected; max(p - q, 0) has no mass.
    p = torch.tensor([[[0.0, 1.0, 0.0], [1.0, 0.0, 0.0]]])
    q = torch.tensor([[[0.0, 1.0, 0.0]]])
    res = verify_draft(p, torch.tensor([[2]]), q, uniforms=torch.zeros(1, 2, 2, dtype=torch.float64))
    assert res.output_token_ids.tolist() == [[1, -1]]  # q(d) = 0 rejects; residual is p - q = 0 -> p


# ---- greedy and batch invariance ------------------------------------------------------------
def test_greedy_is_longest_argmax_prefix_plus_correction():
    gen = torch.Generator().manual_seed(7)
    logits = torch.randn(6, 5, 100, generator=gen)
    logits[3, 0, [10, 20]] = 50.0  # tie: the lowest id wins
    argmax = logits.argmax(-1)
    drafts = argmax[:, :4].clone()
    matched = [4, 0, 2, 1, 3, 4]
    for b, m in enumerate(matched):
        if m < 4:
            drafts[b, m] = (argmax[b, m] + 1) % 100
    res = verify_draft(logits, drafts, temperature=0.0)
    assert res.num_accepted.tolist() == matched
    for b, m in enumerate(matched):
        assert res.output_token_ids[b, : m + 1].tolist() == argmax[b, : m + 1].tolist()
        assert (res.output_token_ids[b, m + 1 :] == -1).all()
    assert int(res.output_token_ids[3, 0]) == 10
    dense = torch.softmax(torch.randn(6, 4, 100, generator=gen), -1)
    assert_same(res, verify_draft(logits, drafts, dense, temperature=torch.zeros(6, dtype=torch.float64)))


def test_batch_invariance_under_philox():
    p, q, drafts, _ = make_problem(8, 7, 3, 700)
    seeds, positions = torch.arange(100, 107), torch.arange(7) * 13
    full = verify_draft(p, drafts, q, seeds=seeds, positions=positions, num_threads=2)
    for b in range(7):
        alone = verify_draft(
            p[b : b + 1],
            drafts[b : b + 1],
            q[b : b + 1],
            seeds=seeds[b : b + 1],
            positions=positions[b : b + 1],
        )
        assert torch.equal(alone.output_token_ids[0], full.output_token_ids[b])
    order = torch.tensor([6, 2, 0, 5, 1, 3, 4])
    shuffled = verify_draft(
        p[order], drafts[order], q[order], seeds=seeds[order], positions=positions[order], num_threads=1
    )
    assert torch.equal(shuffled.output_token_ids, full.output_token_ids[order])
    ks = [3, 1, 0, 2, 3, 3, 1]
    packed = verify_draft(
        torch.cat([p[b, : ks[b] + 1] for b in range(7)]),
        torch.cat([drafts[b, : ks[b]] for b in range(7)]),
        torch.cat([q[b, : ks[b]] for b in range(7)]),
        num_draft_tokens=ks,
        seeds=seeds,
        positions=positions,
    )
    for b in range(7):
        k = ks[b]
        alone = verify_draft(
            p[b : b + 1, : k + 1],
            drafts[b : b + 1, :k],
            q[b : b + 1, :k],
            seeds=seeds[b : b + 1],
            positions=positions[b : b + 1],
        )
        assert torch.equal(alone.output_token_ids[0], packed.output_token_ids[b, : k + 1])
        assert (packed.output_token_ids[b, k + 1 :] == -1).all()


# ---- the native row check, both SIMD paths ----------------------------------------------------
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("n", [1, 7, 8, 17, 257, 5003])
def test_row_check_paths_agree(dtype, n):
    gen = np.random.default_rng(n)
    good = gen.random(n).astype(dtype)
    good /= good.sum(dtype=np.float64)
    cases = [(good, True), (good * 1.01, False), (np.zeros(n, dtype), False)]
    for index, value in [(0, np.nan), (n - 1, -1e-6), (n // 2, np.inf), (n // 3, -np.inf)]:
        bad = good.copy()
        bad[index] = value
        cases.append((bad, False))
    for row, want in cases:
        for portable in (False, True):
            assert _native.C.probability_row_ok(row, 1e-3, portable=portable) is want


def test_row_check_rejects_bad_buffers():
    with pytest.raises(ValueError, match="contiguous 1-D float32/float64"):
        _native.C.probability_row_ok(np.ones((2, 2), np.float32), 1e-3)
    with pytest.raises(ValueError, match="contiguous 1-D float32/float64"):
        _native.C.probability_row_ok(np.ones(4, np.int32), 1e-3)
    with pytest.raises(ValueError, match="contiguous 1-D float32/float64"):
        _native.C.probability_row_ok(np.ones(8, np.float32)[::2], 1e-3)


# ---- Philox -----------------------------------------------------------------------------------
def test_native_philox_matches_numpy_reference_bit_for_bit():
    gen = np.random.default_rng(0)
    edge_seeds = np.array([0, 1, 2**32 - 1, 2**32, 2**64 - 1], dtype=np.uint64)
    seeds = np.concatenate([edge_seeds, gen.integers(0, 2**64 - 1, 200, dtype=np.uint64)])
    edge_positions = np.array([0, 1, 2**32 - 1, 2**32, 2**62], dtype=np.int64)
    positions = np.concatenate([edge_positions, gen.integers(0, 2**40, 200, dtype=np.int64)])
    for index in (0, 1, 7, 2**32 - 1):
        got = _native.C.philox_uniforms(seeds, positions, index)
        assert np.array_equal(got, rng.uniforms(seeds, positions, index))


def test_native_philox_rejects_bad_input():
    c = _native.C
    with pytest.raises(ValueError, match="same size"):
        c.philox_uniforms(np.zeros(2, np.uint64), np.zeros(3, np.int64), 0)
    with pytest.raises(ValueError, match="index must be in"):
        c.philox_uniforms(np.zeros(1, np.uint64), np.zeros(1, np.int64), 2**32)
    with pytest.raises(ValueError, match="positions must be >= 0"):
        c.philox_uniforms(np.zeros(1, np.uint64), np.array([-1], np.int64), 0)


# ---- validation -------------------------------------------------------------------------------
def _ok(**overrides):
    p, _, drafts, u = make_problem(9, 2, 2, 8)
    args = {"target": p.float(), "draft_token_ids": drafts, "draft_probs": None, "uniforms": u}
    args.update(overrides)
    return args


def _call(args):
    args = dict(args)
    return verify_draft(args.pop("target"), args.pop("draft_token_ids"), args.pop("draft_probs"), **args)


BAD_INPUTS = [
    (TypeError, "`target` must be a torch.Tensor", {"target": [[0.5]]}),
    (TypeError, "`draft_token_ids` must be a torch.Tensor", {"draft_token_ids": [[1, 2]]}),
    (ValueError, "`target` must be float16, bfloat16", {"target": torch.ones(2, 3, 8, dtype=torch.int64)}),
    (
        ValueError,
        "`target` must be on the CPU or a CUDA device",
        {"target": torch.ones(2, 3, 8, device="meta")},
    ),
    (ValueError, "vocabulary size in", {"target": torch.ones(2, 3, 0)}),
    (ValueError, "vocabulary size in", {"target": torch.ones(1, 1, 2**21 + 1)}),
    (
        ValueError,
        "`draft_token_ids` must be on cpu",
        {"draft_token_ids": torch.zeros(2, 2, dtype=torch.int64, device="meta")},
    ),
    (ValueError, "k \\+ 1 >= 1 rows", {"target": torch.ones(2, 0, 8)}),
    (
        ValueError,
        "`draft_token_ids` must have shape \\(2, 2\\)",
        {"draft_token_ids": torch.zeros(2, 3, dtype=torch.int64)},
    ),
    (ValueError, "`num_draft_tokens` must be <= 2", {"num_draft_tokens": [3, 1]}),
    (ValueError, "`num_draft_tokens` must be given for a packed", {"target": torch.ones(6, 8) / 8}),
    (
        ValueError,
        "`draft_token_ids` must be 1-D",
        {"target": torch.ones(6, 8) / 8, "num_draft_tokens": [2, 2]},
    ),
    (
        ValueError,
        "`target` must have sum\\(k \\+ 1\\) = 5 rows",
        {
            "target": torch.ones(6, 8) / 8,
            "draft_token_ids": torch.zeros(3, dtype=torch.int64),
            "num_draft_tokens": [2, 1],
            "uniforms": None,
        },
    ),
    (
        ValueError,
        "`draft_token_ids` must have sum\\(k\\) = 4",
        {
            "target": torch.ones(6, 8) / 8,
            "draft_token_ids": torch.zeros(3, dtype=torch.int64),
            "num_draft_tokens": [2, 2],
            "uniforms": None,
        },
    ),
    (
        ValueError,
        "`num_draft_tokens` must be < 4 \\(the packed target's rows\\), got 4611686018427387904",
        {
            "target": torch.ones(4, 8) / 8,
            "draft_token_ids": torch.zeros(0, dtype=torch.int64),
            "num_draft_tokens": [2**62] * 4,  # sum(k) wraps to 0 in int64: sum(k + 1) = 4 rows
            "uniforms": None,
        },
    ),
    (ValueError, "`target` must be 3-D", {"target": torch.ones(8)}),
    (ValueError, "`num_draft_tokens` must be int32 or int64", {"num_draft_tokens": torch.ones(2)}),
    (TypeError, "`num_draft_tokens` must be a tensor or a sequence of ints", {"num_draft_tokens": "22"}),
    (ValueError, "`num_draft_tokens` must have shape \\[2\\]", {"num_draft_tokens": [1, 1, 1]}),
    (ValueError, "`num_draft_tokens` must be >= 0", {"num_draft_tokens": [-1, 1]}),
    (ValueError, "`draft_token_ids` must be int32 or int64", {"draft_token_ids": torch.zeros(2, 2)}),
    (
        IndexError,
        "`draft_token_ids` must be in \\[0, 8\\), got 8",
        {"draft_token_ids": torch.tensor([[0, 8], [1, 1]])},
    ),
    (
        IndexError,
        "`draft_token_ids` must be in \\[0, 8\\), got -1",
        {"draft_token_ids": torch.tensor([[0, 1], [-1, 1]])},
    ),
    (ValueError, "`draft_probs` must be on cpu", {"draft_probs": torch.ones(2, 2, 8, device="meta")}),
    (ValueError, "`draft_probs` must have shape \\(2, 2, 8\\)", {"draft_probs": torch.ones(2, 2, 7)}),
    (
        ValueError,
        "`draft_probs` must be a float tensor",
        {"draft_probs": torch.ones(2, 2, 8, dtype=torch.int64)},
    ),
    (TypeError, "a tuple \\(ids, probs\\) of tensors", {"draft_probs": (torch.zeros(2, 2, 1),)}),
    (
        ValueError,
        "must both have shape",
        {"draft_probs": (torch.zeros(2, 2, 2, dtype=torch.int64), torch.ones(2, 2, 3))},
    ),
    (
        ValueError,
        "sparse probs must be a float tensor",
        {"draft_probs": (torch.zeros(2, 2, 1, dtype=torch.int64), torch.ones(2, 2, 1, dtype=torch.int64))},
    ),
    (
        ValueError,
        "`draft_probs ids` must be on cpu",
        {"draft_probs": (torch.zeros(2, 2, 1, dtype=torch.int64, device="meta"), torch.ones(2, 2, 1))},
    ),
    (
        ValueError,
        "`draft_probs probs` must be on cpu",
        {"draft_probs": (torch.zeros(2, 2, 1, dtype=torch.int64), torch.ones(2, 2, 1, device="meta"))},
    ),
    (
        IndexError,
        "`draft_probs ids` must be in \\[0, 8\\), got 9",
        {"draft_probs": (torch.full((2, 2, 1), 9), torch.ones(2, 2, 1))},
    ),
    (
        ValueError,
        "ids must be distinct",
        {"draft_probs": (torch.zeros(2, 2, 2, dtype=torch.int64), torch.full((2, 2, 2), 0.5))},
    ),
    (TypeError, "`draft_probs` must be None, a tensor or a tuple", {"draft_probs": [0.5]}),
    (TypeError, "`temperature` must be a float, a tensor or None", {"temperature": "hot"}),
    (
        ValueError,
        "`temperature` must be a floating tensor",
        {"temperature": torch.ones(2, dtype=torch.int64)},
    ),
    (ValueError, "`temperature` must have shape \\(2,\\)", {"temperature": torch.ones(3)}),
    (ValueError, "`temperature` must be finite and >= 0", {"temperature": -1.0}),
    (ValueError, "`temperature` must be finite and >= 0", {"temperature": torch.tensor([1.0, float("nan")])}),
    (ValueError, "`uniforms` must be None when", {"seeds": torch.zeros(2, dtype=torch.int64)}),
    (TypeError, "`uniforms` must be a torch.Tensor", {"uniforms": 0.5}),
    (
        ValueError,
        "`uniforms` must be on cpu",
        {"uniforms": torch.zeros(2, 3, 2, dtype=torch.float64, device="meta")},
    ),
    (ValueError, "`uniforms` must be float64 of shape \\(2, 3, 2\\)", {"uniforms": torch.zeros(2, 3, 2)}),
    (
        ValueError,
        "`uniforms` must be float64 of shape \\(2, 3, 2\\)",
        {"uniforms": torch.zeros(2, 3, 1, dtype=torch.float64)},
    ),
    (ValueError, "`uniforms` must be in \\[0, 1\\)", {"uniforms": torch.ones(2, 3, 2, dtype=torch.float64)}),
    (
        ValueError,
        "`uniforms` must be in \\[0, 1\\)",
        {"uniforms": torch.full((2, 3, 2), float("nan"), dtype=torch.float64)},
    ),
    (ValueError, "`seeds` and `positions` must both be given", {"uniforms": None}),
    (
        ValueError,
        "`seeds` and `positions` must both be given",
        {"uniforms": None, "seeds": torch.zeros(2, dtype=torch.int64)},
    ),
    (
        TypeError,
        "`seeds` must be a torch.Tensor",
        {"uniforms": None, "seeds": [1, 2], "positions": torch.zeros(2, dtype=torch.int64)},
    ),
    (
        ValueError,
        "`seeds` must be on cpu",
        {
            "uniforms": None,
            "seeds": torch.zeros(2, dtype=torch.int64, device="meta"),
            "positions": torch.zeros(2, dtype=torch.int64),
        },
    ),
    (
        ValueError,
        "`positions` must be int32/int64 of shape \\(2,\\)",
        {
            "uniforms": None,
            "seeds": torch.zeros(2, dtype=torch.int64),
            "positions": torch.zeros(3, dtype=torch.int64),
        },
    ),
    (
        ValueError,
        "`positions` must be in \\[0, 2\\*\\*63 - 3\\)",
        {"uniforms": None, "seeds": torch.zeros(2, dtype=torch.int64), "positions": torch.tensor([0, -4])},
    ),
    (
        ValueError,
        "`positions` must be in \\[0, 2\\*\\*63 - 3\\)",
        {
            "uniforms": None,
            "seeds": torch.zeros(2, dtype=torch.int64),
            "positions": torch.tensor([0, 2**63 - 2]),
        },
    ),
    (ValueError, "`num_threads` must be >= 1, got 0", {"num_threads": 0}),
    (TypeError, "`num_threads` must be an int, got float", {"num_threads": 2.0}),
]


@pytest.mark.parametrize("error, match, overrides", BAD_INPUTS, ids=[m for _, m, _ in BAD_INPUTS])
def test_bad_input_raises(error, match, overrides):
    with pytest.raises(error, match=match):
        _call(_ok(**overrides))


def _bad_value(tensor: torch.Tensor, index: tuple, value: float) -> torch.Tensor:
    out = tensor.clone()
    out[index] = value
    return out


def test_bad_values_raise_from_the_native_check():
    args = _ok()
    p = args["target"]
    q = torch.full((2, 2, 8), 1 / 8)
    cases = [
        (
            _ok(target=_bad_value(p, (1, 2, 3), float("nan"))),
            "`target` rows must be probabilities.*request 1 position 2",
        ),
        (
            _ok(target=_bad_value(p, (0, 0, 0), -0.01)),
            "`target` rows must be probabilities.*request 0 position 0",
        ),
        (_ok(target=p * 1.01), "`target` rows must be probabilities.*request 0 position 0"),
        (
            _ok(target=_bad_value(p, (1, 1, 1), float("nan")), temperature=1.0),
            "`target` logits must have no NaN",
        ),
        (
            _ok(target=_bad_value(p, (1, 1, 1), float("inf")), temperature=1.0),
            "`target` logits must have no NaN.*request 1 position 1",
        ),
        (
            _ok(target=torch.full((2, 3, 8), -float("inf")), temperature=1.0),
            "`target` logits must have no NaN",
        ),
        (
            _ok(draft_probs=_bad_value(q, (0, 1, 0), float("nan"))),
            "`draft_probs` rows must be probabilities.*request 0 position 1",
        ),
        (_ok(draft_probs=q * 0.9), "`draft_probs` rows must be probabilities"),
        (
            _ok(draft_probs=(torch.tensor([[[0, 1]] * 2] * 2), torch.full((2, 2, 2), 0.4))),
            "`draft_probs` rows must be probabilities",
        ),
    ]
    for args, match in cases:
        with pytest.raises(ValueError, match=match):
            _call(args)


VERIFY_HEADER = Path(__file__).parents[2] / "csrc" / "include" / "lumen" / "verify_draft.h"


@pytest.mark.parametrize(
    "enum", [verify.ScalarType, verify.TargetKind, verify.DraftKind, verify.VerifyStatus]
)
def test_enums_name_the_headers_values(enum):
    body = re.search(rf"enum class {enum.__name__} : \w+ {{(.*?)}};", VERIFY_HEADER.read_text(), re.DOTALL)
    assert body is not None, f"lumen::{enum.__name__} not found in {VERIFY_HEADER}"
    values = {
        re.sub(r"(?<=[a-z0-9])(?=[A-Z])", "_", name).upper(): int(value)
        for name, value in re.findall(r"\bk(\w+) = (\d+)", body.group(1))
    }
    assert values == {member.name: member.value for member in enum}


def test_native_guards_catch_what_python_would_have(monkeypatch):
    # The native side re-checks ids and temperatures so a call that skips the Python checks
    # still raises instead of reading out of bounds.
    monkeypatch.setattr(verify, "_check_ids", lambda *args: None)
    with pytest.raises(IndexError, match="ids must be in \\[0, V\\).*request 1 position 0"):
        _call(_ok(draft_token_ids=torch.tensor([[0, 1], [1000, 1]])))
    with pytest.raises(IndexError, match="ids must be in \\[0, V\\).*request 0 position 1"):
        _call(_ok(draft_probs=(torch.tensor([[[0], [-5]], [[0], [1]]]), torch.ones(2, 2, 1))))
    monkeypatch.setattr(
        verify, "_verify_temperature", lambda *args: torch.tensor([1.0, -2.0], dtype=torch.float64)
    )
    with pytest.raises(ValueError, match="`temperature` must be finite and >= 0.*request 1"):
        _call(_ok())
    monkeypatch.undo()
    real_layout = verify._verify_layout

    def too_many_drafts(*args):
        layout = real_layout(*args)
        return verify._VerifyLayout(layout.num_requests, 3, torch.full((2,), 3))

    monkeypatch.setattr(verify, "_verify_layout", too_many_drafts)
    with pytest.raises(ValueError, match="`num_draft_tokens` must be in \\[0, out_cols - 1\\].*request 0"):
        _call(_ok())


def _run_unchecked(target, drafts, *, q=None, layout=None, uniforms=None, seeds=None, positions=None):
    """The native CPU op on inputs no Python value check has seen (as on CUDA, where the values
    of device tensors are the kernel's to check); padded layout unless `layout` is given."""
    layout = layout or verify._VerifyLayout(target.shape[0], target.shape[1])
    q = q or verify._DraftQ(verify.DraftKind.ONE_HOT)
    return verify._run(target, drafts, layout, q, None, verify._Draws(uniforms, seeds, positions), 1)


def test_native_checks_the_draws_and_sparse_ids():
    p, _, drafts, u = make_problem(14, 2, 2, 8)
    p = p.float()
    cases = []
    for index, value, where in [
        ((1, 2, 1), 1.0, "request 1 position 2"),
        ((0, 0, 0), float("nan"), "request 0 position 0"),
    ]:
        cases.append(
            ({"uniforms": _bad_value(u, index, value)}, f"`uniforms` must be in \\[0, 1\\).*{where}")
        )
    seeds = torch.zeros(2, dtype=torch.int64)
    for positions, where in [([0, 2**63 - 3], "request 1"), ([-1, 0], "request 0")]:
        cases.append(
            (
                {"seeds": seeds, "positions": torch.tensor(positions)},
                f"`positions` must be in \\[0, 2\\*\\*63 - out_cols\\).*{where}",
            )
        )
    sparse = verify._DraftQ(
        verify.DraftKind.SPARSE,
        torch.full((2, 2, 2), 0.5),
        torch.tensor([[[0, 1], [2, 2]], [[0, 1], [0, 1]]]),
    )
    cases.append(
        ({"q": sparse, "uniforms": u}, "ids must be distinct within each draft row.*request 0 position 1")
    )
    for kwargs, match in cases:
        with pytest.raises(ValueError, match=match):
            _run_unchecked(p, drafts, **kwargs)
    _run_unchecked(p, drafts, seeds=seeds, positions=torch.tensor([0, 2**63 - 4]))  # the last valid one


def test_a_refused_request_emits_nothing_and_check_raises(monkeypatch):
    p, _, drafts, u = make_problem(15, 3, 2, 8)
    monkeypatch.setattr(verify, "_raise_on_status", lambda status: None)
    result = _run_unchecked(p.float(), drafts, uniforms=_bad_value(u, (1, 0, 0), -0.5))
    monkeypatch.undo()
    assert result.num_emitted[1] == 0 and result.num_accepted[1] == 0
    assert torch.equal(result.output_token_ids[1], torch.full((3,), -1))
    assert bool((result.num_emitted[[0, 2]] >= 1).all())
    assert result.status.tolist() == [0, int(verify.VerifyStatus.BAD_UNIFORM) << 32, 0]
    with pytest.raises(ValueError, match="`uniforms` must be in \\[0, 1\\).*request 1 position 0"):
        result.check()
    valid = verify_draft(p.float(), drafts, uniforms=u)
    assert valid.check() is valid and valid.status.tolist() == [0, 0, 0]
    assert (
        VerifyResult(*(valid.output_token_ids, valid.num_accepted, valid.num_emitted)).check().status is None
    )


def test_binding_rechecks_cheap_invariants():
    p, _, drafts, u = make_problem(10, 1, 1, 4)
    p = p.float()
    out = torch.empty(1, 2, dtype=torch.int64)
    counts = [torch.empty(1, dtype=torch.int64) for _ in range(3)]
    meta = torch.tensor([1, 0, 0], dtype=torch.int64)
    buffers = {
        "output_token_ids": out.data_ptr(),
        "num_accepted": counts[0].data_ptr(),
        "num_emitted": counts[1].data_ptr(),
        "status": counts[2].data_ptr(),
        "out_cols": 2,
        "target": p.data_ptr(),
        "dtype": 0,
        "target_kind": 0,
        "draft_kind": 0,
        "num_requests": 1,
        "vocab_size": 4,
        "num_draft_tokens": meta[0:].data_ptr(),
        "target_row_start": meta[1:].data_ptr(),
        "draft_start": meta[2:].data_ptr(),
        "draft_token_ids": drafts.data_ptr(),
        "draft_probs": 0,
        "draft_topk_ids": 0,
        "topk": 0,
        "temperature": 0,
        "uniforms": u.data_ptr(),
        "seeds": 0,
        "positions": 0,
        "sum_tolerance": 1e-3,
    }
    _native.C.verify_draft(buffers, 1)
    assert int(counts[2][0]) == 0
    for key, value, match in [
        ("draft_kind", 3, "out of range"),
        ("vocab_size", 0, "vocab_size outside"),
        ("out_cols", 0, "out_cols < 1"),
        ("target", 0, "address is null"),
        ("uniforms", 0, "address is null"),
        ("draft_kind", 1, "address is null"),
        ("draft_start", 0, "only one of target_row_start and draft_start"),
        ("num_draft_tokens", 0, "address is null"),
    ]:
        with pytest.raises(ValueError, match=match):
            _native.C.verify_draft({**buffers, key: value}, 1)
    with pytest.raises(ValueError, match="num_threads must be >= 1"):
        _native.C.verify_draft(buffers, 0)
    # Null layout arrays: the padded layout with k = out_cols - 1 (here row 0, draft 0 again).
    padded = {**buffers, "num_draft_tokens": 0, "target_row_start": 0, "draft_start": 0}
    before = out.clone()
    _native.C.verify_draft(padded, 1)
    assert int(counts[2][0]) == 0 and torch.equal(out, before)


# ---- CUDA -------------------------------------------------------------------------------------
cuda = pytest.mark.skipif(not _native.HAS_CUDA, reason="no CUDA device or CUDA module")


@pytest.mark.cuda
@cuda
@pytest.mark.parametrize("draft", ["one_hot", "dense", "sparse"])
@pytest.mark.parametrize("vocab_size", [3, 257, 5000, 151936])
def test_cuda_matches_cpu_bit_exact_on_probabilities(draft, vocab_size):
    p, q, drafts, u = make_problem(11, 16, 4, vocab_size, closeness=0.9)
    p, q = p.float(), q.float()
    draft_probs = {"one_hot": None, "dense": q, "sparse": sparse_of(q, drafts, min(8, vocab_size))}[draft]
    cpu = verify_draft(p, drafts, draft_probs, uniforms=u)
    on_gpu = (lambda x: x.cuda()) if draft != "sparse" else (lambda x: tuple(t.cuda() for t in x))
    gpu = verify_draft(
        p.cuda(), drafts.cuda(), None if draft_probs is None else on_gpu(draft_probs), uniforms=u.cuda()
    )
    assert_same(
        cpu, VerifyResult(*(t.cpu() for t in (gpu.output_token_ids, gpu.num_accepted, gpu.num_emitted)))
    )


@pytest.mark.cuda
@cuda
def test_cuda_matches_cpu_on_logits_greedy_packed_and_philox():
    gen = torch.Generator().manual_seed(12)
    ks = [4, 0, 2, 3, 1]
    logits = torch.randn(sum(ks) + len(ks), 32000, generator=gen) * 3
    drafts = torch.randint(0, 32000, (sum(ks),), generator=gen)
    temps = torch.tensor([1.0, 0.7, 0.0, 1.3, 0.0], dtype=torch.float64)
    seeds, positions = torch.arange(5), torch.arange(5) * 100
    cpu = verify_draft(
        logits, drafts, num_draft_tokens=ks, temperature=temps, seeds=seeds, positions=positions
    )
    gpu = verify_draft(
        logits.cuda(),
        drafts.cuda(),
        num_draft_tokens=ks,
        temperature=temps.cuda(),
        seeds=seeds.cuda(),
        positions=positions.cuda(),
    )
    # Logits: CUDA's exp may differ from the C library's in the last bit, so outputs agree
    # except when a uniform falls within ~1e-15 of a CDF boundary (never on these seeds).
    assert torch.equal(cpu.output_token_ids, gpu.output_token_ids.cpu())


@pytest.mark.cuda
@cuda
def test_cuda_rejects_bad_values_and_devices():
    p, _, drafts, u = make_problem(13, 2, 2, 8)
    bad = p.float().clone()
    bad[1, 1, 1] = float("nan")
    result = verify_draft(bad.cuda(), drafts.cuda(), uniforms=u.cuda())  # asynchronous: no raise
    assert result.num_emitted.tolist()[1] == 0
    with pytest.raises(ValueError, match="`target` rows must be probabilities.*request 1 position 1"):
        result.check()
    with pytest.raises(ValueError, match="`uniforms` must be on cuda"):
        verify_draft(p.cuda(), drafts.cuda(), uniforms=u)


def _cuda_kwargs(kwargs):
    return {
        name: (tuple(t.cuda() for t in x) if isinstance(x, tuple) else x.cuda()) for name, x in kwargs.items()
    }


@pytest.mark.cuda
@cuda
def test_cuda_launch_never_waits_for_the_device():
    p, q, drafts, u = make_problem(16, 8, 4, 5000, closeness=0.9)
    p, q = p.float(), q.float()
    ks = torch.tensor([4, 0, 2, 4, 1, 3, 4, 4])
    calls = [
        {"uniforms": u},
        {"seeds": torch.arange(8), "positions": torch.arange(8) * 7},
        {"uniforms": u, "num_draft_tokens": ks, "draft_probs": q},
        {"uniforms": u, "draft_probs": sparse_of(q, drafts, 8)},
        # Device temperatures (greedy: no exp, whose last bit CUDA and libm may differ in).
        {"temperature": torch.zeros(8, dtype=torch.float64), "seeds": torch.arange(8), "positions": ks},
    ]
    on_gpu = [_cuda_kwargs(kwargs) for kwargs in calls]
    target, ids = p.cuda(), drafts.cuda()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")  # any synchronising torch call below raises
    try:
        results = [verify_draft(target, ids, **kwargs) for kwargs in on_gpu]
    finally:
        torch.cuda.set_sync_debug_mode("default")
    for kwargs, gpu in zip(calls, results, strict=True):
        cpu = verify_draft(p, drafts, **kwargs)
        gpu.check()
        assert_same(
            cpu, VerifyResult(gpu.output_token_ids.cpu(), gpu.num_accepted.cpu(), gpu.num_emitted.cpu())
        )


@pytest.mark.cuda
@cuda
def test_cuda_refusals_surface_on_check():
    p, _, _, u = make_problem(17, 2, 2, 8)
    p = p.float()
    cases = [
        (
            {"draft_token_ids": torch.tensor([[0, 1], [8, 1]])},
            IndexError,
            "ids must be in \\[0, V\\).*request 1 position 0",
        ),
        (
            {"uniforms": _bad_value(u, (0, 1, 1), 1.0)},
            ValueError,
            "`uniforms` must be in.*request 0 position 1",
        ),
        ({"num_draft_tokens": torch.tensor([2, 3])}, ValueError, "`num_draft_tokens` must be in.*request 1"),
        (
            {
                "uniforms": None,
                "seeds": torch.zeros(2, dtype=torch.int64),
                "positions": torch.tensor([2**63 - 3, 0]),
            },
            ValueError,
            "`positions` must be in.*request 0",
        ),
        (
            {"temperature": torch.tensor([1.0, -1.0], dtype=torch.float64)},
            ValueError,
            "`temperature` must be finite and >= 0.*request 1",
        ),
        (
            {"draft_probs": (torch.tensor([[[0, 0], [1, 2]], [[0, 1], [0, 1]]]), torch.full((2, 2, 2), 0.5))},
            ValueError,
            "ids must be distinct.*request 0 position 0",
        ),
    ]
    for overrides, error, match in cases:
        args = _cuda_kwargs(
            {name: x for name, x in _ok(target=p, uniforms=u, **overrides).items() if x is not None}
        )
        result = _call({"draft_probs": None, **args})
        with pytest.raises(error, match=match):
            result.check()
