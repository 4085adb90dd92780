"""``lumen gateway``: run the gateway until SIGINT/SIGTERM, or write a new cluster secret."""

from __future__ import annotations

import argparse
import signal
import sys
import threading
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the front door's modules (and the http extra) only load when it is served
    from lumen_core.auth import CapabilityIssuer
    from lumen_core.gateway.http.config import FrontDoorConfig
    from lumen_core.gateway.http.text import Tokenizer
    from lumen_core.gateway.http.tls import TLSFiles

LOOPBACK = ("127.0.0.1", "::1", "localhost")


def add_gateway_parser(
    commands: argparse._SubParsersAction[argparse.ArgumentParser],
) -> argparse.ArgumentParser:
    from lumen_core.auth import DEFAULT_CAPABILITY_TTL_S
    from lumen_core.policy.presets import POLICY_NAMES

    parser = commands.add_parser(
        "gateway",
        help="run the control-plane gateway (gRPC + Prometheus metrics on loopback)",
        description="Serve the gateway until SIGINT/SIGTERM. There is no default cluster secret: "
        "pass --secret-file (create one with --write-secret PATH).",
    )
    parser.add_argument("--secret-file", default=None, metavar="PATH", help="cluster secret (0600 file)")
    parser.add_argument(
        "--write-secret",
        default=None,
        metavar="PATH",
        help="write a new random secret to PATH (0600) and exit",
    )
    parser.add_argument(
        "--issuer-key-file",
        default=None,
        metavar="PATH",
        help="the capability issuer's private key (0600), created if missing and reused on every "
        "start, so capabilities issued before a restart still verify on holders (default: a fresh "
        "key per run)",
    )
    parser.add_argument("--host", default="127.0.0.1", help="listen address (default: loopback)")
    parser.add_argument("--port", type=int, default=50051, help="gRPC port (0: a free one, printed)")
    parser.add_argument(
        "--metrics-port", type=int, default=9464, help="Prometheus port (0: a free one; -1: no endpoint)"
    )
    parser.add_argument("--policy", default="LUMEN", choices=POLICY_NAMES)
    parser.add_argument(
        "--lease-s", type=float, default=10.0, help="lease; a silent worker is failed after it"
    )
    parser.add_argument("--heartbeat-s", type=float, default=1.0, help="heartbeat period told to workers")
    parser.add_argument(
        "--capability-ttl-s",
        type=float,
        default=DEFAULT_CAPABILITY_TTL_S,
        help="lifetime of a checkpoint capability; a running request's are renewed at half of it "
        "(default: one hour)",
    )
    parser.add_argument(
        "--park-leases",
        type=float,
        default=6.0,
        help="with no worker serving, keep interrupted requests this many leases for one to register",
    )
    parser.add_argument("--max-parked", type=int, default=1024, help="most requests parked at once")
    parser.add_argument(
        "--kv-bytes-per-token",
        type=int,
        default=None,
        help="KV bytes per token of the served model (L(w) units)",
    )
    parser.add_argument(
        "--first-request-id",
        type=int,
        default=1,
        help="first request id (after a restart: above any id the workers may still hold)",
    )
    parser.add_argument("--event-log", default=None, metavar="PATH", help="JSON lines of every policy call")
    http = parser.add_argument_group(
        "OpenAI front door", "HTTP API for clients (docs/front_door.md; needs the lumen_core[http] extra)"
    )
    http.add_argument("--http-port", type=int, default=None, help="serve /v1/* on this port (0: a free one)")
    http.add_argument(
        "--api-key-file", default=None, metavar="PATH", help="client API keys, one a line (0600)"
    )
    http.add_argument(
        "--tokenizer", default=None, metavar="DIR", help="a saved transformers tokenizer (text)"
    )
    http.add_argument(
        "--tls-cert-file", default=None, metavar="PATH", help="serve HTTPS with this PEM certificate chain"
    )
    http.add_argument(
        "--tls-key-file", default=None, metavar="PATH", help="the certificate's PEM private key (0600)"
    )
    http.add_argument("--model-name", default="lumen", help="the model id clients name (default: lumen)")
    http.add_argument(
        "--vocab-size", type=int, default=None, help="token ids must be below it (default: the tokenizer's)"
    )
    http.add_argument("--max-model-len", type=int, default=4096, help="bound on prompt + max_tokens")
    http.add_argument(
        "--max-concurrent-requests", type=int, default=64, help="HTTP requests in flight; more get 429"
    )
    http.add_argument(
        "--engine",
        default="reference",
        choices=("reference", "vllm"),
        help="what the workers run: vllm marks moved seeded streams resumed_inexact (docs/front_door.md)",
    )
    parser.set_defaults(func=run_gateway)
    return parser


