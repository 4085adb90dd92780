"""``lumen demo``: a live loopback cluster under S&R, FC and LUMEN (issue 9).

A gateway and ``--workers`` worker processes (tiny model, float64) replay a time-scaled slice
of the conversation trace; once a worker runs ``--min-requests`` requests with durable
checkpoints it is SIGKILLed and restarted (recovering: draft first, full model after the
modelled load). The same arrivals (same seed) run once failure-free (the baseline of
recovery time and of output identity) and once per policy. Metrics come from
``lumen_core.metrics``.

Paced (``--pace``, on by default): every engine step and restore lasts what the cost model
gives for the named setup (default Qwen3-32B on 2 H100s per worker), model and draft loads
too, all stretched by ``--time-scale`` together with the arrival clock; figures are in
modelled seconds. The live cluster then emulates that hardware: its figures show what LUMEN's
mechanisms do under that model, run by real processes (queueing, batching, streaming,
failure detection, directives, restores, draft verification); they validate the simulator's
event, queueing and streaming logic, not its cost model. ``paced_overrun_fraction`` is the
share of steps whose real compute took longer than their paced time; above 5% the run is
not faithful to the modelled hardware and says so. ``--pace none``: unpaced, tiny-model
timings (illustrative only; the correctness columns carry the claims).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from lumen_core.metrics import count_token_errors, rolling_means, run_figures
from lumen_core.pacing import FAITHFUL_OVERRUN_FRACTION, parse_pace

if TYPE_CHECKING:
    from lumen_core.sim.cluster import SimResult
    from lumen_core.sim.replay import LiveSetup
    from lumen_core.sim.workload import Workload
    from lumen_core.worker.scenario import Arrival

POLICIES = ("S&R", "FC", "LUMEN")
COLUMNS = (
    "policy", "mean_ttft_s", "mean_tpot_s", "recovery_s", "replay_ttft_s", "lost", "identical", "total",
    "broken_streams", "duplicate_tokens", "missing_tokens", "interrupted", "restored", "reprefilled",
    "accepted_drafts", "acceptance", "coverage", "holder_balance", "paced_overrun_fraction",
)  # fmt: skip
# With --compare-sim: the simulator's figures on the same arrivals (lumen_core.sim.replay).
SIM_COLUMNS = (
    "sim_mean_ttft_s", "sim_mean_tpot_s", "sim_recovery_s", "sim_replay_ttft_s", "sim_interrupted",
    "sim_restored", "sim_reprefilled", "sim_accepted_drafts",
)  # fmt: skip
# The client's view: streams that broke off, tokens sent twice or never, summed over requests
# (worst repeat).
STREAM_ERRORS = ("broken_streams", "duplicate_tokens", "missing_tokens")
COUNTS = ("total", "interrupted", "restored", "reprefilled", "accepted_drafts")
COUNTS += tuple(f"sim_{c}" for c in COUNTS[1:])
DEFAULT_PACE = "qwen3-32b/h100x2"


@dataclass(frozen=True)
class DemoOptions:
    workers: int = 4
    duration_s: float = 20.0
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
    tolerance: float = 0.25  # recovery: rolling means <= 1.25x the failure-free run's (noisy machine)
    pace: str | None = DEFAULT_PACE  # None: unpaced (tiny-model timings, modelled_full_load_s)
    time_scale: float = 4.0  # real seconds per modelled second (paced steps and arrivals)
    compare_sim: bool = False  # also run the simulator on the same arrivals (needs pace)


# The faithful run (budget: docs/live_cluster.md): ~36 requests running per worker, so the
# kill (once a worker runs 30 with durable checkpoints) interrupts at least 30, and the three
# survivors queue while the dead worker reloads (at 32/s they absorbed its share unqueued).
FULL = DemoOptions(workers=4, duration_s=36.0, rate_per_s=40.0, time_scale=8.0, repeats=3, min_requests=30)


def _nanmedian(values: list[float]) -> float:
    finite = [v for v in values if not math.isnan(v)]
    return float(np.median(finite)) if finite else math.nan


def run_demo(
    options: DemoOptions, workdir: Path, say: Callable[[str], None]
) -> tuple[list[dict[str, object]], list[dict[str, object]], dict[str, object]]:
    """The failure-free run, then each policy ``repeats`` times; one row per policy (medians;
    the worst of the correctness counts and of the overrun fraction), one per policy and
    repeat (with its ``repeat`` index; intervals over repeats need these) and the first
    run's rolling means per policy."""
    from lumen_core.worker.scenario import KillRule, run_scenario

    arrivals = demo_arrivals(options)
    say(f"{len(arrivals)} requests over {options.duration_s:.0f} s, {options.workers} workers")
    common = {
        "num_workers": options.workers,
        "seed": options.seed,
        "time_scale": options.time_scale,
        "pace": options.pace,
        # Paced: the loads of the --pace setup (times the time scale), from the worker.
        "modelled_full_load_s": None if options.pace else options.modelled_full_load_s,
        "modelled_draft_load_s": None if options.pace else 0.05,
    }
    baseline = run_scenario(workdir / "baseline", "LUMEN", arrivals, failure=None, progress=say, **common)  # type: ignore[arg-type]
    base_records = baseline.records()
    reference = [r.token_ids for r in baseline.results]
    replay = _SimReplay(options, arrivals, reference) if options.compare_sim else None
    plan = KillRule(
        not_before_s=options.failure_at * options.duration_s,
        min_requests=options.min_requests,
        min_durable_tokens=options.min_durable_tokens,
    )
    rows: list[dict[str, object]] = []
    runs: list[dict[str, object]] = []
    starts = np.arange(0.0, options.duration_s, options.window_s / 4)
    timelines: dict[str, object] = {
        "failure-free": (starts, rolling_means(base_records, starts, options.window_s), math.nan)
    }
    for policy in options.policies:
        per_repeat: list[dict[str, object]] = []  # this policy's runs, in order
        for repeat in range(options.repeats):
            say(f"{policy}: run {repeat + 1}/{options.repeats}")
            result = run_scenario(
                workdir / f"{policy.replace('&', '')}-{repeat}", policy, arrivals, failure=plan, progress=say,
                **common,  # type: ignore[arg-type]
            )  # fmt: skip
            records = result.records()
            lost = sum(not r.finished for r in result.results)
            identical = sum(r.token_ids == ref for r, ref in zip(result.results, reference, strict=True))
            errors = [count_token_errors(ref, r.token_ids) for r, ref in zip(result.results, reference)]
            horizon = max(1.0, options.duration_s - result.failure_s)
            per_repeat.append(
                {
                    "policy": policy,
                    **run_figures(
                        records, base_records, result.failure_s, options.window_s, horizon, options.tolerance
                    ),
                    "lost": lost,
                    "identical": identical,
                    "total": len(arrivals),
                    "broken_streams": sum(1 for r in result.results if r.error or not r.finished),
                    "duplicate_tokens": sum(e[0] for e in errors),
                    "missing_tokens": sum(e[1] for e in errors),
                    "interrupted": len(result.interrupted_ids),
                    "restored": result.restored,
                    "reprefilled": result.reprefilled,
                    "accepted_drafts": result.accepted_drafts,
                    "acceptance": result.acceptance,
                    "coverage": result.coverage,
                    "holder_balance": result.holder_balance,
                    "paced_overrun_fraction": result.paced_overrun_fraction,
                }
            )
            simulated = None
            if replay is not None:
                simulated = replay.run(policy, result.failure_s, result.failed_worker_id)
                per_repeat[-1].update(replay.figures(simulated, horizon))
            if repeat == 0:
                timelines[policy] = (
                    starts,
                    rolling_means(records, starts, options.window_s),
                    result.failure_s,
                )
                if simulated is not None:
                    timelines[f"{policy} (sim)"] = (
                        starts,
                        rolling_means(simulated.records, starts, options.window_s),
                        simulated.failure_s,
                    )
        row: dict[str, object] = {"policy": policy}
        for key in (*COLUMNS[1:], *(SIM_COLUMNS if replay is not None else ())):
            values = [float(r[key]) for r in per_repeat]  # type: ignore[arg-type]
            if key == "lost" or key in STREAM_ERRORS:
                row[key] = int(max(values))
            elif key == "identical":
                row[key] = int(min(values))
            elif key == "paced_overrun_fraction":  # the worst run, the failure-free one included
                row[key] = _nanmax([*values, baseline.paced_overrun_fraction])
            elif key in COUNTS:
                row[key] = int(np.median(values))
            else:
                row[key] = _nanmedian(values)
        rows.append(row)
        runs.extend({**r, "repeat": i} for i, r in enumerate(per_repeat))
    return rows, runs, timelines


