"""``lumen demo``: a live loopback cluster under S&R, FC and LUMEN (issue 9).

A gateway and ``--workers`` worker processes (tiny model, float64) replay a time-scaled slice
of the conversation trace; once a worker runs ``--min-requests`` requests with durable
checkpoints it is SIGKILLed and restarted (recovering: draft first, full model after the
modelled load). The same arrivals (same seed) run once failure-free (the baseline of
recovery time and of output identity) and once per policy. Metrics come from
``lumen_core.metrics``. Timings on a shared machine are illustrative; the correctness
columns (lost, identical, restored) carry the hard claims.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from lumen_core.metrics import nan_mean, recovery_time_s, rolling_means

POLICIES = ("S&R", "FC", "LUMEN")
COLUMNS = (
    "policy", "mean_ttft_s", "mean_tpot_s", "recovery_s", "replay_ttft_s", "lost", "identical", "total",
    "restored", "reprefilled", "accepted_drafts", "acceptance", "coverage", "holder_balance",
)  # fmt: skip


@dataclass(frozen=True)
class DemoOptions:
    workers: int = 4
    duration_s: float = 30.0
    rate_per_s: float = 7.0
    seed: int = 0
    policies: tuple[str, ...] = POLICIES
    repeats: int = 1
    min_requests: int = 4
    min_durable_tokens: int = 32
    failure_at: float = 0.25  # earliest kill, as a fraction of the duration
    max_output_tokens: int = 384
    modelled_full_load_s: float = 6.0
    window_s: float = 3.0
    trace_path: str | None = None  # None: data/traces (or LUMEN_TRACE_DIR)
    tolerance: float = 0.25  # recovery: rolling means within 25% of the failure-free run's (noisy machine)


def _nanmedian(values: list[float]) -> float:
    finite = [v for v in values if not math.isnan(v)]
    return float(np.median(finite)) if finite else math.nan


def run_demo(
    options: DemoOptions, workdir: Path, say: Callable[[str], None]
) -> tuple[list[dict[str, object]], dict[str, object]]:
    """The failure-free run, then each policy ``repeats`` times; one row per policy (medians;
    the worst of the correctness counts) and the first run's rolling means per policy."""
    from lumen_core.sim.workload import load_trace
    from lumen_core.worker.scenario import FailurePlan, arrivals_from_workload, run_scenario

    trace = load_trace(options.trace_path)
    num_requests = max(2, round(options.rate_per_s * options.duration_s))
    workload = trace.head(num_requests).scaled_to_rate(options.rate_per_s)
    arrivals = arrivals_from_workload(
        workload, seed=options.seed, max_output_tokens=options.max_output_tokens
    )
    say(f"{len(arrivals)} requests over {options.duration_s:.0f} s, {options.workers} workers")
    common = {
        "num_workers": options.workers,
        "modelled_full_load_s": options.modelled_full_load_s,
        "seed": options.seed,
    }
    baseline = run_scenario(workdir / "baseline", "LUMEN", arrivals, num_workers=options.workers, failure=None,
                            progress=say, modelled_full_load_s=options.modelled_full_load_s, seed=options.seed)  # fmt: skip
    base_records = baseline.records()
    reference = [r.token_ids for r in baseline.results]
    say(f"failure-free run: {sum(r.finished for r in baseline.results)}/{len(arrivals)} finished")
    plan = FailurePlan(
        not_before_s=options.failure_at * options.duration_s,
        min_requests=options.min_requests,
        min_durable_tokens=options.min_durable_tokens,
    )
    rows: list[dict[str, object]] = []
    starts = np.arange(0.0, options.duration_s, options.window_s / 4)
    timelines: dict[str, object] = {
        "failure-free": (starts, rolling_means(base_records, starts, options.window_s), math.nan)
    }
    for policy in options.policies:
        per_repeat: list[dict[str, object]] = []
        for repeat in range(options.repeats):
            say(f"{policy}: run {repeat + 1}/{options.repeats}")
            result = run_scenario(
                workdir / f"{policy.replace('&', '')}-{repeat}", policy, arrivals, failure=plan, progress=say,
                **common,  # type: ignore[arg-type]
            )  # fmt: skip
            records = result.records()
            ttft = records.ttft_s
            replay = records.replay_ttft_s(result.failure_s)
            horizon = max(1.0, options.duration_s - result.failure_s)
            lost = sum(not r.finished for r in result.results)
            identical = sum(r.token_ids == ref for r, ref in zip(result.results, reference, strict=True))
            per_repeat.append(
                {
                    "policy": policy,
                    "mean_ttft_s": nan_mean(np.where(records.interrupted, np.nan, ttft)),
                    "mean_tpot_s": nan_mean(records.tpot_s),
                    "recovery_s": recovery_time_s(
                        records,
                        base_records,
                        result.failure_s,
                        options.window_s,
                        horizon,
                        tolerance=options.tolerance,
                    ),
                    "replay_ttft_s": nan_mean(replay),
                    "lost": lost,
                    "identical": identical,
                    "total": len(arrivals),
                    "restored": result.restored,
                    "reprefilled": result.reprefilled,
                    "accepted_drafts": result.accepted_drafts,
                    "acceptance": result.acceptance,
                    "coverage": result.coverage,
                    "holder_balance": result.holder_balance,
                }
            )
            if repeat == 0:
                timelines[policy] = (
                    starts,
                    rolling_means(records, starts, options.window_s),
                    result.failure_s,
                )
        row: dict[str, object] = {"policy": policy}
        for key in COLUMNS[1:]:
            values = [float(r[key]) for r in per_repeat]  # type: ignore[arg-type]
            if key == "lost":
                row[key] = int(max(values))
            elif key == "identical":
                row[key] = int(min(values))
            elif key in ("total", "restored", "reprefilled", "accepted_drafts"):
                row[key] = int(np.median(values))
            else:
                row[key] = _nanmedian(values)
        rows.append(row)
    return rows, timelines


