"""A rogue worker for tests/worker/test_cluster_slow.py. It has the cluster secret, registers,
takes the requests the gateway runs on it and serves none of them; once the gateway has
declared it failed it keeps acting with its old epochs, ignoring its fencing: it heartbeats,
reports tokens no model produced, and opens, appends to and releases a request's checkpoint
on a holder with the capability it was granted.

    python rogue.py --gateway HOST:PORT --secret-file F --worker-id W
JSON lines on stdout ({"epoch": E} once registered); commands on stdin:
    take                 -> {"requests": [{"request_id", "epoch", "holders"}]} (its RUN directives)
    attack RID HOST:PORT -> what the gateway and that holder answered each act with old epochs
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable

import grpc
import numpy as np
import torch

from lumen_core.auth import read_secret_file
from lumen_core.gateway import lumen_pb2 as pb
from lumen_core.gateway import lumen_pb2_grpc as pb_grpc
from lumen_core.gateway.client import GatewayClient
from lumen_core.gateway.directives import Run
from lumen_core.gateway.protocol import parse_address
from lumen_core.ops import checksum
from lumen_core.transport import Client, TransportError

RECORD_BYTES = 2048  # the tiny float64 model's KV record
FAKE_TOKENS = [255, 254, 253, 252]


def _outcome(call: Callable[[], object]) -> str:
    """ "accepted" or the name of the transport error the holder refused the act with."""
    try:
        call()
    except TransportError as exc:
        return type(exc).__name__
    return "accepted"


def _attack_holder(holder: Client, request_id: int, epoch: int, capability: bytes) -> dict[str, str]:
    """Open, append made-up (well-formed) records to, and release the request's checkpoint
    with the old epoch and its capability."""
    n = len(FAKE_TOKENS)
    records = np.full((n, RECORD_BYTES), 7, dtype=np.uint8)
    tokens = np.array(FAKE_TOKENS, dtype=np.uint32)
    crcs = checksum(torch.from_numpy(records)).numpy().astype(np.uint32)
    fingerprints = bytes(32)
    return {
        "open": _outcome(
            lambda: holder.open(request_id, 0, epoch, RECORD_BYTES, fingerprints, fingerprints, capability)
        ),
        "append": _outcome(lambda: holder.append(request_id, 0, epoch, 0, tokens, crcs, records, capability)),
        "release": _outcome(lambda: holder.release(request_id, 0, epoch, capability)),
    }


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--gateway", required=True)
    parser.add_argument("--secret-file", required=True)
    parser.add_argument("--worker-id", type=int, required=True)
    args = parser.parse_args()
    secret = read_secret_file(args.secret_file)
    client = GatewayClient(args.gateway, secret)
    # No budget: the gateway never places another worker's checkpoint here.
    client.register(args.worker_id, budget_bytes=0, holder_address="127.0.0.1:9")
    worker_epoch = client.epoch
    print(json.dumps({"epoch": worker_epoch}), flush=True)
    stub = pb_grpc.GatewayStub(grpc.insecure_channel(args.gateway))
    grants: dict[int, tuple[int, bytes]] = {}
    for line in sys.stdin:
        command = line.split()
        if command == ["take"]:
            runs = [d for d in client.heartbeat().directives if isinstance(d, Run)]
            for run in runs:
                grants[run.request_id] = (run.epoch, run.holders[0].capabilities[0] if run.holders else b"")
            taken = [
                {"request_id": r.request_id, "epoch": r.epoch, "holders": [h.worker_id for h in r.holders]}
                for r in runs
            ]
            print(json.dumps({"requests": taken}), flush=True)
        elif command[:1] == ["attack"]:
            request_id = int(command[1])
            epoch, capability = grants[request_id]
            heartbeat = client.heartbeat()  # sent even though the gateway has declared it failed
            report = pb.TokenReport(
                worker_id=args.worker_id,
                worker_epoch=worker_epoch,
                requests=[
                    pb.RequestTokens(request_id=r, epoch=grants[r][0], token_ids=FAKE_TOKENS) for r in grants
                ],
            )
            # Signed with its own call key: the client itself sends nothing once fenced.
            metadata = client.signed_metadata("ReportTokens", report.SerializeToString())
            try:
                stub.ReportTokens(report, metadata=metadata, timeout=5.0)
                reported = "accepted"
            except grpc.RpcError as exc:
                reported = exc.code().name
            host, port = parse_address(command[2])
            holder = Client(host, port, secret, connect_timeout_s=5.0)
            result = {
                "heartbeat_fenced": heartbeat.fenced,
                "report": reported,
                **_attack_holder(holder, request_id, epoch, capability),
            }
            holder.close()
            print(json.dumps(result), flush=True)
    client.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
