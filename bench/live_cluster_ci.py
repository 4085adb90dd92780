"""Confidence intervals of the paced live cluster's repeats (issue 21), from the JSON that
``lumen demo --full --compare-sim --json PATH`` writes (one row per policy and repeat).

For each policy: the mean over repeats of mean TTFT, TPOT, replay TTFT and recovery, each with a
95% percentile-bootstrap interval over the repeats (resampled ``--resamples`` times, seeded),
the interrupted and restored counts per repeat, the worst overrun, and live / simulated ratios.
Then the pairwise TTFT and recovery reductions (LUMEN vs S&R and vs FC) with their bootstrap
intervals, and whether the intervals of the two policies separate (only then is an ordering
claimed). With three repeats a bootstrap interval is coarse: it spans the repeats' own spread.

    python bench/live_cluster_ci.py full.json [--json ci.json]
"""

from __future__ import annotations

import argparse
import json
import math
import sys

import numpy as np

POLICIES = ("S&R", "FC", "LUMEN")
FIGURES = ("mean_ttft_s", "mean_tpot_s", "replay_ttft_s", "recovery_s")
RESAMPLES = 10_000
MAX_OVERRUN = 0.05  # a run is faithful below this share of overrun steps (docs/live_cluster.md)
MIN_INTERRUPTED = 30


def bootstrap(values: np.ndarray, rng: np.random.Generator, resamples: int) -> tuple[float, float, float]:
    """Mean and 95% percentile-bootstrap interval of the mean of ``values`` (nan-free)."""
    if values.size == 0:
        return math.nan, math.nan, math.nan
    means = rng.choice(values, size=(resamples, values.size), replace=True).mean(axis=1)
    return float(values.mean()), float(np.percentile(means, 2.5)), float(np.percentile(means, 97.5))


def reduction(
    ours: np.ndarray, theirs: np.ndarray, rng: np.random.Generator, resamples: int
) -> tuple[float, float, float]:
    """1 - mean(ours) / mean(theirs), each side resampled on its own, with its 95% interval."""
    if ours.size == 0 or theirs.size == 0:
        return math.nan, math.nan, math.nan
    a = rng.choice(ours, size=(resamples, ours.size)).mean(axis=1)
    b = rng.choice(theirs, size=(resamples, theirs.size)).mean(axis=1)
    ratios = 1.0 - a / b
    return (
        float(1.0 - ours.mean() / theirs.mean()),
        float(np.percentile(ratios, 2.5)),
        float(np.percentile(ratios, 97.5)),
    )


def analyse(rows: list[dict], resamples: int, seed: int) -> dict:
    rng = np.random.default_rng(seed)
    by_policy = {p: [r for r in rows if r["policy"] == p] for p in POLICIES}
    out: dict = {"policies": {}, "reductions": {}, "faithful": True}
    for policy, runs in by_policy.items():
        if not runs:
            continue
        entry: dict = {"repeats": len(runs)}
        for name in FIGURES:
            live = np.array([r[name] for r in runs if r.get(name) is not None and not math.isnan(r[name])])
            entry[name] = bootstrap(live, rng, resamples)
            sim = [r.get(f"sim_{name}") for r in runs]
            sim = np.array([v for v in sim if v is not None and not math.isnan(v)])
            entry[f"{name}_live_over_sim"] = (
                float(live.mean() / sim.mean()) if live.size and sim.size else math.nan
            )
        for name in ("interrupted", "restored", "sim_interrupted", "sim_restored", "accepted_drafts", "lost"):
            entry[name] = [r.get(name) for r in runs]
        entry["identical"] = [f"{r['identical']}/{r['total']}" for r in runs]
        entry["overrun_max"] = max(r["paced_overrun_fraction"] for r in runs)
        entry["restored_within_10pct"] = all(
            abs(r["restored"] - r["sim_restored"]) <= 0.1 * max(r["interrupted"], 1) for r in runs
        )
        out["faithful"] &= (
            entry["overrun_max"] <= MAX_OVERRUN and min(entry["interrupted"]) >= MIN_INTERRUPTED
        )
        out["policies"][policy] = entry
    lumen = by_policy["LUMEN"]
    for base in ("S&R", "FC"):
        for name in ("mean_ttft_s", "recovery_s"):
            ours = np.array([r[name] for r in lumen if r.get(name) is not None and not math.isnan(r[name])])
            theirs = np.array(
                [r[name] for r in by_policy[base] if r.get(name) is not None and not math.isnan(r[name])]
            )
            value, low, high = reduction(ours, theirs, rng, resamples)
            a, b = out["policies"]["LUMEN"][name], out["policies"][base][name]
            out["reductions"][f"{name} LUMEN vs {base}"] = {
                "reduction": value,
                "low": low,
                "high": high,
                "intervals_separate": bool(a[2] < b[1] or b[2] < a[1]),
            }
    return out


def _cell(interval: tuple[float, float, float]) -> str:
    mean, low, high = interval
    return "-" if math.isnan(mean) else f"{mean:.4f} [{low:.4f}, {high:.4f}]"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("rows", help="the JSON of lumen demo --full --compare-sim --json")
    parser.add_argument("--resamples", type=int, default=RESAMPLES)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", default=None, help="write the analysis here")
    args = parser.parse_args()
    with open(args.rows) as handle:
        rows = json.load(handle)
    rows = rows.get("runs", rows) if isinstance(rows, dict) else rows
    result = analyse(rows, args.resamples, args.seed)
    for policy, entry in result["policies"].items():
        print(f"{policy} ({entry['repeats']} repeats, overrun max {entry['overrun_max']:.1%})")
        for name in FIGURES:
            print(f"  {name:14} {_cell(entry[name]):34} live/sim {entry[f'{name}_live_over_sim']:.2f}")
        print(
            f"  interrupted {entry['interrupted']} (sim {entry['sim_interrupted']}), restored "
            f"{entry['restored']} (sim {entry['sim_restored']}), lost {entry['lost']}, "
            f"identical {entry['identical']}"
        )
    for name, r in result["reductions"].items():
        print(
            f"{name}: {r['reduction']:+.1%} [{r['low']:+.1%}, {r['high']:+.1%}]"
            f"{'' if r['intervals_separate'] else ' (intervals overlap: no ordering claimed)'}"
        )
    print(f"faithful: {result['faithful']}")
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(result, handle, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
