"""Peer processes for the transport tests and benchmark (run by path, never imported by name).

    python peer.py serve  --secret-file F --issuer-key-file PUB [--tls T] [--max-payload-bytes B]
                          [--no-verify]
        prints {"port": P}, then answers stdin lines: "stats" -> one JSON line; "stop" or EOF
        -> exits.
    python peer.py stream --port P --secret-file F --capability HEX --request-id R
                          --num-appends K --tokens-per-append N --record-bytes RB [--window W]
                          [--tls T] [--interval-s S]
        opens R (shard 0, epoch 1, with the capability the test issued) and appends
        make_append() data in order with W appends in flight (pausing S seconds between
        appends), printing {"durable": D} after each ack and {"done": true} at the end.

make_append() is the deterministic content both sides agree on.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import deque
from pathlib import Path

import numpy as np

SHARD = 0
EPOCH = 1
LAYOUT_FP = bytes(range(32))
MODEL_FP = bytes(range(32, 64))


def make_append(
    request_id: int, start_pos: int, num_tokens: int, record_bytes: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(token_ids uint32[n], crcs uint32[n], records uint8[n, record_bytes]) for positions
    [start_pos, start_pos + n) of request_id; the same on every call."""
    import torch

    from lumen_core import ops

    rng = np.random.default_rng([request_id, start_pos, num_tokens, record_bytes])
    records = rng.integers(0, 256, (num_tokens, record_bytes), dtype=np.uint8)
    positions = np.arange(start_pos, start_pos + num_tokens, dtype=np.uint64)
    token_ids = ((positions * 7919 + request_id) % 50257).astype(np.uint32)
    crcs = ops.checksum(torch.from_numpy(records)).numpy().astype(np.uint32)
    return token_ids, crcs, records


def _emit(obj: dict) -> None:
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


def serve(args: argparse.Namespace) -> None:
    from lumen_core.auth import read_issuer_public_key_file, read_secret_file
    from lumen_core.stream import HolderStore
    from lumen_core.transport import Server, WireLimits

    limits = WireLimits(max_payload_bytes=args.max_payload_bytes)
    with Server(
        read_secret_file(args.secret_file),
        issuer_public_key=read_issuer_public_key_file(args.issuer_key_file),
        store=HolderStore(),
        tls=args.tls,
        limits=limits,
        verify_records=not args.no_verify,
    ) as server:
        _emit({"port": server.port})
        for line in sys.stdin:
            command = line.strip()
            if command == "stats":
                _emit(server.stats())
            elif command == "stop":
                break


def stream(args: argparse.Namespace) -> None:
    from lumen_core.auth import read_secret_file
    from lumen_core.transport import Client

    secret = read_secret_file(args.secret_file)
    capability = bytes.fromhex(args.capability)
    appends = [
        make_append(args.request_id, i * args.tokens_per_append, args.tokens_per_append, args.record_bytes)
        for i in range(args.num_appends)
    ]
    with Client("127.0.0.1", args.port, secret, tls=args.tls) as client:
        client.open(args.request_id, SHARD, EPOCH, args.record_bytes, LAYOUT_FP, MODEL_FP, capability)
        in_flight: deque[int] = deque()
        for i, (token_ids, crcs, records) in enumerate(appends):
            if args.interval_s > 0:
                time.sleep(args.interval_s)
            in_flight.append(
                client.start_append(
                    args.request_id,
                    SHARD,
                    EPOCH,
                    i * args.tokens_per_append,
                    token_ids,
                    crcs,
                    records,
                    capability,
                )
            )
            if len(in_flight) >= args.window:
                _emit({"durable": client.wait(in_flight.popleft(), timeout_s=30.0)})
        while in_flight:
            _emit({"durable": client.wait(in_flight.popleft(), timeout_s=30.0)})
    _emit({"done": True})


def main() -> None:
    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers(dest="command", required=True)
    p_serve = sub.add_parser("serve")
    p_serve.add_argument("--secret-file", type=Path, required=True)
    p_serve.add_argument("--issuer-key-file", type=Path, required=True)
    p_serve.add_argument("--tls", default="tcp")
    p_serve.add_argument("--max-payload-bytes", type=int, default=1 << 30)
    p_serve.add_argument("--no-verify", action="store_true")
    p_stream = sub.add_parser("stream")
    p_stream.add_argument("--port", type=int, required=True)
    p_stream.add_argument("--secret-file", type=Path, required=True)
    p_stream.add_argument("--capability", required=True)
    p_stream.add_argument("--request-id", type=int, required=True)
    p_stream.add_argument("--num-appends", type=int, required=True)
    p_stream.add_argument("--tokens-per-append", type=int, required=True)
    p_stream.add_argument("--record-bytes", type=int, required=True)
    p_stream.add_argument("--window", type=int, default=4)
    p_stream.add_argument("--tls", default="tcp")
    p_stream.add_argument("--interval-s", type=float, default=0.0)
    args = parser.parse_args()
    if args.command == "serve":
        serve(args)
    else:
        stream(args)


if __name__ == "__main__":
    main()
