"""``lumen worker``: one worker process of a live cluster, until SIGTERM/SIGINT or fencing.

Prints one JSON line ``{"event": "registered", ...}`` once it holds a lease (with its epoch
and holder address), and ``{"event": "stopped", ...}`` with its counters when it ends.
Exit status: 0 stopped, 3 fenced (the lease was lost and no registration succeeded within
``--holder-linger-s``), 2 bad arguments or registration
refused (no cluster secret, say).
"""

from __future__ import annotations

import argparse
import json
import signal
import sys


def add_worker_parser(commands: argparse._SubParsersAction) -> argparse.ArgumentParser:
    from lumen_core.worker import MODELLED_DRAFT_LOAD_S, MODELLED_FULL_LOAD_S

    parser = commands.add_parser(
        "worker",
        help="run a worker: reference engine, checkpoint streaming, embedded holder",
        description="Serve requests the gateway sends until SIGTERM/SIGINT or until the lease is lost.",
    )
    parser.add_argument("--worker-id", type=int, required=True)
    parser.add_argument("--gateway", required=True, metavar="HOST:PORT")
    parser.add_argument("--secret-file", required=True, metavar="PATH", help="cluster secret (0600 file)")
    parser.add_argument(
        "--model",
        required=True,
        metavar="PATH",
        help="weights written by engine.save_model, or a transformers Llama directory",
    )
    parser.add_argument(
        "--draft", default=None, metavar="PATH", help="draft weights (loaded first on restart)"
    )
    parser.add_argument("--recovering", action="store_true", help="a restart after a failure")
    parser.add_argument(
        "--budget-bytes", type=int, default=1 << 30, help="holder budget for others' checkpoints"
    )
    parser.add_argument(
        "--reserve-bytes", type=int, default=0, help="holder memory mapped at start (<= the budget)"
    )
    parser.add_argument(
        "--holder-host", default="127.0.0.1", help="holder listen address (default: loopback)"
    )
    parser.add_argument("--num-blocks", type=int, default=1024, help="KV cache pages")
    parser.add_argument(
        "--pace",
        default=None,
        metavar="MODEL/GPUxTP",
        help="pace each engine step (and restore) to the cost model of this setup, e.g. qwen3-32b/h100x2",
    )
    parser.add_argument(
        "--time-scale",
        type=float,
        default=1.0,
        help="stretch every paced and modelled duration by this factor (default 1)",
    )
    parser.add_argument(
        "--modelled-full-load-s",
        type=float,
        default=None,
        help=f"on restart, the full model is ready this many real seconds after the loads begin (at the "
        f"worker's start; paced, at its process's start), both models loading at once (default: the --pace "
        f"setup's, times --time-scale; without --pace {MODELLED_FULL_LOAD_S:.1f}: 32B bf16 from NVMe)",
    )
    parser.add_argument(
        "--modelled-draft-load-s",
        type=float,
        default=None,
        help=f"on restart, the draft is ready this many real seconds after the loads begin (default: "
        f"the --pace setup's, times --time-scale; without --pace {MODELLED_DRAFT_LOAD_S:.2f}: 0.6B bf16 "
        "from NVMe)",
    )
    parser.add_argument(
        "--ack-timeout-s",
        type=float,
        default=2.0,
        help="checkpoint streaming: a holder that acknowledges nothing this long has failed (default 2)",
    )
    parser.add_argument(
        "--encrypt-payloads",
        action="store_true",
        help="checkpoint records to and from holders in AES-256-GCM (docs/security.md); off by "
        "default: a private cluster network costs nothing",
    )
    parser.add_argument(
        "--give-up-after-s",
        type=float,
        default=30.0,
        help="checkpoint streaming: a holder failing this long has lost its replicas, which the "
        "gateway places again (default 30)",
    )
    parser.add_argument(
        "--holder-linger-s",
        type=float,
        default=60.0,
        help="fenced (the lease lost): keep the holder up this long, registering again with the "
        "checkpoints it holds so the healed gateway restores from them; 0 exits at once (default 60)",
    )
    parser.set_defaults(func=run_worker)
    return parser


def run_worker(args: argparse.Namespace) -> int:
    from lumen_core.auth import read_secret_file
    from lumen_core.gateway.errors import GatewayError
    from lumen_core.pacing import parse_pace
    from lumen_core.policy.events import WorkerState
    from lumen_core.worker import MODELLED_DRAFT_LOAD_S, MODELLED_FULL_LOAD_S
    from lumen_core.worker.process import Worker, WorkerConfig

    try:
        full_load_s, draft_load_s = args.modelled_full_load_s, args.modelled_draft_load_s
        if args.pace is not None:
            cost = parse_pace(args.pace)
            full_load_s = cost.model_load_time_s * args.time_scale if full_load_s is None else full_load_s
            draft_load_s = cost.draft_load_time_s * args.time_scale if draft_load_s is None else draft_load_s
        secret = read_secret_file(args.secret_file)
        config = WorkerConfig(
            worker_id=args.worker_id,
            gateway=args.gateway,
            model_path=args.model,
            draft_path=args.draft,
            state=WorkerState.RECOVERING if args.recovering else WorkerState.SERVING,
            budget_bytes=args.budget_bytes,
            reserve_bytes=args.reserve_bytes,
            holder_host=args.holder_host,
            num_blocks=args.num_blocks,
            modelled_full_load_s=MODELLED_FULL_LOAD_S if full_load_s is None else full_load_s,
            modelled_draft_load_s=MODELLED_DRAFT_LOAD_S if draft_load_s is None else draft_load_s,
            pace=args.pace,
            time_scale=args.time_scale,
            ack_timeout_s=args.ack_timeout_s,
            give_up_after_s=args.give_up_after_s,
            holder_linger_s=args.holder_linger_s,
            encrypt_payloads=args.encrypt_payloads,
        )
    except (OSError, ValueError) as exc:
        print(f"lumen worker: {exc}", file=sys.stderr)
        return 2
    if config.state == WorkerState.RECOVERING:
        print(
            f"worker {config.worker_id}: modelled loads (not measurements), from the loads' start: draft "
            f"{config.modelled_draft_load_s:.2f} s, full model {config.modelled_full_load_s:.2f} s",
            file=sys.stderr,
            flush=True,
        )
    worker = Worker(config, secret)
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, lambda *_: worker.stop())
    try:
        try:
            worker.start()
        except GatewayError as exc:
            print(f"lumen worker: the gateway refused registration: {exc}", file=sys.stderr)
            return 2
        print(
            json.dumps(
                {
                    "event": "registered",
                    "worker_id": config.worker_id,
                    "epoch": worker.client.epoch,
                    "state": config.state,
                    "holder": worker.holder_address,
                }
            ),
            flush=True,
        )
        status = worker.run()
    finally:
        worker.close()
    print(
        json.dumps({"event": "stopped", "status": status, "reason": worker.fence_reason, **worker.stats()}),
        flush=True,
    )
    return status
