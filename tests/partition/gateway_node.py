"""The gateway of a partition test, run in its own network namespace (by path, never imported).

    python gateway_node.py --host A --port P --secret-file F --policy LUMEN --lease-s L
                           --heartbeat-s H --kv-bytes-per-token B [--unfenced]

Serves a ``GatewayServer`` on A:P and prints ``{"event": "listening", "address": ...}``; then
answers stdin lines, one JSON line each:
- ``status``: every worker (id, epoch, state), the requests running on each, for each
  running request the holders with durable tokens (what a schedule picks its victims from),
  and the workers fenced at an epoch that has not reported since (``unheard_fenced``);
- ``exit W E``: worker W's process (epoch E) exited: the supervisor's report, as
  ``LocalCluster.kill`` makes it;
- ``stop`` (or EOF): stops the gateway and prints ``{"event": "stopped", ...}``: every failure
  it handled, the calls it refused, and every token report it accepted or refused, with the
  epochs fenced before it (the stale-write invariant's evidence).

``--unfenced`` turns the gateway's epoch fencing off (token reports of a fenced worker epoch or
an outdated request epoch are taken as the current owner's): the partition tests' proof that
their stale-write invariant can fail. Never a mode of the real gateway.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from lumen_core.auth import read_secret_file
from lumen_core.gateway.config import GatewayConfig
from lumen_core.gateway.coordinator import Coordinator
from lumen_core.gateway.errors import StaleEpochError
from lumen_core.gateway.server import GatewayServer
from lumen_core.policy.load import LoadConfig


class _Ledger:
    """Every token report the coordinator saw and every worker epoch it fenced, in order."""

    def unheard(self) -> list[int]:
        """Workers fenced at an epoch that has not reported since (an unfenced zombie whose
        healed connection has not delivered yet)."""
        return sorted({w for w, e in self.fenced - self.heard_fenced})

    def __init__(self, coordinator: Coordinator, *, unfenced: bool) -> None:
        self.fenced: set[tuple[int, int]] = set()
        self.accepted = 0
        self.refused_stale = 0
        self.stale_accepted: list[dict[str, int]] = []
        self.heard_fenced: set[tuple[int, int]] = set()  # fenced epochs that reported again
        report_tokens, fail = coordinator.report_tokens, coordinator.fail

        def on_fail(now_s, worker_ids, *, cause):  # type: ignore[no-untyped-def]
            self.fenced.update((w, coordinator.worker_epoch(w)) for w in worker_ids)
            return fail(now_s, worker_ids, cause=cause)

        def on_report(now_s, worker_id, worker_epoch, request_id, epoch, start_position, token_ids, **kw):  # type: ignore[no-untyped-def]
            stale = (worker_id, worker_epoch) in self.fenced
            if stale:
                self.heard_fenced.add((worker_id, worker_epoch))
            if unfenced and coordinator.has_request(request_id):
                owner, current = coordinator.request_worker(request_id)
                stale = stale or (owner, current) != (worker_id, epoch)
                worker_id, worker_epoch, epoch = owner, coordinator.worker_epoch(owner), current
            try:
                ack = report_tokens(
                    now_s, worker_id, worker_epoch, request_id, epoch, start_position, token_ids, **kw
                )
            except StaleEpochError:
                self.refused_stale += 1
                raise
            self.accepted += 1
            if stale:
                self.stale_accepted.append({"request_id": request_id, "start_position": start_position})
            return ack

        coordinator.fail = on_fail  # type: ignore[method-assign]
        coordinator.report_tokens = on_report  # type: ignore[method-assign]
        if unfenced:  # the servicer checks a report's worker epoch before any request's
            coordinator.check_worker_epoch = lambda worker_id, worker_epoch: None  # type: ignore[method-assign]


def _status(server: GatewayServer, ledger: _Ledger) -> dict[str, object]:
    with server.condition:
        coordinator = server.coordinator
        monitor = coordinator.monitor
        states = coordinator.metrics().worker_state
        workers = [
            {"worker_id": w, "epoch": coordinator.worker_epoch(w), "state": str(states[w])}
            for w in coordinator.worker_ids()
        ]
        running = {str(w): list(monitor.running_on(w)) for w in monitor.live_worker_ids()}
        holders = {}
        for ids in running.values():
            for request_id in ids:
                view = monitor.request(request_id)
                holders[str(request_id)] = [h for h, durable in view.durable_tokens if durable > 0]
        return {
            "workers": workers,
            "running": running,
            "holders": holders,
            "failures": len(coordinator.failures),
            "unheard_fenced": ledger.unheard(),
        }


def _stopped(server: GatewayServer, ledger: _Ledger) -> dict[str, object]:
    with server.condition:
        failures = [
            {
                "time_s": f.time_s,
                "worker_ids": list(f.worker_ids),
                "cause": f.cause,
                "rerouted": [r.route.request_id for r in f.reroutes],
                "actions": [str(r.route.action) for r in f.reroutes],
                "reasons": [r.route.reason for r in f.reroutes],
                "lost": list(f.lost_request_ids),
            }
            for f in server.coordinator.failures
        ]
    return {
        "event": "stopped",
        "failures": failures,
        "refused_calls": server.num_refused_calls,
        "reports_accepted": ledger.accepted,
        "reports_refused_stale": ledger.refused_stale,
        "stale_accepted": ledger.stale_accepted,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--host", required=True)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--secret-file", required=True)
    parser.add_argument("--policy", default="LUMEN")
    parser.add_argument("--lease-s", type=float, required=True)
    parser.add_argument("--heartbeat-s", type=float, required=True)
    parser.add_argument("--kv-bytes-per-token", type=int, required=True)
    parser.add_argument("--unfenced", action="store_true")
    args = parser.parse_args()
    config = GatewayConfig(
        policy=args.policy,
        lease_s=args.lease_s,
        heartbeat_s=args.heartbeat_s,
        load_config=LoadConfig(kv_bytes_per_token=args.kv_bytes_per_token),
    )
    server = GatewayServer(
        config, read_secret_file(args.secret_file), host=args.host, port=args.port, max_streams=256
    )
    ledger = _Ledger(server.coordinator, unfenced=args.unfenced)
    server.start()
    print(json.dumps({"event": "listening", "address": server.address}), flush=True)
    try:
        for line in sys.stdin:
            words = line.split()
            if not words or words[0] == "stop":
                break
            if words[0] == "status":
                print(json.dumps(_status(server, ledger)), flush=True)
            elif words[0] == "exit":
                done = server.report_exit(int(words[1]), int(words[2]), "killed by the partition test")
                print(json.dumps({"reported": done, "at_s": time.monotonic()}), flush=True)
            else:
                print(json.dumps({"error": f"unknown command {words[0]!r}"}), flush=True)
    finally:
        server.stop(grace_s=0.5)
    print(json.dumps(_stopped(server, ledger)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