def demo_arrivals(
    options: DemoOptions, *, prompt_scale: float = 1 / 8, max_prompt_tokens: int = 192
) -> list[Arrival]:
    """The demo's requests: the head of the trace at ``options.rate_per_s`` for its duration,
    token counts scaled and clipped (``scenario.arrivals_from_workload``)."""
    from lumen_core.sim.workload import load_trace
    from lumen_core.worker.scenario import arrivals_from_workload

    trace = load_trace(options.trace_path)
    num_requests = max(2, round(options.rate_per_s * options.duration_s))
    workload = trace.head(num_requests).scaled_to_rate(options.rate_per_s)
    return arrivals_from_workload(
        workload,
        seed=options.seed,
        prompt_scale=prompt_scale,
        max_prompt_tokens=max_prompt_tokens,
        max_output_tokens=options.max_output_tokens,
    )


def live_setup(options: DemoOptions) -> LiveSetup:
    """What the demo's live cluster runs with, for the simulator (``sim.replay``): its workers,
    the ``--pace`` cost model, the engine's batching limits, heartbeat (modelled seconds) and
    holder room."""
    from lumen_core.engine import SchedulerConfig
    from lumen_core.sim.replay import LiveSetup
    from lumen_core.worker.cluster import HEARTBEAT_S, HOLDER_BUDGET_BYTES, TINY_RECORD_BYTES
    from lumen_core.worker.process import WorkerConfig

    if options.pace is None:
        raise ValueError("the simulator needs a paced setup (`pace`), got None")
    cost = parse_pace(options.pace)
    return LiveSetup(
        num_workers=options.workers,
        model=cost.model.name,
        gpu=cost.gpu.name,
        tp=cost.tp,
        max_batched_tokens=SchedulerConfig().max_num_batched_tokens,
        max_num_seqs=WorkerConfig.max_num_seqs,
        heartbeat_s=HEARTBEAT_S / options.time_scale,
        holder_budget_tokens=HOLDER_BUDGET_BYTES // (TINY_RECORD_BYTES + 8),
        acceptance=math.nan,
    )


