"""Statistical proof that verify_draft keeps the target distribution, and that the same tests
catch deliberately broken variants.

Thresholds (all seeds fixed, so every run draws the same numbers):
- a correct implementation must reach a chi-square p-value >= ACCEPT_P = 1e-3;
- a broken variant must fall below REJECT_P = 1e-6;
- the grid estimate (exact uniforms on a G x G grid) must lie within 3 / G of the target
  (the accept test and the inverse CDF are step functions of u0 and u1 with at most one step
  per token, so the midpoint rule errs by at most 1/G for acceptance and 2/G for the sample),
  and a broken variant must miss it by more than that.

The broken variants are `spec_verify` with one line changed; `spec_verify` itself is a copy of
``reference.verify_draft_reference`` for small vocabularies (one chunk) and is checked bit for
bit against the native op first, so the bugs are bugs of the real algorithm.
"""

import numpy as np
import pytest
import torch

from lumen_core import _native, rng, verify_draft

# scipy is in the `test` extra; a bare GPU check environment may lack it.
stats = pytest.importorskip("scipy.stats")

pytestmark = pytest.mark.skipif(_native.C is None, reason="native CPU module not built")

ACCEPT_P = 1e-3
REJECT_P = 1e-6
BUGS = ("residual_without_max", "reused_uniform", "bonus_wrong_position", "accept_ignores_q")


# ---- the specification with switchable bugs ---------------------------------------------------
def _sample(w: np.ndarray, u: float) -> int:
    """The chunk rule for V <= 1024: one chunk, left-to-right running sum."""
    running = np.cumsum(w)
    hits = np.nonzero(running > u * running[-1])[0]
    if hits.size:
        return int(hits[0])
    positive = np.nonzero(w > 0)[0]
    return int(positive[-1]) if positive.size else 0


def spec_verify(p: np.ndarray, q: np.ndarray, drafts: np.ndarray, u: np.ndarray, bug: str | None = None):
    """p [k+1, V], q [k, V] float64 shared by all requests; drafts [N, k]; u [N, k+1, 2].
    Returns (output_token_ids [N, k+1] padded -1, num_emitted [N])."""
    num_requests, k = drafts.shape
    out = np.full((num_requests, k + 1), -1, dtype=np.int64)
    num_emitted = np.zeros(num_requests, dtype=np.int64)
    for n in range(num_requests):
        emitted = []
        for i in range(k):
            d = int(drafts[n, i])
            if bug == "accept_ignores_q":
                accepted = u[n, i, 0] < p[i, d]
            else:
                accepted = q[i, d] > 0.0 and u[n, i, 0] * q[i, d] < p[i, d]
            if accepted:
                emitted.append(d)
                continue
            residual = p[i] - q[i] if bug == "residual_without_max" else np.maximum(p[i] - q[i], 0.0)
            u1 = u[n, i, 0] if bug == "reused_uniform" else u[n, i, 1]
            emitted.append(_sample(residual if np.cumsum(residual)[-1] > 1e-12 else p[i], u1))
            break
        else:
            row = k - 1 if bug == "bonus_wrong_position" else k
            emitted.append(_sample(p[row], u[n, k, 1]))
        out[n, : len(emitted)] = emitted
        num_emitted[n] = len(emitted)
    return out, num_emitted


def native_verify(p, q, drafts, u=None, seeds=None, *, draft_probs="dense", temperature=None, target=None):
    """verify_draft over N requests sharing p (or `target` logits) and q."""
    num_requests, k = drafts.shape
    target = torch.from_numpy(p if target is None else target).expand(num_requests, k + 1, -1)
    if draft_probs == "dense":
        draft_probs = torch.from_numpy(q).expand(num_requests, k, -1)
    kwargs = (
        {"uniforms": torch.from_numpy(u)}
        if u is not None
        else {"seeds": torch.from_numpy(seeds), "positions": torch.zeros(num_requests, dtype=torch.int64)}
    )
    res = verify_draft(target, torch.from_numpy(drafts), draft_probs, temperature=temperature, **kwargs)
    return res.output_token_ids.numpy(), res.num_emitted.numpy()