def _cell(value: object) -> str:
    if isinstance(value, float):
        return "-" if math.isnan(value) else f"{value:.3f}"
    return str(value)


def print_table(rows: list[dict[str, object]]) -> None:
    lines = [[_cell(row[c]) for c in COLUMNS] for row in rows]
    widths = [max(len(c), *(len(line[i]) for line in lines)) for i, c in enumerate(COLUMNS)]
    print("  ".join(c.ljust(w) for c, w in zip(COLUMNS, widths, strict=True)))
    for line in lines:
        print("  ".join(v.ljust(w) for v, w in zip(line, widths, strict=True)))


def plot_timeline(timelines: dict[str, object], path: Path) -> None:
    from lumen_core.sim.plots import pyplot, save_figure

    figure, axis = pyplot().subplots(figsize=(8, 4))
    for policy, (starts, means, failure_s) in timelines.items():  # type: ignore[misc]
        line = axis.plot(starts, means[0], label=policy, color="black" if math.isnan(failure_s) else None)[0]
        if not math.isnan(failure_s):
            axis.axvline(failure_s, color=line.get_color(), linestyle=":", linewidth=1)
    axis.set_xlabel("arrival time (s); dotted: SIGKILL")
    axis.set_ylabel("rolling mean TTFT (s)")
    axis.set_title("Live loopback cluster, one worker killed (illustrative timings)")
    axis.legend()
    save_figure(figure, path)


def add_demo_parser(commands: argparse._SubParsersAction) -> argparse.ArgumentParser:
    parser = commands.add_parser(
        "demo",
        help="live loopback cluster: one worker SIGKILLed under S&R, FC and LUMEN",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    defaults = DemoOptions()
    parser.add_argument("--workers", type=int, default=defaults.workers)
    parser.add_argument(
        "--duration", type=float, default=defaults.duration_s, help="seconds of replayed arrivals"
    )
    parser.add_argument(
        "--rate", type=float, default=defaults.rate_per_s, help="arrivals per second (whole cluster)"
    )
    parser.add_argument("--seed", type=int, default=defaults.seed)
    parser.add_argument("--trace", default=None, help="CSV with TIMESTAMP, ContextTokens, GeneratedTokens")
    parser.add_argument("--policy", choices=(*POLICIES, "all"), default="all")
    parser.add_argument("--repeats", type=int, default=1, help="runs per policy (medians reported)")
    parser.add_argument("--json", default=None, metavar="PATH", help="one row per policy (null: undefined)")
    parser.add_argument(
        "--plot", default="demo_timeline.png", metavar="PATH", help="PNG timeline ('' for none)"
    )
    parser.add_argument(
        "--workdir", default=None, metavar="DIR", help="secret, models, worker logs (default: temporary)"
    )
    parser.set_defaults(func=run_demo_command)
    return parser


def run_demo_command(args: argparse.Namespace) -> int:
    if args.workers < 3:
        print(f"lumen demo: --workers must be >= 3, got {args.workers}", file=sys.stderr)
        return 2
    if args.repeats < 1 or args.duration <= 0 or args.rate <= 0:
        print("lumen demo: --repeats must be >= 1, --duration and --rate > 0", file=sys.stderr)
        return 2
    options = DemoOptions(
        workers=args.workers,
        duration_s=args.duration,
        rate_per_s=args.rate,
        seed=args.seed,
        policies=POLICIES if args.policy == "all" else (args.policy,),
        repeats=args.repeats,
        trace_path=args.trace,
    )
    started = time.monotonic()

    def say(message: str) -> None:
        print(f"[{time.monotonic() - started:6.1f} s] {message}", file=sys.stderr, flush=True)

    with tempfile.TemporaryDirectory(prefix="lumen-demo-") as scratch:
        workdir = Path(args.workdir) if args.workdir else Path(scratch)
        rows, timelines = run_demo(options, workdir, say)
    print("Live loopback cluster (timings illustrative: shared 2-core machine; "
          f"medians of {options.repeats} run(s)):")  # fmt: skip
    print_table(rows)
    failed = [r["policy"] for r in rows if r["lost"] != 0 or r["identical"] != r["total"]]
    if failed:
        print(f"FAILED: requests lost or outputs differ under {', '.join(map(str, failed))}")
    if args.json:
        finite = [
            {k: None if isinstance(v, float) and not math.isfinite(v) else v for k, v in row.items()}
            for row in rows
        ]
        Path(args.json).write_text(json.dumps(finite, indent=1, allow_nan=False) + "\n")
        print(f"json: {args.json}")
    if args.plot:
        plot_timeline(timelines, Path(args.plot))
        print(f"plot: {args.plot}")
    print(f"wall time {time.monotonic() - started:.1f} s")
    return 1 if failed else 0
