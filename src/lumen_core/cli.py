"""The ``lumen`` command. Subcommands: ``sim`` (the cluster simulator's experiments),
``gateway`` (the live control plane, ``gateway.command``), ``holder`` (a checkpoint holder: a
HolderStore behind a transport server), ``keygen`` (a capability issuer's key pair), ``agent``
(beside one vLLM server, ``worker.agent_command``)."""

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
    widths = [
        max(len(h), *(len(line[i]) for line in lines)) if lines else len(h) for i, h in enumerate(header)
    ]
    print(f"== {outcome.experiment} ==")  # type: ignore[attr-defined]
    print("  ".join(h.ljust(w) for h, w in zip(header, widths)))
    for line in lines:
        print("  ".join(cell.ljust(w) for cell, w in zip(line, widths)))
    for note in outcome.notes:  # type: ignore[attr-defined]
        print(f"note: {note}")


def _sim_rate(args: argparse.Namespace) -> float:
    """The per-worker rate of this run, and a line on stdout saying which one it is."""
    from lumen_core.sim.experiments import FAILURE_FREE_TTFT_S, RATE_PER_WORKER, calibrate_rate, proto_config
    from lumen_core.sim.workload import load_trace

    trace = args.trace or "the conversation trace"
    if args.calibrate_ttft is None:
        if args.rate == RATE_PER_WORKER:
            print(
                f"rate: {args.rate:.3f} requests/s per worker (the default, calibrated on the conversation "
                f"trace to a failure-free mean TTFT of {FAILURE_FREE_TTFT_S} s)"
            )
        else:
            print(f"rate: {args.rate:.3f} requests/s per worker (given)")
        return args.rate
    workers = args.workers or 4
    rate = calibrate_rate(proto_config(workers), load_trace(args.trace), target_ttft_s=args.calibrate_ttft)
    print(
        f"rate: {rate:.3f} requests/s per worker, calibrated on {trace} to a failure-free S&R mean TTFT of "
        f"{args.calibrate_ttft} s (proto config, {workers} workers)"
    )
    return rate


def _sim(args: argparse.Namespace) -> int:
    from lumen_core.sim.experiments import Options, run_experiment
    from lumen_core.sim.plots import plot_outcome

    options = Options(
        trace_path=args.trace,
        workers=args.workers,
        policy=args.policy,
        seed=args.seed,
        rate_per_worker=_sim_rate(args),
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
            print(
                f"plot: {args.experiment} has no figure (proto4, proto8, ablation, sensitivity, "
                "long_context do)"
            )
    return 0


def _holder(args: argparse.Namespace) -> int:
    """Serves until SIGTERM/SIGINT. Prints one JSON line {"address", "port"} when listening;
    on stdin, a line "stats" is answered with a JSON line of the store's and server's stats."""
    import select
    import signal

    from lumen_core.auth import read_issuer_public_key_file, read_secret_file
    from lumen_core.stream import EvictionPolicy, HolderStore

    store = HolderStore(
        args.budget_bytes, eviction=EvictionPolicy[args.eviction.upper()], reserve_bytes=args.reserve_bytes
    )
    server = store.serve(
        read_secret_file(args.secret_file),
        holder_id=args.holder_id,
        issuer_public_key=read_issuer_public_key_file(args.issuer_key_file),
        address=args.address,
        port=args.port,
        tls=args.tls,
        verify_records=not args.no_verify_records,
    )
    stopping: list[int] = []
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda signum, frame: stopping.append(signum))
    print(json.dumps({"address": args.address, "port": server.port}), flush=True)
    reading = True
    last_sweep = time.monotonic()
    try:
        while not stopping:
            if reading:
                ready, _, _ = select.select([sys.stdin], [], [], 1.0)
                if ready:
                    line = sys.stdin.readline()
                    if not line:
                        reading = False
                    elif line.strip() == "stats":
                        print(json.dumps({"store": store.stats(), "server": server.stats()}), flush=True)
            else:
                time.sleep(1.0)
            if time.monotonic() - last_sweep >= 1.0:
                store.expire_idle(args.idle_expiry_s)
                last_sweep = time.monotonic()
    finally:
        server.close()
    return 0