def philox_uniforms(seeds: np.ndarray, k: int) -> np.ndarray:
    """u[n, i, j] = rng.uniforms(seeds[n], i, j): what the native op draws with positions 0."""
    rows = np.arange(k + 1)[None, :]
    return np.stack([rng.uniforms(seeds[:, None].astype(np.uint64), rows, j) for j in (0, 1)], -1)


def random_case(seed: int, k: int, vocab_size: int):
    gen = np.random.default_rng(seed)
    p = gen.dirichlet(np.ones(vocab_size), size=k + 1)
    q = 0.6 * p[:k] + 0.4 * gen.dirichlet(np.ones(vocab_size), size=k)
    return p, q, gen


def sample_drafts(q: np.ndarray, num_requests: int, gen: np.random.Generator) -> np.ndarray:
    return np.stack([gen.choice(q.shape[1], size=num_requests, p=row / row.sum()) for row in q], 1)


def emitted_pvalue(out: np.ndarray, num_emitted: np.ndarray, p: np.ndarray) -> float:
    """One chi-square over all stream positions i: the tokens emitted at position i (by the
    requests that got that far in the step) against p[i]. Cells expected below 5 are merged."""
    stat, dof = 0.0, 0
    for i in range(p.shape[0]):
        tokens = out[num_emitted > i, i]
        if tokens.size == 0:
            continue
        observed = np.bincount(tokens, minlength=p.shape[1]).astype(np.float64)
        expected = tokens.size * p[i]
        small = expected < 5
        if small.any():
            observed = np.append(observed[~small], observed[small].sum())
            expected = np.append(expected[~small], expected[small].sum())
        with np.errstate(divide="ignore", invalid="ignore"):
            terms = np.where(
                expected > 0, (observed - expected) ** 2 / expected, np.where(observed > 0, np.inf, 0.0)
            )
        stat += float(terms.sum())
        dof += observed.size - 1
    return float(stats.chi2.sf(stat, dof))


# ---- 0. the specification copy is the real algorithm ------------------------------------------
def test_spec_copy_matches_native_bit_for_bit():
    p, q, gen = random_case(0, 3, 6)
    drafts = sample_drafts(q, 3000, gen)
    u = gen.random((3000, 4, 2))
    got, got_emitted = native_verify(p, q, drafts, u)
    want, want_emitted = spec_verify(p, q, drafts, u)
    assert np.array_equal(got, want) and np.array_equal(got_emitted, want_emitted)


# ---- 1. exact uniforms on a grid --------------------------------------------------------------
GRID_P = np.array([[0.1, 0.2, 0.3, 0.4], [0.7, 0.1, 0.1, 0.1]])
GRID_Q = np.array([[0.4, 0.3, 0.2, 0.1]])


def grid_errors(verify, grid: int) -> tuple[float, float]:
    """k = 1, every draft d weighted by q(d), (u0, u1) on the grid's midpoints. Returns the
    largest deviation of P(first token = t) from p0(t) and of P(accept, second = t) from
    a * p1(t), a = sum min(p0, q0)."""
    vocab_size = GRID_P.shape[1]
    mids = (np.arange(grid) + 0.5) / grid
    u0, u1 = (x.ravel() for x in np.meshgrid(mids, mids, indexing="ij"))
    drafts = np.repeat(np.arange(vocab_size), grid * grid)[:, None]
    u = np.zeros((drafts.shape[0], 2, 2))
    u[:, 0, 0] = np.tile(u0, vocab_size)
    u[:, 0, 1] = u[:, 1, 1] = np.tile(u1, vocab_size)
    out, num_emitted = verify(GRID_P, GRID_Q, drafts, u)
    weight = GRID_Q[0][drafts[:, 0]] / (grid * grid)
    first = np.bincount(out[:, 0], weights=weight, minlength=vocab_size)
    second = np.bincount(out[num_emitted > 1, 1], weights=weight[num_emitted > 1], minlength=vocab_size)
    accept = np.minimum(GRID_P[0], GRID_Q[0]).sum()
    return float(np.abs(first - GRID_P[0]).max()), float(np.abs(second - accept * GRID_P[1]).max())


