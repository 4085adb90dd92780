"""Serving metrics (docs/design.md, Metrics): one module for the simulator, the gateway and the demo.

- TTFT: arrival to first output token. Replay TTFT of an interrupted request: from the
  failure (so detection counts) to its next output token.
- TPOT: mean time between output tokens of a request over its decode,
  ``(last token - first token) / (num_output_tokens - 1)``.
- Evaluation window ``[failure, failure + eval_s]``: mean TTFT and TPOT over the requests that
  arrive in it plus the interrupted ones (replay TTFT for those).
- Recovery time: from the failure until the rolling means of TTFT and TPOT (window ``W``,
  requests grouped by arrival) are both no worse than ``1 + tolerance`` (10%) times the
  failure-free run's in the same windows, for ``num_windows`` (3) consecutive windows.
- Checkpoint coverage, holder balance ratio, acceptance rate.
- Token errors of a client's stream against the failure-free run's: duplicate, missing and
  changed tokens (``count_token_errors``).

Times are seconds on the driver's clock. Unfinished requests carry NaN times.
"""

from __future__ import annotations

import difflib
import math
from dataclasses import dataclass
from typing import cast

import numpy as np


@dataclass(frozen=True, eq=False)
class RequestRecords:
    """Per-request times, one entry per request (any order), float64 seconds, NaN = never.

    ``interrupted``: the request was on a worker when it failed; ``replay_token_s``: the first
    output token after that failure (NaN for requests never interrupted).
    """

    arrival_s: np.ndarray
    first_token_s: np.ndarray
    finish_s: np.ndarray
    num_output_tokens: np.ndarray
    interrupted: np.ndarray
    replay_token_s: np.ndarray

    def __post_init__(self) -> None:
        n = len(self.arrival_s)
        for name in ("first_token_s", "finish_s", "num_output_tokens", "interrupted", "replay_token_s"):
            if len(getattr(self, name)) != n:
                raise ValueError(
                    f"`{name}` must have {n} entries like `arrival_s`, got {len(getattr(self, name))}"
                )

    def __len__(self) -> int:
        return len(self.arrival_s)

    @property
    def ttft_s(self) -> np.ndarray:
        # numpy's stubs type arithmetic on an ndarray of unknown dtype as Any.
        return cast(np.ndarray, self.first_token_s - self.arrival_s)

    @property
    def tpot_s(self) -> np.ndarray:
        """NaN for single-token outputs (no gap between tokens)."""
        gaps = np.maximum(self.num_output_tokens - 1, 0).astype(np.float64)
        with np.errstate(invalid="ignore", divide="ignore"):
            return np.where(gaps > 0, (self.finish_s - self.first_token_s) / gaps, np.nan)

    def replay_ttft_s(self, failure_s: float) -> np.ndarray:
        """Failure to next output token, for the interrupted requests only."""
        return cast(np.ndarray, self.replay_token_s[self.interrupted] - failure_s)


def nan_mean(values: np.ndarray) -> float:
    """The mean of the values that are not NaN (NaN where there are none)."""
    values = values[~np.isnan(values)]
    return float(values.mean()) if values.size else math.nan


def window_means(records: RequestRecords, failure_s: float, eval_s: float) -> dict[str, float]:
    """Means over the evaluation window ``[failure_s, failure_s + eval_s]``.

    Keys: ``mean_ttft_s`` and ``mean_tpot_s`` (arrivals in the window that were not
    interrupted, plus the interrupted requests with their replay TTFT),
    ``noninterrupted_ttft_s``, ``replay_ttft_s``, ``num_requests``, ``num_interrupted``.
    """
    if eval_s <= 0:
        raise ValueError(f"`eval_s` must be > 0, got {eval_s}")
    arrived = (records.arrival_s >= failure_s) & (records.arrival_s <= failure_s + eval_s)
    fresh = arrived & ~records.interrupted
    replay = records.replay_ttft_s(failure_s)
    ttft = np.concatenate([records.ttft_s[fresh], replay])
    tpot = records.tpot_s[fresh | records.interrupted]
    return {
        "mean_ttft_s": nan_mean(ttft),
        "mean_tpot_s": nan_mean(tpot),
        "noninterrupted_ttft_s": nan_mean(records.ttft_s[fresh]),
        "replay_ttft_s": nan_mean(replay),
        "num_requests": int(fresh.sum() + records.interrupted.sum()),
        "num_interrupted": int(records.interrupted.sum()),
    }


