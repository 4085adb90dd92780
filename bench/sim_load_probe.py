"""The simulator on `lumen demo --full`'s arrivals at other loads (issue 21): where one failure
moves the whole run's mean TTFT, and so where the live cluster can show the policies apart.

For each load (requests per modelled second, prompt scale) the demo's slice of the
conversation trace (``demo.demo_arrivals``: seed, duration, output clip; prompts scaled and
clipped at 1,536 x scale tokens, the demo's 192 at 1/8), the live cluster's setup
(``demo.live_setup``: 4 workers, the --pace cost model, batching limits, heartbeat, holder
room) and one failure of worker ``--worker`` at ``--failure-s``: the mean TTFT of the
requests not interrupted, per policy and failure-free, the interrupted count and recovery.
Output lengths are the arrivals' (the live demo's are the failure-free run's, the same unless
a greedy output stops early). Takes seconds.

    python bench/sim_load_probe.py [--load 32:0.125 --load 40:0.125 ...] [--json PATH]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys

from lumen_core.metrics import nan_mean
from lumen_core.sim.replay import sim_figures, simulate
from lumen_core.worker.demo import FULL, POLICIES, demo_arrivals, live_setup, sim_workload

LOADS = ((32.0, 1 / 8), (32.0, 1 / 2), (40.0, 1 / 8))  # the first: the faithful run of ff78b6c


def _load(text: str) -> tuple[float, float]:
    rate, _, scale = text.partition(":")
    return float(rate), float(scale or 1 / 8)


def probe(rate: float, prompt_scale: float, failure_s: float, worker: int) -> list[dict[str, object]]:
    options = dataclasses.replace(FULL, rate_per_s=rate)
    arrivals = demo_arrivals(options, prompt_scale=prompt_scale, max_prompt_tokens=round(1536 * prompt_scale))
    workload = sim_workload(arrivals, [a.max_new_tokens for a in arrivals])
    setup = live_setup(options)
    baseline = simulate(setup, workload, "LUMEN", None)
    horizon = max(1.0, options.duration_s - failure_s)
    rows: list[dict[str, object]] = []
    common = {"rate_per_s": rate, "prompt_scale": prompt_scale, "requests": len(arrivals)}
    rows.append({**common, "policy": "failure-free", "mean_ttft_s": nan_mean(baseline.records.ttft_s)})
    for policy in POLICIES:
        result = simulate(setup, workload, policy, (failure_s, worker))
        figures = sim_figures(result, baseline, options.window_s, horizon, options.tolerance)
        rows.append(
            {
                **common,
                "policy": policy,
                "mean_ttft_s": figures["sim_mean_ttft_s"],
                "recovery_s": figures["sim_recovery_s"],
                "interrupted": int(figures["sim_interrupted"]),
            }
        )
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--load",
        action="append",
        type=_load,
        default=None,
        metavar="RATE[:PROMPT_SCALE]",
        help="requests per modelled second and prompt scale (default 1/8); repeat for several "
        "(default: 32:0.125, 32:0.5, 40:0.125)",
    )
    parser.add_argument(
        "--failure-s",
        type=float,
        default=FULL.failure_at * FULL.duration_s,
        help="modelled time of the failure (default: the --full run's earliest kill)",
    )
    parser.add_argument("--worker", type=int, default=0, help="the failed worker (default 0)")
    parser.add_argument("--json", default=None, metavar="PATH", help="write the rows as JSON")
    args = parser.parse_args(argv)
    rows = [
        row for rate, scale in args.load or LOADS for row in probe(rate, scale, args.failure_s, args.worker)
    ]
    print(
        f"one failure of worker {args.worker} at {args.failure_s:g} modelled s; mean TTFT (s) not interrupted"
    )
    print(f"{'rate/s':>6}  {'prompts':>7}  {'policy':12}  {'mean TTFT':>9}  {'recovery':>8}  interrupted")
    for row in rows:
        recovery = row.get("recovery_s", math.nan)
        print(
            f"{row['rate_per_s']:6g}  {row['prompt_scale']:7.3f}  {row['policy']!s:12}  "
            f"{row['mean_ttft_s']:9.3f}  {'-' if math.isnan(recovery) else f'{recovery:.1f}':>8}  "  # type: ignore[arg-type]
            f"{row.get('interrupted', '')}"
        )
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(rows, handle, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