def run_gateway(args: argparse.Namespace) -> int:
    from lumen_core.auth import read_secret_file, write_secret_file
    from lumen_core.eventlog import EventLog
    from lumen_core.gateway.config import GatewayConfig
    from lumen_core.gateway.server import GatewayServer
    from lumen_core.policy.load import LoadConfig

    if args.write_secret is not None:
        write_secret_file(args.write_secret)
        print(f"wrote a new cluster secret to {args.write_secret} (mode 0600)")
        return 0
    if args.secret_file is None:
        print(
            "lumen gateway: --secret-file is required: there is no default cluster secret "
            "(create one with --write-secret PATH)",
            file=sys.stderr,
        )
        return 2
    try:
        secret = read_secret_file(args.secret_file)
    except (OSError, ValueError) as exc:
        print(f"lumen gateway: cannot use {args.secret_file} as the cluster secret: {exc}", file=sys.stderr)
        return 2
    try:
        load_config = (
            LoadConfig()
            if args.kv_bytes_per_token is None
            else LoadConfig(kv_bytes_per_token=args.kv_bytes_per_token)
        )
        config = GatewayConfig(
            policy=args.policy,
            lease_s=args.lease_s,
            heartbeat_s=args.heartbeat_s,
            capability_ttl_s=args.capability_ttl_s,
            park_leases=args.park_leases,
            max_parked=args.max_parked,
            load_config=load_config,
        )
    except ValueError as exc:
        print(f"lumen gateway: {exc}", file=sys.stderr)
        return 2
    issuer = None
    if args.issuer_key_file is not None:
        try:
            issuer = _persistent_issuer(Path(args.issuer_key_file), config.capability_ttl_s)
        except (OSError, ValueError, RuntimeError) as exc:
            print(
                f"lumen gateway: cannot use {args.issuer_key_file} as the issuer key: {exc}", file=sys.stderr
            )
            return 2
    front_door_config = tls = None
    if args.http_port is not None:
        try:
            front_door_config, api_keys, tokenizer, tls = _front_door(args)
        except (OSError, ValueError, ImportError) as exc:
            print(f"lumen gateway: cannot serve the front door: {exc}", file=sys.stderr)
            return 2
    if args.host not in LOOPBACK:
        print(
            f"warning: listening on {args.host}: calls are authenticated but not encrypted",
            file=sys.stderr,
        )
        if front_door_config is not None and tls is None:
            print(
                "warning: the front door serves plain HTTP: client keys and prompts cross the network "
                "in the clear (--tls-cert-file, --tls-key-file)",
                file=sys.stderr,
            )
    event_log = EventLog.open(Path(args.event_log)) if args.event_log else None
    metrics_port = None if args.metrics_port < 0 else args.metrics_port
    server = GatewayServer(
        config,
        secret,
        host=args.host,
        port=args.port,
        metrics_port=metrics_port,
        event_log=event_log,
        first_request_id=args.first_request_id,
        issuer=issuer,
    )
    stop = threading.Event()
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, lambda *_: stop.set())
    server.start()
    door = None
    try:
        if front_door_config is not None:
            from lumen_core.gateway.http.front_door import FrontDoor

            door = FrontDoor(
                server,
                front_door_config,
                api_keys,
                tokenizer=tokenizer,
                host=args.host,
                port=args.http_port,
                tls=tls,
            )
            try:
                door.start()
            except (OSError, RuntimeError) as exc:  # the port is taken, or uvicorn did not come up
                print(f"lumen gateway: cannot serve the front door: {exc}", file=sys.stderr)
                return 2
        metrics = (
            f"; metrics on http://{args.host}:{server.metrics_port}/metrics"
            if metrics_port is not None
            else ""
        )
        print(
            f"gateway listening on {server.address} (policy {config.policy}, lease {config.lease_s} s, "
            f"heartbeat {config.heartbeat_s} s){metrics}",
            flush=True,
        )
        if door is not None:
            print(f"OpenAI front door on {door.url} (model {door.config.model_name})", flush=True)
        if issuer is not None:
            print(f"capability issuer public key {issuer.public_key.hex()}", flush=True)
        while not stop.wait(0.5):
            pass
    finally:
        if door is not None:
            door.stop()
        server.stop()
        if event_log is not None:
            event_log.close()
    print("gateway stopped", flush=True)
    return 0


def _persistent_issuer(path: Path, ttl_s: float) -> CapabilityIssuer:
    """The issuer (capabilities valid ``ttl_s``) whose private key is in ``path``, created
    (0600) with a fresh key if there is none. Raises PermissionError for a file others can
    access, ValueError for one that is not a key, RuntimeError without the UCX module (the
    signing code's home)."""
    from lumen_core.auth import CapabilityIssuer, read_issuer_key_file, write_issuer_key_file

    try:
        write_issuer_key_file(path)
    except FileExistsError:  # a restart: the key capabilities in flight were signed with
        pass
    return CapabilityIssuer(read_issuer_key_file(path), ttl_s=ttl_s)


def _front_door(
    args: argparse.Namespace,
) -> tuple[FrontDoorConfig, frozenset[str], Tokenizer | None, TLSFiles | None]:
    """The front door's config, API keys, tokenizer and TLS files from the flags. Raises
    ValueError for a flag that is missing or wrong, OSError for an unreadable key file,
    ImportError without the ``http`` extra."""
    from lumen_core.gateway.http.config import FrontDoorConfig
    from lumen_core.gateway.http.keys import read_api_key_file
    from lumen_core.gateway.http.text import Tokenizer
    from lumen_core.gateway.http.tls import TLSFiles

    if args.api_key_file is None:
        raise ValueError("--http-port needs --api-key-file: there are no default client keys")
    if (args.tls_cert_file is None) != (args.tls_key_file is None):
        raise ValueError("--tls-cert-file and --tls-key-file go together: give both or neither")
    tls = None if args.tls_cert_file is None else TLSFiles(args.tls_cert_file, args.tls_key_file)
    api_keys = read_api_key_file(args.api_key_file)
    tokenizer = None if args.tokenizer is None else Tokenizer(args.tokenizer)
    vocab_size = args.vocab_size
    if vocab_size is None:
        if tokenizer is None:
            raise ValueError(
                "--http-port needs --vocab-size or --tokenizer (token ids are checked against it)"
            )
        vocab_size = tokenizer.vocab_size
    config = FrontDoorConfig(
        args.model_name,
        vocab_size,
        max_model_len=args.max_model_len,
        max_concurrent_requests=args.max_concurrent_requests,
        engine=args.engine,
    )
    return config, api_keys, tokenizer, tls