def sim_workload(arrivals: list[Arrival], output_tokens: list[int]) -> Workload:
    """The simulator's workload of ``arrivals`` (modelled arrival times, prompt lengths) with
    these output lengths."""
    from lumen_core.sim.workload import Workload

    return Workload(
        arrival_s=np.array([a.time_s for a in arrivals], dtype=np.float64),
        prompt_tokens=np.array([len(a.prompt_token_ids) for a in arrivals], dtype=np.int64),
        output_tokens=np.array(output_tokens, dtype=np.int64),
    )


class _SimReplay:
    """The simulator on the demo's arrivals: the live run's requests (prompt lengths, the
    failure-free run's output lengths, modelled arrival times), cluster size, cost model,
    batching limits, heartbeat and holder budget; its own failure-free baseline."""

    def __init__(self, options: DemoOptions, arrivals: list[Arrival], reference: list[list[int]]) -> None:
        from lumen_core.sim.replay import simulate

        self.options = options
        self.setup = live_setup(options)
        self.workload = sim_workload(arrivals, [max(1, len(tokens)) for tokens in reference])
        self._simulate = simulate
        self.baseline = simulate(self.setup, self.workload, "LUMEN", None)

    def run(self, policy: str, failure_s: float, worker_id: int) -> SimResult:
        return self._simulate(self.setup, self.workload, policy, (failure_s, worker_id))

    def figures(self, simulated: SimResult, horizon_s: float) -> dict[str, float]:
        from lumen_core.sim.replay import sim_figures

        return sim_figures(simulated, self.baseline, self.options.window_s, horizon_s, self.options.tolerance)


