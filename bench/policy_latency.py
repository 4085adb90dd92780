"""Coordinator cost of the recovery policies at 8, 64 and 1024 workers.

Measures, in one run and on one thread:
- ``lifecycle``: a full request lifecycle as the coordinator sees it: admit, place with
  reservation, one heartbeat-aggregated growth report, release on finish. Steady state with
  ``--requests-per-worker`` requests in flight. LUMEN (LoadAware) and the FC baseline
  (FixedNeighbour) in the same run.
- ``place``: one placement decision (LoadAware), against FixedNeighbour and against the
  obvious implementation (a Python min over the live workers of L recomputed from the held
  checkpoints' sizes), which the monitor's incremental vectors replace.
- ``route``: routing all interrupted requests of a failed worker (LocalityAware), against
  Rebalance (S&R).
Correctness is checked once before timing: the placement equals the obvious argmin, and the
router gives one decision per interrupted request. Output: one JSON row per (workers, op)
with ``workers, op, p50_us, p99_us, per_s`` (operations per second of CPU time: lifecycles,
placements, or whole-failure routings), ``per_s_wall`` (per wall-clock second), and
``baseline`` and ``ratio`` (op p50 over the baseline's p50) where a baseline applies.

    python bench/policy_latency.py --json bench/policy_latency.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable

import numpy as np

from lumen_core.policy import (
    CheckpointGrew,
    FixedNeighbour,
    LoadAware,
    LoadConfig,
    LoadMonitor,
    LocalityAware,
    Placement,
    Rebalance,
    RequestAdmitted,
    RequestFinished,
    Router,
    WorkerFailed,
    WorkerJoined,
)

BUDGET_BYTES = 1 << 50  # budgets never bind here: this measures the decision cost
PROMPT_TOKENS = (600, 900, 1155, 1500, 2100)
OUTPUT_TOKENS = 211


class Cluster:
    """A monitor in steady state: ``requests_per_worker`` placed, partly grown requests each."""

    def __init__(self, num_workers: int, requests_per_worker: int, placement: Placement) -> None:
        self.monitor = LoadMonitor(LoadConfig())
        self.placement = placement
        self.next_request_id = 0
        self.in_flight: list[int] = []
        for worker_id in range(num_workers):
            self.monitor.apply(WorkerJoined(0.0, worker_id, BUDGET_BYTES))
        for _ in range(requests_per_worker):
            for worker_id in range(num_workers):
                self.admit_and_place(worker_id)

    def admit_and_place(self, worker_id: int) -> int:
        request_id = self.next_request_id
        self.next_request_id += 1
        prompt = PROMPT_TOKENS[request_id % len(PROMPT_TOKENS)]
        self.monitor.apply(RequestAdmitted(0.0, request_id, worker_id, prompt, OUTPUT_TOKENS))
        decision = self.placement.place(self.monitor, request_id)
        for holder_id in decision.new_holder_ids:
            self.monitor.apply(CheckpointGrew(0.0, request_id, holder_id, prompt + 20))
        self.in_flight.append(request_id)
        return request_id


CHUNK = 100  # operations per CPU-time reading (reading the thread clock costs about 1 us)


class Samples:
    """Wall-clock time of every operation, thread CPU time per chunk of operations (ns)."""

    def __init__(self) -> None:
        self.wall_ns: list[int] = []
        self.cpu_ns = 0


def row(workers: int, op: str, samples: Samples) -> dict:
    """p50/p99 of wall-clock latency; per_s = operations per second of this thread's CPU time
    (the coordinator's cost: time other processes take on the shared cores is not ours), and
    per_s_wall = operations per wall-clock second, for comparison."""
    wall_us = np.asarray(samples.wall_ns, dtype=np.float64) / 1e3
    count = len(samples.wall_ns)
    return {
        "workers": workers,
        "op": op,
        "p50_us": round(float(np.percentile(wall_us, 50)), 3),
        "p99_us": round(float(np.percentile(wall_us, 99)), 3),
        "per_s": round(count / (samples.cpu_ns / 1e9), 1),
        "per_s_wall": round(count / (float(wall_us.sum()) / 1e6), 1),
    }


def bench_lifecycle(num_workers: int, requests_per_worker: int, placement: Placement, count: int) -> Samples:
    """admit + place (reserve) + one aggregated growth report + finish (release)."""
    cluster = Cluster(num_workers, requests_per_worker, placement)
    monitor = cluster.monitor
    in_flight = cluster.in_flight
    samples = Samples()
    clock = time.perf_counter_ns
    for first in range(0, count, CHUNK):
        cpu_start = time.thread_time_ns()
        for i in range(first, min(first + CHUNK, count)):
            worker_id = i % num_workers
            request_id = cluster.next_request_id
            cluster.next_request_id += 1
            prompt = PROMPT_TOKENS[request_id % len(PROMPT_TOKENS)]
            start = clock()
            monitor.apply(RequestAdmitted(0.0, request_id, worker_id, prompt, OUTPUT_TOKENS))
            decision = placement.place(monitor, request_id)
            for holder_id in decision.new_holder_ids:
                monitor.apply(CheckpointGrew(0.0, request_id, holder_id, prompt + 64))
            monitor.apply(RequestFinished(0.0, in_flight[i]))
            samples.wall_ns.append(clock() - start)
            in_flight.append(request_id)
        samples.cpu_ns += time.thread_time_ns() - cpu_start
    return samples


def naive_argmin(monitor: LoadMonitor, serving_id: int) -> int:
    """The obvious Algorithm 1: recompute every live worker's L from what it holds."""
    config = monitor.config
    best_id, best_load = -1, float("inf")
    for worker_id in monitor.live_worker_ids():
        if worker_id == serving_id:
            continue
        held = 0
        for request_id in monitor.held_by(worker_id):
            request = monitor.request(request_id)
            durable = dict(request.durable_tokens)[worker_id]
            held += max(durable, request.prompt_tokens)
        view = monitor.worker(worker_id)
        load = config.alpha * held / config.mean_request_tokens + config.beta * (
            view.num_running + view.num_waiting
        )
        if load < best_load:
            best_id, best_load = worker_id, load
    return best_id


def bench_place(cluster: Cluster, choose: Callable[[int], object], count: int) -> Samples:
    """Latency of one placement choice. Each chunk admits its requests first and finishes
    them after (untimed), so reservations build up within a chunk as they would in a burst."""
    monitor = cluster.monitor
    num_workers = len(monitor.worker_ids())
    samples = Samples()
    clock = time.perf_counter_ns
    for first in range(0, count, CHUNK):
        request_ids = list(
            range(cluster.next_request_id, cluster.next_request_id + min(CHUNK, count - first))
        )
        cluster.next_request_id += len(request_ids)
        for request_id in request_ids:
            monitor.apply(RequestAdmitted(0.0, request_id, request_id % num_workers, 1155, OUTPUT_TOKENS))
        cpu_start = time.thread_time_ns()
        for request_id in request_ids:
            start = clock()
            choose(request_id)
            samples.wall_ns.append(clock() - start)
        samples.cpu_ns += time.thread_time_ns() - cpu_start
        for request_id in request_ids:
            monitor.apply(RequestFinished(0.0, request_id))
    return samples


def bench_route(
    num_workers: int, requests_per_worker: int, router: Router, count: int
) -> tuple[Samples, int]:
    """Latency of routing every interrupted request of one failed worker; the worker then
    rejoins and gets fresh requests, so every failure sees the same steady state."""
    cluster = Cluster(num_workers, requests_per_worker, LoadAware())
    monitor = cluster.monitor
    samples = Samples()
    decisions = 0
    clock = time.perf_counter_ns
    for i in range(count):
        failed_id = (i * 7) % num_workers
        monitor.apply(WorkerFailed(0.0, failed_id))
        start, cpu_start = clock(), time.thread_time_ns()
        routed = router.route(monitor, failed_id)
        samples.cpu_ns += time.thread_time_ns() - cpu_start
        samples.wall_ns.append(clock() - start)
        decisions += len(routed)
        cluster.placement.replace(monitor, failed_id)
        for decision in routed:
            monitor.apply(RequestFinished(0.0, decision.request_id))
        monitor.apply(WorkerJoined(0.0, failed_id, BUDGET_BYTES))
        for _ in range(len(routed)):
            cluster.admit_and_place(failed_id)
    return samples, decisions


def check_correctness(num_workers: int, requests_per_worker: int) -> None:
    cluster = Cluster(num_workers, requests_per_worker, LoadAware())
    monitor = cluster.monitor
    for serving_id in range(min(num_workers, 16)):
        request_id = cluster.next_request_id
        cluster.next_request_id += 1
        monitor.apply(RequestAdmitted(0.0, request_id, serving_id, 1155, OUTPUT_TOKENS))
        expected = naive_argmin(monitor, serving_id)
        decision = cluster.placement.place(monitor, request_id)
        if decision.holder_ids != (expected,):
            raise AssertionError(f"LoadAware chose {decision.holder_ids}, the obvious argmin {expected}")
    interrupted = monitor.running_on(0)
    monitor.apply(WorkerFailed(0.0, 0))
    routed = LocalityAware().route(monitor, 0)
    if [d.request_id for d in routed] != interrupted or monitor.running_on(0):
        raise AssertionError("router did not give exactly one decision per interrupted request")


def run(worker_counts: list[int], requests_per_worker: int, count: int) -> list[dict]:
    rows = []
    for num_workers in worker_counts:
        check_correctness(num_workers, requests_per_worker)
        lumen = bench_lifecycle(num_workers, requests_per_worker, LoadAware(), count)
        fc = bench_lifecycle(num_workers, requests_per_worker, FixedNeighbour(), count)
        rows.append(row(num_workers, "lifecycle", lumen) | {"baseline": "lifecycle_fc"})
        rows.append(row(num_workers, "lifecycle_fc", fc))

        # The lambdas run inside bench_place, within this iteration: the late binding is harmless.
        cluster = Cluster(num_workers, requests_per_worker, LoadAware())
        place = bench_place(cluster, lambda r: cluster.placement.place(cluster.monitor, r), count)  # noqa: B023
        fixed = bench_place(cluster, lambda r: FixedNeighbour().place(cluster.monitor, r), count)  # noqa: B023
        naive_count = max(20, count // max(1, num_workers // 8) // 10)
        naive = bench_place(
            cluster,
            lambda r: naive_argmin(cluster.monitor, cluster.monitor.request(r).worker_id),  # noqa: B023
            naive_count,
        )
        rows.append(row(num_workers, "place", place) | {"baseline": "place_naive"})
        rows.append(row(num_workers, "place_fc", fixed))
        rows.append(row(num_workers, "place_naive", naive))

        route_count = max(10, count // 50)
        routed, decisions = bench_route(num_workers, requests_per_worker, LocalityAware(), route_count)
        rebalanced, _ = bench_route(num_workers, requests_per_worker, Rebalance(), route_count)
        rows.append(
            row(num_workers, "route", routed)
            | {"baseline": "route_sr", "decisions_per_route": decisions / route_count}
        )
        rows.append(row(num_workers, "route_sr", rebalanced))
    by_key = {(r["workers"], r["op"]): r for r in rows}
    for r in rows:
        if "baseline" in r:
            r["ratio"] = float(f"{r['p50_us'] / by_key[(r['workers'], r['baseline'])]['p50_us']:.4g}")
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", metavar="PATH", help="write the rows as a JSON list to PATH")
    parser.add_argument("--workers", type=int, nargs="+", default=[8, 64, 1024])
    parser.add_argument("--requests-per-worker", type=int, default=16)
    parser.add_argument("--count", type=int, default=20_000, help="lifecycles/placements per size")
    args = parser.parse_args(argv)
    rows = run(args.workers, args.requests_per_worker, args.count)
    print(
        f"{'workers':>7} {'op':<13} {'p50_us':>9} {'p99_us':>9} {'per_s':>11} {'per_s_wall':>11} {'ratio':>8}"
    )
    for r in rows:
        ratio = f"{r['ratio']:.4g}x" if "ratio" in r else ""
        print(
            f"{r['workers']:>7} {r['op']:<13} {r['p50_us']:>9.2f} {r['p99_us']:>9.2f} "
            f"{r['per_s']:>11.1f} {r['per_s_wall']:>11.1f} {ratio:>8}"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


# ---- pytest-benchmark (make bench): 64 workers, correctness checked first -----------------


def test_place_load_aware(benchmark) -> None:  # type: ignore[no-untyped-def]
    check_correctness(64, 16)
    cluster = Cluster(64, 16, LoadAware())
    request_ids = iter(range(10**9, 2 * 10**9))

    def place() -> None:
        request_id = next(request_ids)
        cluster.monitor.apply(RequestAdmitted(0.0, request_id, request_id % 64, 1155, OUTPUT_TOKENS))
        cluster.placement.place(cluster.monitor, request_id)
        cluster.monitor.apply(RequestFinished(0.0, request_id))

    benchmark(place)


if __name__ == "__main__":
    sys.exit(main())
