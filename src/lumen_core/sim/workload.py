"""Workloads: the Splitwise conversation trace (or any CSV with its columns), time-scaled to a
target request rate, and seeded synthetic Poisson arrivals. Deterministic for a seed."""

from __future__ import annotations

import csv
import datetime as dt
import os
from dataclasses import dataclass
from pathlib import Path
from typing import cast

import numpy as np

from lumen_core import rng

TRACE_COLUMNS = ("TIMESTAMP", "ContextTokens", "GeneratedTokens")


TRACE_NAME = "AzureLLMInferenceTrace_conv.csv"


def default_trace_path() -> Path:
    """The Splitwise-Conv trace (CC-BY 4.0, ``data/traces/``): ``$LUMEN_TRACE_DIR`` if set, else
    the checkout this module was imported from, else ``data/traces`` under the working
    directory (an installed wheel does not carry the data). Raises FileNotFoundError."""
    env = os.environ.get("LUMEN_TRACE_DIR")
    candidates = [Path(env)] if env else []
    candidates += [Path(__file__).resolve().parents[3] / "data" / "traces", Path.cwd() / "data" / "traces"]
    for directory in candidates:
        if (directory / TRACE_NAME).is_file():
            return directory / TRACE_NAME
    raise FileNotFoundError(
        f"{TRACE_NAME} not found in {[str(c) for c in candidates]}; set LUMEN_TRACE_DIR or pass --trace"
    )


@dataclass(frozen=True, eq=False)
class Workload:
    """Requests sorted by arrival: ``arrival_s`` float64 from 0, token counts int64 (>= 1)."""

    arrival_s: np.ndarray
    prompt_tokens: np.ndarray
    output_tokens: np.ndarray

    def __post_init__(self) -> None:
        n = len(self.arrival_s)
        if len(self.prompt_tokens) != n or len(self.output_tokens) != n:
            raise ValueError(
                f"`prompt_tokens` and `output_tokens` must have {n} entries like `arrival_s`, "
                f"got {len(self.prompt_tokens)} and {len(self.output_tokens)}"
            )
        if n and np.any(np.diff(self.arrival_s) < 0):
            raise ValueError("`arrival_s` must be sorted ascending")
        if n and (self.prompt_tokens.min() < 1 or self.output_tokens.min() < 1):
            raise ValueError("`prompt_tokens` and `output_tokens` must be >= 1")

    def __len__(self) -> int:
        return len(self.arrival_s)

    @property
    def rate_per_s(self) -> float:
        """Mean arrival rate: (n - 1) arrivals over the span."""
        span = float(self.arrival_s[-1] - self.arrival_s[0]) if len(self) > 1 else 0.0
        return (len(self) - 1) / span if span > 0 else 0.0

    @property
    def mean_request_tokens(self) -> float:
        return float(np.mean(self.prompt_tokens + self.output_tokens))

    def scaled_to_rate(self, rate_per_s: float) -> Workload:
        """The same requests with inter-arrival times stretched so the mean rate is ``rate_per_s``."""
        if rate_per_s <= 0:
            raise ValueError(f"`rate_per_s` must be > 0, got {rate_per_s}")
        factor = self.rate_per_s / rate_per_s
        return Workload((self.arrival_s - self.arrival_s[0]) * factor, self.prompt_tokens, self.output_tokens)

    def head(self, num_requests: int) -> Workload:
        """The first ``num_requests`` requests."""
        return Workload(
            self.arrival_s[:num_requests],
            self.prompt_tokens[:num_requests],
            self.output_tokens[:num_requests],
        )

    def thinned(self, step: int) -> Workload:
        """Every ``step``-th request (from the first): the trace's profile over time, at
        ``1 / step`` of its rate."""
        if step < 1:
            raise ValueError(f"`step` must be >= 1, got {step}")
        return Workload(self.arrival_s[::step], self.prompt_tokens[::step], self.output_tokens[::step])

    def until(self, end_s: float) -> Workload:
        """The requests that arrive before ``end_s``."""
        n = int(np.searchsorted(self.arrival_s, end_s, side="left"))
        return self.head(n)


def _parse_timestamp(text: str) -> float:
    # "2023-11-16 18:15:46.6805900": seven fractional digits, which datetime does not parse.
    date_text, _, time_text = text.strip().partition(" ")
    hours, minutes, seconds = time_text.split(":")
    day = dt.date.fromisoformat(date_text).toordinal()
    return day * 86400.0 + int(hours) * 3600.0 + int(minutes) * 60.0 + float(seconds)


def load_trace(path: str | Path | None = None) -> Workload:
    """Read a CSV with columns TIMESTAMP, ContextTokens, GeneratedTokens (Splitwise format).

    Arrivals are relative to the first row and sorted; raises ValueError on missing columns.
    """
    path = default_trace_path() if path is None else Path(path)
    with path.open(newline="") as handle:
        reader = csv.DictReader(handle)
        missing = [c for c in TRACE_COLUMNS if c not in (reader.fieldnames or [])]
        if missing:
            raise ValueError(f"`path` must be a CSV with columns {list(TRACE_COLUMNS)}, missing {missing}")
        rows = [
            (_parse_timestamp(row["TIMESTAMP"]), int(row["ContextTokens"]), int(row["GeneratedTokens"]))
            for row in reader
        ]
    if not rows:
        raise ValueError(f"`path` must hold at least one request, got an empty trace {path}")
    rows.sort(key=lambda r: r[0])
    arrival = np.array([r[0] for r in rows], dtype=np.float64)
    return Workload(
        arrival - arrival[0],
        np.maximum(np.array([r[1] for r in rows], dtype=np.int64), 1),
        np.maximum(np.array([r[2] for r in rows], dtype=np.int64), 1),
    )


def poisson_workload(
    rate_per_s: float,
    num_requests: int,
    prompt_tokens: tuple[int, int],
    output_tokens: tuple[int, int],
    seed: int,
) -> Workload:
    """Poisson arrivals at ``rate_per_s``; lengths uniform over the inclusive ranges.

    Draws come from the package's Philox generator keyed by ``seed`` (index 0 arrivals,
    1 prompts, 2 outputs), so the workload depends on nothing but its arguments.
    """
    if rate_per_s <= 0:
        raise ValueError(f"`rate_per_s` must be > 0, got {rate_per_s}")
    if num_requests < 1:
        raise ValueError(f"`num_requests` must be >= 1, got {num_requests}")
    for name, (lo, hi) in (("prompt_tokens", prompt_tokens), ("output_tokens", output_tokens)):
        if not 1 <= lo <= hi:
            raise ValueError(f"`{name}` must be a range (lo, hi) with 1 <= lo <= hi, got {(lo, hi)}")
    positions = np.arange(num_requests)
    gaps = -np.log1p(-rng.uniforms(seed, positions, index=0)) / rate_per_s
    arrival = np.cumsum(gaps) - gaps[0]

    def lengths(bounds: tuple[int, int], index: int) -> np.ndarray:
        lo, hi = bounds
        draws = np.floor(rng.uniforms(seed, positions, index=index) * (hi - lo + 1)).astype(np.int64)
        # numpy's stubs type arithmetic on an ndarray of unknown dtype as Any.
        return cast(np.ndarray, lo + draws)

    return Workload(arrival, lengths(prompt_tokens, 1), lengths(output_tokens, 2))