# Live and simulated side by side: (live column, simulated column).
COMPARED = (
    ("mean_ttft_s", "sim_mean_ttft_s"), ("mean_tpot_s", "sim_mean_tpot_s"),
    ("replay_ttft_s", "sim_replay_ttft_s"), ("recovery_s", "sim_recovery_s"),
    ("interrupted", "sim_interrupted"), ("restored", "sim_restored"),
    ("accepted_drafts", "sim_accepted_drafts"),
)  # fmt: skip


def print_comparison(rows: list[dict[str, object]]) -> None:
    """One line per policy and figure: live, simulated and their ratio."""
    print(f"{'policy':8}  {'figure':16}  {'live':>10}  {'simulated':>10}  {'live/sim':>8}")
    for row in rows:
        for live, sim in COMPARED:
            a, b = float(row[live]), float(row[sim])  # type: ignore[arg-type]
            ratio = a / b if b and not (math.isnan(a) or math.isnan(b)) else math.nan
            print(
                f"{row['policy']!s:8}  {live:16}  "
                f"{_cell(row[live]):>10}  {_cell(row[sim]):>10}  {_cell(ratio):>8}"
            )


def _nanmax(values: list[float]) -> float:
    finite = [v for v in values if not math.isnan(v)]
    return max(finite) if finite else math.nan


def faithful(rows: list[dict[str, object]]) -> bool:
    """Whether every run's paced steps overran at most ``FAITHFUL_OVERRUN_FRACTION`` of the
    time (an unpaced run, NaN, is not faithful to any hardware)."""
    fractions = [float(r["paced_overrun_fraction"]) for r in rows]  # type: ignore[arg-type]
    return all(f <= FAITHFUL_OVERRUN_FRACTION for f in fractions) and bool(fractions)


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


