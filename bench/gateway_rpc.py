"""Cost of the gateway's gRPC layer over its decision path, measured in one run.

For each op, the same Coordinator call is timed directly (the baseline: the decision path
alone) and through a real GatewayServer on loopback with a GatewayClient (gRPC, protobuf,
call signing and verification, the server lock):
- ``heartbeat``: a serving worker's heartbeat with load and 8 held-checkpoint reports;
- ``report_tokens``: one token report of a running request;
- ``report_step_x8``: one engine step's reports of 8 requests in one call (what a worker
  sends per step), against 8 direct calls;
- ``auth``: signing and verifying one call with a 96-byte body (``sign_call`` +
  ``CallVerifier.verify``), against one plain HMAC-SHA256 of the same bytes;
- ``reply_seal``: sealing and opening one 96-byte reply (``seal_reply`` + ``open_reply``),
  against one plain HMAC-SHA256 of the same bytes (the RPC rows include both seals).
Correctness is checked once before timing (the reply carries no fence, the tokens are
counted). Output: one JSON row per op with ``op, p50_us, p99_us, per_s`` (calls per second of
wall-clock time; the client and the server share the machine) and ``baseline_p50_us`` and
``ratio`` (gRPC p50 over the direct call's p50).

Directive latency (``--delivery``), each delivery measured on a gateway of its own in the same
run, with workers heartbeating every ``--heartbeat-s`` (0.25 s) through ``HeartbeatLoop``:
- ``admission``: from calling Submit to the serving worker's handler receiving its RUN;
- ``resume``: from the serving worker calling ReportExit (the failure is declared when the
  gateway handles it) to the survivor's handler receiving the RESUME.
``heartbeat`` is the delivery before the pushed channel (the gateway refuses directive
streams, replies carry them); ``pushed`` the Directives stream (heartbeats still run).
Submissions are spread uniformly over a heartbeat period so neither is phase-locked with the
heartbeats. Rows: ``op, delivery, p50_ms, p99_ms, mean_ms`` and, for pushed,
``speedup_p50`` (heartbeat p50 over pushed p50).

    python bench/gateway_rpc.py --json bench/gateway_rpc.json
    python bench/gateway_rpc.py --only-latency --trials 60
"""

from __future__ import annotations

import argparse
import hashlib
import hmac
import json
import threading
import time
from collections.abc import Callable

import numpy as np

from lumen_core.auth import (
    CLUSTER_PRINCIPAL,
    CallVerifier,
    new_instance_id,
    open_reply,
    seal_reply,
    sign_call,
)
from lumen_core.gateway.client import GatewayClient, RequestTokens
from lumen_core.gateway.coordinator import Coordinator, GatewayConfig
from lumen_core.gateway.directives import Directive, Resume, Run
from lumen_core.gateway.heartbeat import HeartbeatLoop
from lumen_core.gateway.reports import HeldReport, WorkerReport
from lumen_core.gateway.server import GatewayServer

SECRET = b"bench-secret-0123456789abcdef0123"
GIB = 1 << 30
NUM_WORKERS = 4
NUM_HELD = 8
STEP_REQUESTS = 8


def timed(fn: Callable[[], object], num_calls: int) -> np.ndarray:
    samples = np.empty(num_calls)
    for i in range(num_calls):
        started = time.perf_counter()
        fn()
        samples[i] = time.perf_counter() - started
    return samples


def row(op: str, samples: np.ndarray, baseline: np.ndarray) -> dict[str, float | str]:
    p50 = float(np.percentile(samples, 50)) * 1e6
    base = float(np.percentile(baseline, 50)) * 1e6
    return {
        "op": op,
        "p50_us": round(p50, 2),
        "p99_us": round(float(np.percentile(samples, 99)) * 1e6, 2),
        "per_s": round(len(samples) / float(samples.sum()), 1),
        "baseline_p50_us": round(base, 2),
        "ratio": round(p50 / base, 1),
    }


