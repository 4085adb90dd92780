"""Token sampling: greedy, or temperature sampling with the package's (seed, position) Philox."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from lumen_core import rng

# Draw index of the package's RNG reserved for sampling a token (verify_draft uses others).
SAMPLE_DRAW_INDEX = 0


def sample_tokens(
    logits: torch.Tensor,
    temperatures: Sequence[float],
    seeds: Sequence[int],
    positions: Sequence[int],
) -> list[int]:
    """One token per row of ``logits`` ``[n, vocab_size]`` (any float dtype and device).

    Row ``i`` is greedy (argmax, lowest id on ties) when ``temperatures[i] == 0``; otherwise it
    is drawn from ``softmax(logits[i] / temperatures[i])`` by inverse CDF in float64 with the
    uniform ``rng.uniforms(seeds[i], positions[i], 0)``, where ``positions[i]`` is the position
    the new token will take. The result depends only on the row, its seed and position, never
    on the other rows. Mutates nothing.
    """
    n = logits.shape[0]
    if not len(temperatures) == len(seeds) == len(positions) == n:
        raise ValueError(
            f"`temperatures`, `seeds` and `positions` must have {n} entries, got "
            f"{len(temperatures)}, {len(seeds)} and {len(positions)}"
        )
    tokens = logits.argmax(dim=-1).tolist()
    sampled = [i for i in range(n) if temperatures[i] > 0]
    if sampled:
        temps = torch.tensor([temperatures[i] for i in sampled], dtype=torch.float64)
        probs = torch.softmax(logits[sampled].to("cpu", torch.float64) / temps[:, None], dim=-1)
        cdf = probs.cumsum(dim=-1)
        u = rng.uniforms(
            np.array([seeds[i] for i in sampled], dtype=np.uint64),
            np.array([positions[i] for i in sampled], dtype=np.int64),
            SAMPLE_DRAW_INDEX,
        )
        targets = torch.from_numpy(u)[:, None] * cdf[:, -1:]
        picks = torch.searchsorted(cdf, targets, right=True)[:, 0].clamp_(max=logits.shape[1] - 1)
        for i, token in zip(sampled, picks.tolist(), strict=True):
            tokens[i] = token
    return tokens
