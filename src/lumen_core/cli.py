"""The ``lumen`` command. Subcommands: ``sim`` (the cluster simulator's experiments),
``gateway`` (the live control plane, ``gateway.command``)."""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from collections.abc import Sequence
from pathlib import Path


def _format(value: float | None) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    if abs(value) >= 1000:
        return f"{value:,.0f}"
    return f"{value:.3f}"


def _print_table(outcome: object) -> None:
    rows = outcome.rows  # type: ignore[attr-defined]
    header = ("policy", "workers", "setting", "metric", "ours", "paper")
    lines = []
    for row in rows:
        if row.paper_range is not None:
            paper = f"{row.paper_range[0]:g}-{row.paper_range[1]:g}"
        else:
            paper = _format(row.paper_value)
        lines.append((row.policy, str(row.workers), row.setting, row.metric, _format(row.value), paper))
    widths = [max(len(h), *(len(line[i]) for line in lines)) if lines else len(h) for i, h in enumerate(header)]
    print(f"== {outcome.experiment} ==")  # type: ignore[attr-defined]
    print("  ".join(h.ljust(w) for h, w in zip(header, widths)))
    for line in lines:
        print("  ".join(cell.ljust(w) for cell, w in zip(line, widths)))
    for note in outcome.notes:  # type: ignore[attr-defined]
        print(f"note: {note}")


def _sim(args: argparse.Namespace) -> int:
    from lumen_core.sim.experiments import Options, run_experiment
    from lumen_core.sim.plots import plot_outcome

    options = Options(
        trace_path=args.trace,
        workers=args.workers,
        policy=args.policy,
        seed=args.seed,
        rate_per_worker=args.rate,
        progress=not args.no_progress and sys.stderr.isatty(),
        event_log_path=args.event_log,
    )
    started = time.perf_counter()
    outcome = run_experiment(args.experiment, options)
    wall_s = time.perf_counter() - started
    _print_table(outcome)
    print(f"wall time {wall_s:.2f} s")
    if args.json:
        Path(args.json).write_text(json.dumps([row.as_json() for row in outcome.rows], indent=1) + "\n")
    if args.event_log:
        if Path(args.event_log).is_file():
            print(f"event log: {args.event_log}")
        else:
            print(f"event log: {args.experiment} writes none (it does not compare policies on one scenario)")
    if args.plot:
        paths = plot_outcome(outcome, args.plot)
        for path in paths:
            print(f"plot: {path}")
        if not paths:
            print(f"plot: {args.experiment} has no figure (proto4, proto8, ablation, sensitivity, long_context do)")
    return 0


def build_parser() -> argparse.ArgumentParser:
    from lumen_core.gateway.command import add_gateway_parser
    from lumen_core.policy.presets import POLICY_NAMES
    from lumen_core.sim.experiments import EXPERIMENTS, RATE_PER_WORKER

    parser = argparse.ArgumentParser(prog="lumen", description="Fault-tolerant LLM serving (LUMEN).")
    commands = parser.add_subparsers(dest="command", required=True)
    sim = commands.add_parser("sim", help="run a cluster-simulator experiment")
    sim.add_argument("--experiment", required=True, choices=EXPERIMENTS)
    sim.add_argument("--workers", type=int, default=None, help="cluster size (table1, rack, scale)")
    sim.add_argument("--policy", default="LUMEN", choices=POLICY_NAMES, help="policy of `scale` and of --event-log")
    sim.add_argument("--trace", default=None, help="CSV with TIMESTAMP, ContextTokens, GeneratedTokens")
    sim.add_argument("--seed", type=int, default=0, help="which workers fail; synthetic workloads")
    sim.add_argument(
        "--rate", type=float, default=RATE_PER_WORKER, help="requests per second per worker (calibrated default)"
    )
    sim.add_argument("--json", default=None, metavar="PATH", help="write the rows as JSON")
    sim.add_argument("--plot", default=None, metavar="PATH", help="write PNG figure(s) (PATH, PATH-<name>.png)")
    sim.add_argument(
        "--event-log",
        default=None,
        metavar="PATH",
        help="JSON lines of the policy calls of the --policy run (else the experiment's first policy)",
    )
    sim.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    sim.set_defaults(func=_sim)
    add_gateway_parser(commands)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command == "sim":
        if args.workers is not None and args.workers < 2:
            parser.error(f"--workers must be >= 2, got {args.workers}")
        if args.rate <= 0:
            parser.error(f"--rate must be > 0, got {args.rate}")
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