def populate(register: Callable[[int], None], admit: Callable[[], int]) -> list[int]:
    for worker_id in range(NUM_WORKERS):
        register(worker_id)
    return [admit() for _ in range(NUM_HELD * NUM_WORKERS)]


class _Arrivals:
    """A worker's directive handler: when each RUN / RESUME reached it (perf_counter)."""

    def __init__(self) -> None:
        self._lock = threading.Condition()
        self._at: dict[tuple[type, int], float] = {}

    def __call__(self, directives: tuple[Directive, ...]) -> None:
        now = time.perf_counter()
        with self._lock:
            for directive in directives:
                if isinstance(directive, (Run, Resume)):
                    self._at.setdefault((type(directive), directive.request_id), now)
            self._lock.notify_all()

    def wait(self, kind: type, request_id: int, timeout_s: float = 30.0) -> float:
        with self._lock:
            if not self._lock.wait_for(lambda: (kind, request_id) in self._at, timeout_s):
                raise RuntimeError(f"{kind.__name__} of request {request_id} never arrived")
            return self._at[(kind, request_id)]


def delivery_latency(pushed: bool, num_trials: int, heartbeat_s: float, seed: int) -> dict[str, np.ndarray]:
    """Admission and resume latencies (seconds) on a gateway delivering ``pushed`` or by
    heartbeat replies only. Trial i: a fresh worker ``i + 2`` registers (join-shortest-queue
    admits there: the survivor reports a long queue), a request is submitted, the worker's
    RUN awaited; then its exit is reported and the survivor's RESUME awaited (S&R: re-prefill
    on the survivor, the one live worker left)."""
    rng = np.random.default_rng(seed)
    config = GatewayConfig(policy="S&R", lease_s=30.0, heartbeat_s=heartbeat_s)
    admission, resume = np.empty(num_trials), np.empty(num_trials)
    loops: list[HeartbeatLoop] = []
    clients: list[GatewayClient] = []
    with GatewayServer(config, SECRET, push_directives=pushed, max_workers=num_trials + 2) as server:
        try:
            submitter = GatewayClient(server.address, SECRET, timeout_s=10.0)
            clients.append(submitter)

            def start_worker(worker_id: int, report: WorkerReport) -> tuple[GatewayClient, _Arrivals]:
                client = GatewayClient(server.address, SECRET, timeout_s=10.0)
                clients.append(client)
                arrivals = _Arrivals()
                client.register(worker_id, budget_bytes=64 * GIB, on_directives=arrivals)
                loop = HeartbeatLoop(
                    client, lambda: report, arrivals, lambda reason: None, pushed=pushed
                ).start()
                loops.append(loop)
                return client, arrivals

            _, survivor = start_worker(1, WorkerReport(num_running=1000))
            time.sleep(2 * heartbeat_s)  # its queue is known: admissions go to the new workers
            for trial in range(num_trials):
                worker_id = trial + 2
                victim_client, victim = start_worker(worker_id, WorkerReport())
                time.sleep(rng.uniform(0.0, heartbeat_s))  # a random phase of the heartbeats
                started = time.perf_counter()
                stream = submitter.submit([1, 2, 3], 1_000_000, timeout_s=600.0)
                request_id = next(stream).request_id
                admission[trial] = victim.wait(Run, request_id) - started
                time.sleep(rng.uniform(0.0, heartbeat_s))
                started = time.perf_counter()
                if not victim_client.report_exit(worker_id, 1, "bench"):  # signed with its call key
                    raise RuntimeError(f"worker {worker_id} was not failed")
                resume[trial] = survivor.wait(Resume, request_id) - started
                stream.close()
                loops.pop().stop()
        finally:
            for loop in loops:
                loop.stop()
            for client in clients:
                client.close()
    return {"admission": admission, "resume": resume}