def rolling_means(
    records: RequestRecords, starts_s: np.ndarray, window_s: float
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Mean TTFT, mean TPOT and request count of the requests arriving in ``[t, t + window_s)``
    for each ``t`` of ``starts_s``; interrupted requests are left out (they arrived before the
    failure and are measured by replay TTFT). Empty windows give NaN means."""
    if window_s <= 0:
        raise ValueError(f"`window_s` must be > 0, got {window_s}")
    keep = ~records.interrupted & ~np.isnan(records.first_token_s)
    order = np.argsort(records.arrival_s[keep], kind="stable")
    arrival = records.arrival_s[keep][order]
    ttft = records.ttft_s[keep][order]
    tpot = records.tpot_s[keep][order]
    tpot_valid = ~np.isnan(tpot)
    cum_ttft = np.concatenate([[0.0], np.cumsum(ttft)])
    cum_tpot = np.concatenate([[0.0], np.cumsum(np.where(tpot_valid, tpot, 0.0))])
    cum_tpot_n = np.concatenate([[0], np.cumsum(tpot_valid)])
    lo = np.searchsorted(arrival, starts_s, side="left")
    hi = np.searchsorted(arrival, starts_s + window_s, side="left")
    count = hi - lo
    tpot_count = cum_tpot_n[hi] - cum_tpot_n[lo]
    with np.errstate(invalid="ignore", divide="ignore"):
        mean_ttft = np.where(count > 0, (cum_ttft[hi] - cum_ttft[lo]) / count, np.nan)
        mean_tpot = np.where(tpot_count > 0, (cum_tpot[hi] - cum_tpot[lo]) / tpot_count, np.nan)
    return mean_ttft, mean_tpot, count


def recovery_time_s(
    records: RequestRecords,
    baseline: RequestRecords,
    failure_s: float,
    window_s: float,
    horizon_s: float,
    tolerance: float = 0.1,
    num_windows: int = 3,
    step_s: float | None = None,
) -> float:
    """Seconds from ``failure_s`` to the first start ``t`` (on a grid of ``step_s``, default
    ``window_s / 5``) such that the ``num_windows`` consecutive windows ``[t + i W, t + (i+1) W)``
    all have mean TTFT and mean TPOT no worse than ``1 + tolerance`` times ``baseline``'s (the
    failure-free run of the same workload) in the same windows. Faster than the baseline counts
    as recovered: a survivor that LUMEN's drafts speed up has nothing to recover from (a
    two-sided band held the simulated LUMEN runs "unrecovered" until the drafting stopped). A
    window without requests in either run counts as within, but all ``num_windows`` windows
    must end before the last arrival of either run (a run that is over shows no recovery). NaN
    if that never happens before ``failure_s + horizon_s``."""
    if tolerance <= 0:
        raise ValueError(f"`tolerance` must be > 0, got {tolerance}")
    if num_windows < 1:
        raise ValueError(f"`num_windows` must be >= 1, got {num_windows}")
    if horizon_s <= 0:
        raise ValueError(f"`horizon_s` must be > 0, got {horizon_s}")
    step_s = window_s / 5.0 if step_s is None else step_s
    if step_s <= 0:
        raise ValueError(f"`step_s` must be > 0, got {step_s}")
    starts = failure_s + np.arange(0.0, horizon_s + num_windows * window_s, step_s)
    ttft, tpot, _ = rolling_means(records, starts, window_s)
    base_ttft, base_tpot, _ = rolling_means(baseline, starts, window_s)

    def within(value: np.ndarray, base: np.ndarray) -> np.ndarray:
        missing = np.isnan(value) | np.isnan(base)
        with np.errstate(invalid="ignore"):
            return cast(np.ndarray, missing | (value <= (1.0 + tolerance) * base))

    ok = within(ttft, base_ttft) & within(tpot, base_tpot)
    per_window = int(round(window_s / step_s))
    observed_until = min(
        float(np.max(records.arrival_s, initial=-np.inf)), float(np.max(baseline.arrival_s, initial=-np.inf))
    )
    for i, start in enumerate(starts):
        if start - failure_s > horizon_s or start + num_windows * window_s > observed_until:
            break
        indices = [i + j * per_window for j in range(num_windows)]
        if indices[-1] < len(ok) and all(ok[j] for j in indices):
            return float(start - failure_s)
    return math.nan


# "All but the last few tokens" of checkpoint coverage (docs/design.md, Metrics): a checkpoint may
# trail its request by the tokens of the steps not yet flushed. Both drivers measure with it.
COVERAGE_SLACK_TOKENS = 16


def checkpoint_coverage(
    context_tokens: np.ndarray, durable_tokens: np.ndarray, slack_tokens: int = COVERAGE_SLACK_TOKENS
) -> float:
    """Fraction of running requests whose durable checkpoint covers all but the last
    ``slack_tokens`` tokens of their context. NaN without running requests."""
    context_tokens = np.asarray(context_tokens)
    durable_tokens = np.asarray(durable_tokens)
    if context_tokens.shape != durable_tokens.shape:
        raise ValueError(
            f"`durable_tokens` must have the shape of `context_tokens` {context_tokens.shape}, "
            f"got {durable_tokens.shape}"
        )
    if slack_tokens < 0:
        raise ValueError(f"`slack_tokens` must be >= 0, got {slack_tokens}")
    if context_tokens.size == 0:
        return math.nan
    return float(np.mean(durable_tokens >= context_tokens - slack_tokens))


def holder_balance_ratio(held_loads: np.ndarray) -> float:
    """Max over min of the checkpoint load held by each live holder (1.0 = perfectly even;
    inf when one holder holds nothing while another holds something; NaN without holders)."""
    held_loads = np.asarray(held_loads, dtype=np.float64)
    if held_loads.size == 0:
        return math.nan
    high, low = float(held_loads.max()), float(held_loads.min())
    if high == 0.0:
        return 1.0
    return high / low if low > 0 else math.inf


def acceptance_rate(accepted_tokens: float, proposed_tokens: float) -> float:
    """Accepted draft tokens over proposed ones (NaN when nothing was proposed)."""
    if accepted_tokens < 0 or proposed_tokens < 0:
        raise ValueError(
            f"`accepted_tokens` and `proposed_tokens` must be >= 0, got {accepted_tokens}, {proposed_tokens}"
        )
    if accepted_tokens > proposed_tokens:
        raise ValueError(
            f"`accepted_tokens` must be <= `proposed_tokens`, got {accepted_tokens} > {proposed_tokens}"
        )
    return accepted_tokens / proposed_tokens if proposed_tokens else math.nan


def run_figures(
    records: RequestRecords,
    baseline: RequestRecords,
    failure_s: float,
    window_s: float,
    horizon_s: float,
    tolerance: float,
) -> dict[str, float]:
    """The demo's timing figures of one run, live or simulated alike: ``mean_ttft_s`` of the
    requests not interrupted, ``mean_tpot_s``, ``replay_ttft_s`` of the interrupted ones and
    ``recovery_s`` against ``baseline`` (the failure-free run of the same arrivals)."""
    return {
        "mean_ttft_s": nan_mean(np.where(records.interrupted, np.nan, records.ttft_s)),
        "mean_tpot_s": nan_mean(records.tpot_s),
        "recovery_s": recovery_time_s(records, baseline, failure_s, window_s, horizon_s, tolerance=tolerance),
        "replay_ttft_s": nan_mean(records.replay_ttft_s(failure_s)),
    }


def count_token_errors(expected: list[int], received: list[int]) -> tuple[int, int, int]:
    """(duplicate, missing, changed) tokens of ``received`` against ``expected``: tokens in
    excess, tokens absent, and tokens in place but different, from a minimal alignment."""
    duplicate = missing = changed = 0
    for op, i1, i2, j1, j2 in difflib.SequenceMatcher(None, expected, received, autojunk=False).get_opcodes():
        if op == "insert":
            duplicate += j2 - j1
        elif op == "delete":
            missing += i2 - i1
        elif op == "replace":
            changed += min(i2 - i1, j2 - j1)
            duplicate += max(0, (j2 - j1) - (i2 - i1))
            missing += max(0, (i2 - i1) - (j2 - j1))
    return duplicate, missing, changed
