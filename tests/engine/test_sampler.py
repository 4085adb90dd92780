"""The sampler: greedy, and temperature sampling keyed by (seed, position)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy import stats

from lumen_core import rng
from lumen_core.engine.sampler import sample_tokens


def test_greedy_takes_argmax_lowest_id_on_ties() -> None:
    logits = torch.tensor([[0.0, 2.0, 2.0, 1.0], [5.0, 0.0, 0.0, 0.0]])
    assert sample_tokens(logits, [0.0, 0.0], [1, 2], [3, 4]) == [1, 0]


def test_sampling_follows_the_philox_uniform_by_inverse_cdf() -> None:
    logits = torch.tensor([[0.0, 1.0, 2.0]], dtype=torch.float64)
    probs = torch.softmax(logits[0] / 0.7, -1).numpy()
    for seed, position in [(1, 0), (2, 5), (3, 7), (2**63 + 5, 2**40)]:
        u = rng.uniforms(np.uint64(seed), position, 0)
        expected = int(np.searchsorted(np.cumsum(probs), u, side="right"))
        assert sample_tokens(logits, [0.7], [seed], [position]) == [expected]


def test_a_row_does_not_depend_on_the_other_rows() -> None:
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 50, generator=generator)
    logits[5] = logits[0]
    temps, seeds, positions = (
        [1.0, 0.0, 0.5, 2.0, 1.0, 1.0],
        [5, 6, 7, 8, 9, 5],
        [10, 11, 12, 13, 14, 10],
    )
    together = sample_tokens(logits, temps, seeds, positions)
    alone = [
        sample_tokens(logits[i : i + 1], temps[i : i + 1], seeds[i : i + 1], positions[i : i + 1])[0]
        for i in range(6)
    ]
    assert together == alone
    assert together[0] == together[5]  # same row, seed and position: same token


def test_sampled_tokens_follow_softmax_over_temperature() -> None:
    logits = torch.tensor([[0.0, 0.5, 1.0, 2.0, -1.0, 0.25]], dtype=torch.float32)
    temperature, n = 1.5, 20000
    tokens = sample_tokens(logits.expand(n, -1), [temperature] * n, [11] * n, list(range(n)))
    counts = np.bincount(tokens, minlength=6)
    expected = torch.softmax(logits[0].double() / temperature, -1).numpy() * n
    assert stats.chisquare(counts, expected).pvalue > 1e-3
    # The same test rejects the untempered distribution, so it has the power to fail.
    wrong = torch.softmax(logits[0].double(), -1).numpy() * n
    assert stats.chisquare(counts, wrong).pvalue < 1e-6


def test_length_mismatch_raises() -> None:
    with pytest.raises(ValueError, match="`temperatures`, `seeds` and `positions` must have 2 entries"):
        sample_tokens(torch.zeros(2, 4), [0.0], [1, 2], [0, 0])