def plot_timeline(
    timelines: dict[str, object], path: Path, title: str = "Live loopback cluster, one worker killed"
) -> None:
    """Rolling mean TTFT per run: live solid, simulated (names ending " (sim)") dashed in
    the colour of their live run, the failure-free run black, each SIGKILL dotted."""
    from lumen_core.sim.plots import pyplot, save_figure

    figure, axis = pyplot().subplots(figsize=(8, 4))
    colors: dict[str, str] = {}
    for name, (starts, means, failure_s) in timelines.items():  # type: ignore[misc]
        live_name = name.removesuffix(" (sim)")
        simulated = live_name != name
        color = "black" if math.isnan(failure_s) else colors.get(live_name)
        line = axis.plot(starts, means[0], label=name, color=color, linestyle="--" if simulated else "-")[0]
        colors.setdefault(live_name, line.get_color())
        if not math.isnan(failure_s) and not simulated:
            axis.axvline(failure_s, color=line.get_color(), linestyle=":", linewidth=1)
    axis.set_xlabel("arrival time (modelled s when paced); dotted: SIGKILL; dashed: simulator")
    axis.set_ylabel("rolling mean TTFT (s)")
    axis.set_title(title)
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
    parser.add_argument("--workers", type=int, default=None, help=f"default {defaults.workers}")
    parser.add_argument(
        "--duration",
        type=float,
        default=None,
        help=f"modelled seconds of arrivals (default {defaults.duration_s:g})",
    )
    parser.add_argument(
        "--rate",
        type=float,
        default=None,
        help=f"arrivals per modelled second (default {defaults.rate_per_s:g})",
    )
    parser.add_argument("--seed", type=int, default=defaults.seed)
    parser.add_argument(
        "--pace",
        default=DEFAULT_PACE,
        metavar="MODEL/GPUxTP",
        help=f"modelled setup every step is paced to (default {DEFAULT_PACE}; 'none': unpaced)",
    )
    parser.add_argument(
        "--time-scale",
        type=float,
        default=None,
        help=f"real seconds per modelled second, for paced steps, loads and arrivals alike "
        f"(default {defaults.time_scale:g})",
    )
    parser.add_argument(
        "--full",
        action="store_true",
        help=f"the faithful run for bench/RESULTS.md (docs/live_cluster.md): {FULL.workers} workers, "
        f"{FULL.duration_s:g} s at {FULL.rate_per_s:g}/s, time scale {FULL.time_scale:g}, "
        f"{FULL.repeats} repeats (flags override)",
    )
    parser.add_argument(
        "--compare-sim",
        action="store_true",
        help="also run the simulator on the same arrivals and print live and simulated figures side by side",
    )
    parser.add_argument("--trace", default=None, help="CSV with TIMESTAMP, ContextTokens, GeneratedTokens")
    parser.add_argument("--policy", choices=(*POLICIES, "all"), default="all")
    parser.add_argument("--repeats", type=int, default=None, help="runs per policy (medians reported)")
    parser.add_argument(
        "--json", default=None, metavar="PATH", help="one row per policy and repeat (null: undefined)"
    )
    parser.add_argument(
        "--plot", default="demo_timeline.png", metavar="PATH", help="PNG timeline ('' for none)"
    )
    parser.add_argument(
        "--workdir", default=None, metavar="DIR", help="secret, models, worker logs (default: temporary)"
    )
    parser.add_argument(
        "--scenario",
        choices=("kill", "drain"),
        default="kill",
        help="kill: one worker SIGKILLed under each policy (default); drain: one worker running 16 "
        "requests drained (lumen drain), its requests moved (worker/drain.py); --json rows metric, value",
    )
    parser.add_argument(
        "--engine",
        choices=("reference", "vllm"),
        default="reference",
        help="vllm: 3 vLLM servers (CPU) with their agents behind the front door, --scenario kill "
        "(lumen_core.worker.vllm_demo; uses --policy, --seed, --json, --workdir, --streams, --prompt-tokens)",
    )
    parser.add_argument("--streams", type=int, default=16, help="--engine vllm: concurrent streams")
    parser.add_argument(
        "--prompt-tokens", type=int, default=300, help="--engine vllm: each stream's prompt length (300)"
    )
    parser.set_defaults(func=run_demo_command)
    return parser


def _run_drain_command(args: argparse.Namespace) -> int:
    """``--scenario drain``: the live drain (``worker.drain``) under --policy (LUMEN for all)."""
    from lumen_core.worker.drain import run_drain

    started = time.monotonic()

    def say(message: str) -> None:
        print(f"[{time.monotonic() - started:6.1f} s] {message}", file=sys.stderr, flush=True)

    policy = "LUMEN" if args.policy == "all" else args.policy
    with tempfile.TemporaryDirectory(prefix="lumen-drain-") as scratch:
        workdir = Path(args.workdir) if args.workdir else Path(scratch)
        result = run_drain(workdir, policy=policy, seed=args.seed, progress=say)
    rows = result.rows()
    for row in rows:
        print(f"{row['metric']:<40} {row['value']}")
    if args.json:
        finite = [
            {k: None if isinstance(v, float) and not math.isfinite(v) else v for k, v in row.items()}
            for row in rows
        ]
        Path(args.json).write_text(json.dumps(finite, indent=1, allow_nan=False) + "\n")
        print(f"json: {args.json}")
    if result.identical != result.total:
        print(f"FAILED: {result.total - result.identical} outputs differ from the undisturbed run")
        return 1
    return 0


