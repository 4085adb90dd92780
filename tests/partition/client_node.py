"""The client of a partition test, run in its own network namespace (by path, never imported).

    python client_node.py --gateway A:P --secret-file F --arrivals IN.json --out OUT.json
                          --timeout-s T

IN.json: ``[{"time_s": t, "prompt": [ids], "max_new_tokens": n}, ...]``. Each request is
submitted at its ``time_s`` (from start) on its own thread; a stream that breaks after the
request id is known is picked up again with ``Watch`` from the tokens received, until ``T``
seconds have passed or the gateway says the request is lost. A submit whose call never reached
the gateway (no connection: a cut at that moment) is sent again; one that may have reached it
is not (it could run twice). Prints ``{"event": "started"}`` as
the first arrival's clock starts, and ``{"event": "done", ...}`` at the end. OUT.json: one
record per arrival, in order: ``request_id``, ``chunks`` (``[start_position, num_tokens]`` as
received, so the checker sees a repeat or a gap), ``token_ids``, ``finished``, ``error`` (the
last one, "" if none), ``reconnects``.
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time

from lumen_core.auth import read_secret_file
from lumen_core.gateway.client import GatewayClient

RETRY_PAUSE_S = 0.25
LOST = " lost: "  # the gateway's word for a request it gave up (UNAVAILABLE "request N lost: ..."): no retry
NOT_SENT = "failed to connect to all addresses"  # gRPC's UNAVAILABLE for a call it could not send


def _run(client: GatewayClient, arrival: dict, record: dict, deadline: float) -> None:
    stream = client.submit(
        arrival["prompt"], arrival["max_new_tokens"], timeout_s=deadline - time.monotonic()
    )
    while True:
        try:
            for chunk in stream:
                record["request_id"] = chunk.request_id
                if chunk.token_ids:
                    record["chunks"].append([chunk.start_position, len(chunk.token_ids)])
                    record["token_ids"].extend(chunk.token_ids)
                if chunk.finished:
                    record["finished"] = True
            record["error"] = "" if record["finished"] else "the stream ended before the last token"
        except Exception as exc:  # noqa: BLE001 - recorded; the checker counts the request lost
            record["error"] = f"{type(exc).__name__}: {exc}"
        unknown = record["request_id"] < 0
        if (
            record["finished"]
            or (unknown and NOT_SENT not in record["error"])
            or LOST in record["error"]
            or time.monotonic() + RETRY_PAUSE_S >= deadline
        ):
            return
        time.sleep(RETRY_PAUSE_S)
        record["reconnects"] += 1
        if unknown:  # the submit never reached the gateway: send it again
            stream = client.submit(
                arrival["prompt"], arrival["max_new_tokens"], timeout_s=deadline - time.monotonic()
            )
            continue
        stream = client.watch(
            record["request_id"], len(record["token_ids"]), timeout_s=deadline - time.monotonic()
        )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gateway", required=True)
    parser.add_argument("--secret-file", required=True)
    parser.add_argument("--arrivals", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--timeout-s", type=float, required=True)
    args = parser.parse_args()
    with open(args.arrivals) as f:
        arrivals = json.load(f)
    records = [
        {"request_id": -1, "chunks": [], "token_ids": [], "finished": False, "error": "", "reconnects": 0}
        for _ in arrivals
    ]
    print(json.dumps({"event": "started"}), flush=True)  # arrival times count from here
    start = time.monotonic()
    deadline = start + args.timeout_s
    threads = []
    with GatewayClient(args.gateway, read_secret_file(args.secret_file), timeout_s=10.0) as client:
        for arrival, record in zip(arrivals, records, strict=True):
            time.sleep(max(0.0, start + arrival["time_s"] - time.monotonic()))
            thread = threading.Thread(target=_run, args=(client, arrival, record, deadline), daemon=True)
            thread.start()
            threads.append(thread)
        for thread in threads:
            thread.join(max(0.1, deadline + 5.0 - time.monotonic()))
    with open(args.out, "w") as f:
        json.dump(records, f)
    print(json.dumps({"event": "done", "finished": sum(r["finished"] for r in records)}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