def test_grid_of_uniforms_reproduces_the_target():
    grid = 300
    first, second = grid_errors(native_verify, grid)
    assert first <= 3 / grid and second <= 3 / grid


def test_grid_reproduces_the_target_with_the_spec_copy():
    grid = 40
    first, second = grid_errors(spec_verify, grid)
    assert first <= 3 / grid and second <= 3 / grid


@pytest.mark.parametrize("bug", BUGS)
def test_grid_catches_broken_variants(bug):
    grid = 40
    first, second = grid_errors(lambda *a: spec_verify(*a, bug=bug), grid)
    assert max(first, second) > 3 / grid


# ---- 2. chi-square goodness of fit ------------------------------------------------------------
@pytest.mark.parametrize("seed, k", [(1, 1), (2, 2), (3, 4)])
def test_emitted_tokens_fit_the_target(seed, k):
    p, q, gen = random_case(seed, k, 6)
    num_requests = 40_000
    drafts = sample_drafts(q, num_requests, gen)
    out, num_emitted = native_verify(
        p, q, drafts, seeds=np.arange(num_requests, dtype=np.int64) + seed * 10**6
    )
    assert emitted_pvalue(out, num_emitted, p) >= ACCEPT_P
    assert (num_emitted == k + 1).mean() > 0.05  # the bonus position is exercised


def test_one_hot_and_sparse_drafts_fit_the_target():
    p, q, gen = random_case(4, 3, 6)
    num_requests = 40_000
    seeds = np.arange(num_requests, dtype=np.int64)
    # One-hot: the draft is any fixed token (a greedy draft model), q = one-hot at it.
    greedy = np.tile(q.argmax(1), (num_requests, 1))
    out, num_emitted = native_verify(p, q, greedy, seeds=seeds, draft_probs=None)
    assert emitted_pvalue(out, num_emitted, p) >= ACCEPT_P
    # Sparse top-3, drafts sampled from the truncated renormalised distribution.
    ids = np.argsort(-q, 1)[:, :3]
    top = np.take_along_axis(q, ids, 1)
    top = top / top.sum(1, keepdims=True)
    truncated = np.zeros_like(q)
    np.put_along_axis(truncated, ids, top, 1)
    drafts = sample_drafts(truncated, num_requests, gen)
    sparse = (
        torch.from_numpy(ids).expand(num_requests, 3, 3),
        torch.from_numpy(top).expand(num_requests, 3, 3),
    )
    out, num_emitted = native_verify(p, q, drafts, seeds=seeds + 10**6, draft_probs=sparse)
    assert emitted_pvalue(out, num_emitted, p) >= ACCEPT_P


def test_logits_with_temperature_fit_the_softmax():
    gen = np.random.default_rng(5)
    logits = gen.normal(size=(3, 6)) * 2
    temperature = 0.7
    z = np.exp((logits - logits.max(1, keepdims=True)) / temperature)
    p = z / z.sum(1, keepdims=True)
    q = 0.5 * p[:2] + 0.5 / 6
    num_requests = 40_000
    drafts = sample_drafts(q, num_requests, gen)
    out, num_emitted = native_verify(
        p, q, drafts, seeds=np.arange(num_requests, dtype=np.int64), temperature=temperature, target=logits
    )
    assert emitted_pvalue(out, num_emitted, p) >= ACCEPT_P


def test_spec_copy_passes_the_chi_square():
    p, q, gen = random_case(6, 2, 6)
    drafts = sample_drafts(q, 10_000, gen)
    out, num_emitted = spec_verify(p, q, drafts, philox_uniforms(np.arange(10_000), 2))
    assert emitted_pvalue(out, num_emitted, p) >= ACCEPT_P


