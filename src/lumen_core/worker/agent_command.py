"""``lumen agent``: the per-node agent beside one vLLM server (``agent.Agent``), until
SIGTERM/SIGINT, fencing, or the server's exit.

Prints one JSON line ``{"event": "registered", ...}`` once the server is healthy and the
agent holds a lease (its epoch, holder address, the server's URL and process id), and
``{"event": "stopped", ...}`` with its counters when it ends. Exit status: 0 stopped, 3 fenced
(the lease lost and no registration succeeded within ``--holder-linger-s``), 4 the server
exited (reported to the gateway at once), 2 bad arguments, a server that did not come up, or a
refused registration.
"""

from __future__ import annotations

import argparse
import json
import shlex
import signal
import sys


def add_agent_parser(commands: argparse._SubParsersAction) -> argparse.ArgumentParser:
    parser = commands.add_parser(
        "agent",
        help="run the agent beside one vLLM server (LumenConnector): worker, holder, supervisor",
        description="Start (or attach to) a vLLM server with LumenConnector, register it with the gateway "
        "as a worker, serve this node's checkpoint holder, and relay the gateway's requests to it.",
    )
    parser.add_argument("--worker-id", type=int, required=True)
    parser.add_argument("--gateway", required=True, metavar="HOST:PORT")
    parser.add_argument("--secret-file", required=True, metavar="PATH", help="cluster secret (0600 file)")
    parser.add_argument("--model", required=True, metavar="DIR", help="the model directory the server serves")
    parser.add_argument("--workdir", required=True, metavar="DIR", help="control socket and the server's log")
    parser.add_argument("--dtype", default="float32", choices=("float32", "float16", "bfloat16"))
    parser.add_argument(
        "--attach", default=None, metavar="URL", help="a server already running there (default: start one)"
    )
    parser.add_argument("--port", type=int, default=0, help="the started server's port (0: a free one)")
    parser.add_argument(
        "--server-args", default="", metavar="ARGS", help="more arguments of the started server (one string)"
    )
    parser.add_argument(
        "--cpu-bind",
        default=None,
        metavar="CORES",
        help="VLLM_CPU_OMP_THREADS_BIND of the started server (default: core worker-id mod the CPUs)",
    )
    parser.add_argument(
        "--kv-space-gib", type=float, default=1.0, help="VLLM_CPU_KVCACHE_SPACE of the started server"
    )
    parser.add_argument(
        "--control-socket", default=None, metavar="PATH", help="the connector's control socket (attach mode)"
    )
    parser.add_argument(
        "--budget-bytes", type=int, default=1 << 30, help="holder budget for others' checkpoints"
    )
    parser.add_argument(
        "--reserve-bytes", type=int, default=0, help="holder memory mapped at start (<= the budget)"
    )
    parser.add_argument(
        "--holder-host", default="127.0.0.1", help="holder listen address (default: loopback)"
    )
    parser.add_argument(
        "--tls", default="", help="UCX_TLS of the holder and the connector ('' leaves UCX's choice)"
    )
    parser.add_argument("--start-timeout-s", type=float, default=600.0, help="bound on the server's start")
    parser.add_argument(
        "--encrypt-payloads",
        action="store_true",
        help="the server's connector encrypts its checkpoint records to and from holders (AES-256-GCM)",
    )
    parser.add_argument(
        "--identity-key-file",
        help="the server's worker identity key (0600; its connector's identity_key_file names the same "
        "file). Default for a started server: WORKDIR/identity-<id>.key, created if missing; an "
        "attached server without one registers with no identity",
    )
    parser.add_argument(
        "--holder-linger-s",
        type=float,
        default=60.0,
        help="fenced (the lease lost): keep the holder and the server up this long, registering again "
        "with the checkpoints it holds so the healed gateway restores from them; 0 exits at once "
        "(default 60)",
    )
    parser.set_defaults(func=run_agent)
    return parser


def run_agent(args: argparse.Namespace) -> int:
    from lumen_core.gateway.errors import GatewayError
    from lumen_core.worker.agent import Agent, AgentConfig

    try:
        config = AgentConfig(
            worker_id=args.worker_id,
            gateway=args.gateway,
            secret_file=args.secret_file,
            model=args.model,
            workdir=args.workdir,
            dtype=args.dtype,
            server_url=args.attach,
            port=args.port,
            server_args=tuple(shlex.split(args.server_args)),
            cpu_bind=args.cpu_bind,
            kv_space_gib=args.kv_space_gib,
            control_socket=args.control_socket,
            budget_bytes=args.budget_bytes,
            reserve_bytes=args.reserve_bytes,
            holder_host=args.holder_host,
            tls=args.tls,
            start_timeout_s=args.start_timeout_s,
            holder_linger_s=args.holder_linger_s,
            encrypt_payloads=args.encrypt_payloads,
            identity_key_file=args.identity_key_file,
        )
        agent = Agent(config)
    except (OSError, ValueError) as exc:
        print(f"lumen agent: {exc}", file=sys.stderr)
        return 2
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, lambda *_: agent.stop())
    try:
        try:
            agent.start()
        except (RuntimeError, GatewayError) as exc:
            print(f"lumen agent: {exc}", file=sys.stderr)
            return 2
        registered = {
            "event": "registered",
            "worker_id": config.worker_id,
            "epoch": agent.client.epoch,
            "holder": agent.holder_address,
            "server_url": agent.server_url,
            "server_pid": agent.proc.pid if agent.proc is not None else None,
        }
        print(json.dumps(registered), flush=True)
        status = agent.wait()
        assert status is not None
    finally:
        agent.close()
    print(
        json.dumps({"event": "stopped", "status": status, "reason": agent.reason, **agent.stats()}),
        flush=True,
    )
    return status