def _keygen(args: argparse.Namespace) -> int:
    """Writes a new issuer private key (0600, must not exist) and its public half."""
    from lumen_core.auth import (
        CapabilityIssuer,
        read_issuer_key_file,
        write_issuer_key_file,
        write_issuer_public_key_file,
    )

    write_issuer_key_file(args.issuer_key)
    public_key = CapabilityIssuer(read_issuer_key_file(args.issuer_key)).public_key
    write_issuer_public_key_file(args.public_key, public_key)
    print(json.dumps({"issuer_key": args.issuer_key, "public_key": args.public_key, "hex": public_key.hex()}))
    return 0


def _drain(args: argparse.Namespace) -> int:
    """Drain a worker through the gateway's admin call and wait until it is told to stop (or
    failed); prints the drain's progress as JSON. Exit 1 when it failed or did not end within
    --deadline plus --wait-s."""
    from lumen_core.auth import read_secret_file
    from lumen_core.gateway.client import GatewayClient
    from lumen_core.gateway.errors import GatewayError

    try:
        secret = read_secret_file(args.secret_file)
    except (OSError, ValueError) as exc:
        print(f"lumen drain: {exc}", file=sys.stderr)
        return 2
    with GatewayClient(args.gateway, secret) as client:
        give_up_s = time.monotonic() + args.deadline + args.wait_s
        try:
            reply = client.drain(args.worker_id, deadline_s=args.deadline)
            while reply.state == "flushing" and time.monotonic() < give_up_s:
                time.sleep(0.05)
                reply = client.drain(args.worker_id, deadline_s=args.deadline)
        except GatewayError as exc:
            print(f"lumen drain: {exc}", file=sys.stderr)
            return 2
    fields = ("worker_id", "state", "num_requests", "num_moved", "num_reprefilled", "started_s", "finished_s")
    print(json.dumps({name: getattr(reply, name) for name in fields}))
    return 0 if reply.state == "stopped" else 1