@pytest.mark.parametrize("bug", BUGS)
@pytest.mark.parametrize("seed, k", [(1, 1), (3, 4)])
def test_chi_square_catches_broken_variants(bug, seed, k):
    p, q, gen = random_case(seed, k, 6)
    drafts = sample_drafts(q, 10_000, gen)
    out, num_emitted = spec_verify(p, q, drafts, philox_uniforms(np.arange(10_000), k), bug=bug)
    assert emitted_pvalue(out, num_emitted, p) < REJECT_P


# ---- 3. accepted lengths ----------------------------------------------------------------------
def acceptance_fit(
    out: np.ndarray, num_emitted: np.ndarray, accept_rate: float, k: int
) -> tuple[float, float]:
    """(chi-square p-value of the accepted-length counts against the truncated geometric law,
    z-score of the mean emitted count against (1 - a^(k+1)) / (1 - a))."""
    accepted = num_emitted - 1
    law = np.array([accept_rate**j * (1 - accept_rate) for j in range(k)] + [accept_rate**k])
    observed = np.bincount(accepted, minlength=k + 1)
    pvalue = float(stats.chisquare(observed, law * accepted.size).pvalue)
    emitted = np.arange(1, k + 2)
    mean = (1 - accept_rate ** (k + 1)) / (1 - accept_rate)
    assert np.isclose((law * emitted).sum(), mean)
    sd = np.sqrt((law * (emitted - mean) ** 2).sum())
    return pvalue, float((num_emitted.mean() - mean) / (sd / np.sqrt(num_emitted.size)))


GEO_P = np.array([0.30, 0.25, 0.15, 0.10, 0.08, 0.06, 0.04, 0.02])
GEO_Q = 0.7 * GEO_P + 0.3 / 8
GEO_K = 4


def geometric_case(num_requests: int, seed: int):
    gen = np.random.default_rng(seed)
    p = np.tile(GEO_P, (GEO_K + 1, 1))
    q = np.tile(GEO_Q, (GEO_K, 1))
    return p, q, sample_drafts(q, num_requests, gen), float(np.minimum(GEO_P, GEO_Q).sum())


def test_accepted_lengths_follow_the_geometric_law():
    num_requests = 40_000
    p, q, drafts, accept_rate = geometric_case(num_requests, 7)
    out, num_emitted = native_verify(p, q, drafts, seeds=np.arange(num_requests, dtype=np.int64))
    pvalue, z = acceptance_fit(out, num_emitted, accept_rate, GEO_K)
    assert pvalue >= ACCEPT_P
    assert abs(z) < 3.3  # two-sided p = 1e-3
    assert emitted_pvalue(out, num_emitted, p) >= ACCEPT_P


def test_accepted_lengths_catch_a_wrong_accept_rule():
    # The other variants change what is emitted, not how much is accepted: the grid and the
    # chi-square catch them.
    p, q, drafts, accept_rate = geometric_case(10_000, 8)
    out, num_emitted = spec_verify(
        p, q, drafts, philox_uniforms(np.arange(10_000), GEO_K), bug="accept_ignores_q"
    )
    pvalue, z = acceptance_fit(out, num_emitted, accept_rate, GEO_K)
    assert pvalue < REJECT_P and abs(z) > 5


@pytest.mark.slow
@pytest.mark.parametrize("vocab_size, num_requests", [(50, 400_000), (2000, 10_000)])
def test_emitted_tokens_fit_the_target_at_larger_vocabularies(vocab_size, num_requests):
    # 2000 > 1024: two chunks of the sampling rule; cells expected below 5 are merged.
    p, q, gen = random_case(9, 2, vocab_size)
    drafts = sample_drafts(q, num_requests, gen)
    out, num_emitted = native_verify(p, q, drafts, seeds=np.arange(num_requests, dtype=np.int64))
    assert emitted_pvalue(out, num_emitted, p) >= ACCEPT_P