def latency_rows(num_trials: int, heartbeat_s: float, seed: int) -> list[dict[str, float | str]]:
    samples = {
        delivery: delivery_latency(delivery == "pushed", num_trials, heartbeat_s, seed)
        for delivery in ("heartbeat", "pushed")
    }
    rows: list[dict[str, float | str]] = []
    for op in ("admission", "resume"):
        base_p50 = float(np.percentile(samples["heartbeat"][op], 50))
        for delivery in ("heartbeat", "pushed"):
            values = samples[delivery][op]
            p50 = float(np.percentile(values, 50))
            entry: dict[str, float | str] = {
                "op": op,
                "delivery": delivery,
                "p50_ms": round(p50 * 1e3, 2),
                "p99_ms": round(float(np.percentile(values, 99)) * 1e3, 2),
                "mean_ms": round(float(values.mean()) * 1e3, 2),
            }
            if delivery == "pushed":
                entry["speedup_p50"] = round(base_p50 / p50, 1)
            rows.append(entry)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--trials", type=int, default=60, help="admission/resume trials per delivery")
    parser.add_argument("--heartbeat-s", type=float, default=0.25)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--only-latency", action="store_true", help="skip the per-call costs")
    parser.add_argument("--json", default=None, metavar="PATH")
    args = parser.parse_args()
    latency = latency_rows(args.trials, args.heartbeat_s, args.seed)
    print(f"{'op':<11}{'delivery':>10}{'p50_ms':>9}{'p99_ms':>9}{'mean_ms':>9}{'speedup':>9}")
    for r in latency:
        print(
            f"{r['op']:<11}{r['delivery']:>10}{r['p50_ms']:>9}{r['p99_ms']:>9}{r['mean_ms']:>9}"
            f"{r.get('speedup_p50', ''):>9}"
        )
    if args.only_latency:
        if args.json:
            with open(args.json, "w") as handle:
                json.dump(latency, handle, indent=1)
        return
    config = GatewayConfig(policy="LUMEN")
    held = tuple(HeldReport(request_id, 1, 500) for request_id in range(1, NUM_HELD + 1))
    report = WorkerReport(num_running=3, num_waiting=1, held=held)

    direct = Coordinator(config, SECRET)
    populate(
        lambda w: direct.register(0.0, w, budget_bytes=64 * GIB),
        lambda: direct.admit(0.0, [1] * 100, 1_000_000).request_id,
    )
    direct_request = direct.admit(0.0, [1] * 100, 1_000_000)
    position = [0]

    def direct_heartbeat() -> None:
        direct.heartbeat(1.0, 1, 1, report)

    def direct_tokens() -> None:
        direct.report_tokens(1.0, direct_request.worker_id, 1, direct_request.request_id, 1, position[0], [7])
        position[0] += 1

    step_ids = [direct.admit(0.0, [1] * 100, 1_000_000, worker_id=0).request_id for _ in range(STEP_REQUESTS)]
    step_position = [0]

    def direct_step() -> None:
        for request_id in step_ids:
            direct.report_tokens(1.0, 0, 1, request_id, 1, step_position[0], [7])
        step_position[0] += 1

    with GatewayServer(config, SECRET) as server:
        clients = [GatewayClient(server.address, SECRET, timeout_s=10.0) for _ in range(NUM_WORKERS)]
        submitter = GatewayClient(server.address, SECRET, timeout_s=10.0)
        for worker_id, client in enumerate(clients):
            client.register(worker_id, budget_bytes=64 * GIB)
        stop = threading.Event()

        def keep_leases() -> None:  # the workers' heartbeats, as in a live cluster
            while not stop.wait(config.heartbeat_s):
                for client in clients:
                    client.heartbeat(WorkerReport(num_running=12))

        heartbeats = threading.Thread(target=keep_leases, name="bench-heartbeats")
        heartbeats.start()
        try:
            streams = []
            for _ in range(48):  # 12 per worker, within max_streams (64)
                stream = submitter.submit([1] * 100, 1_000_000, timeout_s=600.0)
                next(stream)
                streams.append(stream)
            with server.condition:
                request_id = max(server.coordinator.monitor.request_ids())
                worker_id, _ = server.coordinator.request_worker(request_id)
                on_zero = [r for r in server.coordinator.monitor.running_on(0) if r != request_id]
            assert len(on_zero) >= STEP_REQUESTS
            worker = clients[worker_id]
            rpc_position = [0]
            rpc_step_position = [0]
            step = clients[0]

            def rpc_step() -> None:
                p = rpc_step_position[0]
                acks = step.report_tokens_batch(
                    [RequestTokens(r, 1, p, (7,)) for r in on_zero[:STEP_REQUESTS]]
                )
                assert acks[-1].code == 0
                rpc_step_position[0] += 1

            def rpc_heartbeat() -> None:
                clients[1].heartbeat(report)

            def rpc_tokens() -> None:
                worker.report_tokens(request_id, 1, rpc_position[0], [7])
                rpc_position[0] += 1

            assert not clients[1].heartbeat(report).fenced
            assert worker.report_tokens(request_id, 1, 0, [7]).num_new == 1
            rpc_position[0] = 1
            direct_tokens()
            results = [
                row("heartbeat", timed(rpc_heartbeat, args.calls), timed(direct_heartbeat, args.calls)),
                row("report_tokens", timed(rpc_tokens, args.calls), timed(direct_tokens, args.calls)),
                row("report_step_x8", timed(rpc_step, args.calls), timed(direct_step, args.calls)),
            ]
            for stream in streams:
                stream.close()
        finally:
            stop.set()
            heartbeats.join(timeout=10.0)
            for client in [*clients, submitter]:
                client.close()

    instance_id = new_instance_id()
    verifier = CallVerifier(instance_id)
    method = "/lumen.gateway.v1.Gateway/Heartbeat"
    message = b"x" * 96

    def sign_and_verify() -> str:
        value = sign_call(
            SECRET, instance_id=instance_id, principal=CLUSTER_PRINCIPAL, method=method, body=message
        )
        return verifier.verify(method, value, message, lambda principal: SECRET)

    results.append(
        row(
            "auth",
            timed(sign_and_verify, args.calls),
            timed(lambda: hmac.new(SECRET, message, hashlib.sha256).hexdigest(), args.calls),
        )
    )
    value = sign_call(
        SECRET, instance_id=instance_id, principal=CLUSTER_PRINCIPAL, method=method, body=message
    )
    assert open_reply(SECRET, value, 0, seal_reply(SECRET, value, 0, message)) == message
    results.append(
        row(
            "reply_seal",
            timed(lambda: open_reply(SECRET, value, 0, seal_reply(SECRET, value, 0, message)), args.calls),
            timed(lambda: hmac.new(SECRET, message, hashlib.sha256).digest(), args.calls),
        )
    )
    print(f"{'op':<14}{'p50_us':>10}{'p99_us':>10}{'per_s':>10}{'base_p50':>10}{'ratio':>8}")
    for r in results:
        print(
            f"{r['op']:<14}{r['p50_us']:>10}{r['p99_us']:>10}{r['per_s']:>10}{r['baseline_p50_us']:>10}{r['ratio']:>8}"
        )
    if args.json:
        with open(args.json, "w") as handle:
            json.dump([*results, *latency], handle, indent=1)


# ---- pytest-benchmark (make bench): one signed heartbeat over loopback gRPC ----------------


def test_heartbeat_rpc(benchmark) -> None:  # type: ignore[no-untyped-def]
    config = GatewayConfig(policy="LUMEN")
    held = tuple(HeldReport(request_id, 1, 500) for request_id in range(1, NUM_HELD + 1))
    with GatewayServer(config, SECRET) as server:
        client = GatewayClient(server.address, SECRET, timeout_s=10.0)
        try:
            client.register(0, budget_bytes=64 * GIB)
            reply = benchmark(client.heartbeat, WorkerReport(num_running=3, num_waiting=1, held=held))
        finally:
            client.close()
    assert not reply.fenced


if __name__ == "__main__":
    main()