def run_demo_command(args: argparse.Namespace) -> int:
    if args.engine == "vllm":
        if args.scenario != "kill":
            print("lumen demo: --engine vllm runs --scenario kill only", file=sys.stderr)
            return 2
        from lumen_core.worker.vllm_demo import run_vllm_demo

        return run_vllm_demo(args)
    if args.scenario == "drain":
        return _run_drain_command(args)
    preset = FULL if args.full else DemoOptions()
    given = {
        "workers": args.workers,
        "duration_s": args.duration,
        "rate_per_s": args.rate,
        "time_scale": args.time_scale,
        "repeats": args.repeats,
    }
    chosen = {k: getattr(preset, k) if v is None else v for k, v in given.items()}
    if chosen["workers"] < 3:
        print(f"lumen demo: --workers must be >= 3, got {chosen['workers']}", file=sys.stderr)
        return 2
    if (
        chosen["repeats"] < 1
        or chosen["duration_s"] <= 0
        or chosen["rate_per_s"] <= 0
        or not chosen["time_scale"] > 0
    ):
        print("lumen demo: --repeats must be >= 1, --duration, --rate and --time-scale > 0", file=sys.stderr)
        return 2
    pace = None if args.pace == "none" else args.pace
    if pace is None and args.compare_sim:
        print("lumen demo: --compare-sim needs a paced run (--pace MODEL/GPUxTP)", file=sys.stderr)
        return 2
    if pace is not None:
        try:
            parse_pace(pace)
        except ValueError as exc:
            print(f"lumen demo: {exc}", file=sys.stderr)
            return 2
    options = dataclasses.replace(
        preset,
        **chosen,
        seed=args.seed,
        policies=POLICIES if args.policy == "all" else (args.policy,),
        trace_path=args.trace,
        pace=pace,
        compare_sim=args.compare_sim,
    )
    started = time.monotonic()

    def say(message: str) -> None:
        print(f"[{time.monotonic() - started:6.1f} s] {message}", file=sys.stderr, flush=True)

    with tempfile.TemporaryDirectory(prefix="lumen-demo-") as scratch:
        workdir = Path(args.workdir) if args.workdir else Path(scratch)
        rows, runs, timelines = run_demo(options, workdir, say)
    if pace is None:
        print("Live loopback cluster, unpaced (timings illustrative: tiny model on a shared CPU; "
              f"medians of {options.repeats} run(s)):")  # fmt: skip
    else:
        print(f"Live loopback cluster paced to {pace} (modelled seconds, time scale {options.time_scale:g}; "
              f"medians of {options.repeats} run(s)): an emulation of that hardware by real processes; "
              "it validates the simulator's event, queueing and streaming logic, "
              "not its cost model.")  # fmt: skip
    print_table(rows)
    if options.compare_sim:
        print("Live vs simulated on the same arrivals (same failure time and worker, cost model, policies):")
        print_comparison(rows)
    if pace is not None and not faithful(rows):
        worst = max(float(r["paced_overrun_fraction"]) for r in rows)  # type: ignore[arg-type]
        print(f"NOT FAITHFUL: {worst:.1%} of paced steps overran their modelled time (more than "
              f"{FAITHFUL_OVERRUN_FRACTION:.0%}); raise --time-scale or lower the load")  # fmt: skip
    failed = [
        r["policy"]
        for r in rows
        if r["lost"] != 0 or r["identical"] != r["total"] or any(r[key] != 0 for key in STREAM_ERRORS)
    ]
    if failed:
        print(f"FAILED: requests lost, streams broken or outputs differ under {', '.join(map(str, failed))}")
    if args.json:
        finite = [
            {k: None if isinstance(v, float) and not math.isfinite(v) else v for k, v in row.items()}
            for row in runs
        ]
        Path(args.json).write_text(json.dumps(finite, indent=1, allow_nan=False) + "\n")
        print(f"json: {args.json}")
    if args.plot:
        title = f"Live cluster paced to {pace}" if pace else "Live loopback cluster, unpaced (illustrative)"
        plot_timeline(timelines, Path(args.plot), title=f"{title}, one worker killed")
        print(f"plot: {args.plot}")
    print(f"wall time {time.monotonic() - started:.1f} s")
    return 1 if failed else 0