def build_parser() -> argparse.ArgumentParser:
    from lumen_core.gateway.command import add_gateway_parser
    from lumen_core.policy.presets import POLICY_NAMES
    from lumen_core.sim.experiments import EXPERIMENTS, RATE_PER_WORKER
    from lumen_core.worker.agent_command import add_agent_parser
    from lumen_core.worker.command import add_worker_parser
    from lumen_core.worker.demo import add_demo_parser

    parser = argparse.ArgumentParser(prog="lumen", description="Fault-tolerant LLM serving (LUMEN).")
    commands = parser.add_subparsers(dest="command", required=True)
    sim = commands.add_parser("sim", help="run a cluster-simulator experiment")
    sim.add_argument("--experiment", required=True, choices=EXPERIMENTS)
    sim.add_argument("--workers", type=int, default=None, help="cluster size (table1, rack, scale)")
    sim.add_argument(
        "--policy", default="LUMEN", choices=POLICY_NAMES, help="policy of `scale` and of --event-log"
    )
    sim.add_argument("--trace", default=None, help="CSV with TIMESTAMP, ContextTokens, GeneratedTokens")
    sim.add_argument("--seed", type=int, default=0, help="which workers fail; synthetic workloads")
    sim.add_argument(
        "--rate",
        type=float,
        default=RATE_PER_WORKER,
        help=f"requests per second per worker (default {RATE_PER_WORKER}: calibrated once on the "
        "conversation trace to the paper's failure-free mean TTFT; a prefill-heavy --trace can saturate "
        "at it)",
    )
    sim.add_argument(
        "--calibrate-ttft",
        type=float,
        default=None,
        metavar="SECONDS",
        help="instead of --rate: bisect the per-worker rate at which the failure-free S&R run of --trace "
        "(proto config, --workers or 4) has this mean TTFT, and use it",
    )
    sim.add_argument("--json", default=None, metavar="PATH", help="write the rows as JSON")
    sim.add_argument(
        "--plot", default=None, metavar="PATH", help="write PNG figure(s) (PATH, PATH-<name>.png)"
    )
    sim.add_argument(
        "--event-log",
        default=None,
        metavar="PATH",
        help="JSON lines of the policy calls of the --policy run (else the experiment's first policy)",
    )
    sim.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    sim.set_defaults(func=_sim)
    holder = commands.add_parser("holder", help="serve a checkpoint holder (HolderStore) on UCX")
    holder.add_argument("--port", type=int, default=0, help="listen port (0: any free port)")
    holder.add_argument("--address", default="127.0.0.1", help="listen address (loopback default)")
    holder.add_argument("--budget-bytes", type=int, required=True, help="byte budget of the store")
    holder.add_argument(
        "--reserve-bytes",
        type=int,
        default=0,
        help="host memory mapped at start and kept (<= the budget): no page faults while receiving",
    )
    holder.add_argument("--secret-file", required=True, help="cluster secret, a 0600 file")
    holder.add_argument(
        "--issuer-key-file",
        required=True,
        help="public key of the capability issuer (hex, as `lumen keygen` writes it)",
    )
    holder.add_argument("--holder-id", type=int, default=0, help="the id capabilities name this holder by")
    holder.add_argument("--eviction", default="shortest_prefix", choices=("shortest_prefix", "lru", "none"))
    holder.add_argument("--idle-expiry-s", type=float, default=600.0, help="expire idle checkpoints")
    holder.add_argument("--tls", default="", help="UCX_TLS of the server ('' leaves UCX's choice)")
    holder.add_argument("--no-verify-records", action="store_true", help="skip crc checks on receipt")
    holder.set_defaults(func=_holder)
    keygen = commands.add_parser("keygen", help="write a capability issuer's key pair (gateway-less mode)")
    keygen.add_argument(
        "--issuer-key", required=True, metavar="PATH", help="private key, 0600, held by the issuer"
    )
    keygen.add_argument("--public-key", required=True, metavar="PATH", help="public key (hex), for holders")
    keygen.set_defaults(func=_keygen)
    drain = commands.add_parser(
        "drain", help="take a worker out for maintenance: move its requests, then stop it"
    )
    drain.add_argument("worker_id", type=int, metavar="WORKER", help="the worker id to drain")
    drain.add_argument("--gateway", required=True, help="the gateway's host:port")
    drain.add_argument("--secret-file", required=True, help="cluster secret, a 0600 file (admin call)")
    drain.add_argument(
        "--deadline",
        type=float,
        default=30.0,
        metavar="S",
        help="seconds for the worker to flush; requests not moved by then are re-prefilled (default 30)",
    )
    drain.add_argument("--wait-s", type=float, default=10.0, help="wait this long past the deadline")
    drain.set_defaults(func=_drain)
    add_gateway_parser(commands)
    add_worker_parser(commands)
    add_demo_parser(commands)
    add_agent_parser(commands)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command == "sim":
        if args.workers is not None and args.workers < 2:
            parser.error(f"--workers must be >= 2, got {args.workers}")
        if args.rate <= 0:
            parser.error(f"--rate must be > 0, got {args.rate}")
        if args.calibrate_ttft is not None and args.calibrate_ttft <= 0:
            parser.error(f"--calibrate-ttft must be > 0, got {args.calibrate_ttft}")
    if args.command == "drain" and not args.deadline > 0:
        parser.error(f"--deadline must be > 0, got {args.deadline}")
    if args.command == "holder":
        if not 0 <= args.port <= 65535:
            parser.error(f"--port must be in [0, 65535], got {args.port}")
        if args.budget_bytes < 0:
            parser.error(f"--budget-bytes must be >= 0, got {args.budget_bytes}")
        if not 0 <= args.reserve_bytes <= args.budget_bytes:
            parser.error(f"--reserve-bytes must be in [0, --budget-bytes], got {args.reserve_bytes}")
        if args.idle_expiry_s <= 0:
            parser.error(f"--idle-expiry-s must be > 0, got {args.idle_expiry_s}")
        if not 0 <= args.holder_id < 2**64:
            parser.error(f"--holder-id must be in [0, 2**64), got {args.holder_id}")
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
