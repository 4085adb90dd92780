"""Seeded fault schedules run on a ``NetCluster``, and the invariants checked after each.

A ``Schedule`` is a list of ``Fault``s, each with a kind, a target node, a start (seconds after
the first arrival) and a length, both in multiples of the lease; the seed draws the targets,
the starts within the stated windows and the requests' prompts, so a schedule is replayed from
its printed line (``Schedule.describe``). Kinds:

- ``cut_gateway``: a worker cut (both ways) from the gateway, not from its holders or writers;
- ``cut_writers``: a worker, as a holder, cut from every other worker (the writers streaming
  to it, which are also the holders it streams to); it still reaches the gateway (meaningful
  only under a policy that streams checkpoints: see ``Schedule.policy``);
- ``isolate_gateway``: the gateway cut from every node (the workers and the client);
- ``one_way``: the gateway's packets to a worker dropped, the worker's still arriving;
- ``loss``: ``percent`` of every forwarded packet dropped at random;
- ``rate``: a worker's link cut to ``mbit`` Mbit/s;
- ``link_down``: a worker's bridge port down;
- ``sigkill``: a worker SIGKILLed (the supervisor reports it and restarts it);
- ``sigstop``: a worker (or the client: a consumer that stalls) stopped (SIGSTOP), then
  continued.

A fault ``while_serving`` starts once its target serves a request (else at the last arrival),
and lasts its length from then. Faults that overlap in time are healed together at the end of
the last one. A worker that exits (fenced, or killed) is restarted as a recovering one by the
supervisor once no network fault is active. Delay is not a fault here: the kernel has no ``netem``.

Invariants (``violations``): no request lost; every client stream contiguous (no token
repeated, none missing); no token report of a fenced or outdated epoch accepted by the
gateway; outputs identical to the float64 reference run; every fault visible in the stats
(packets dropped at the bridge, traffic through a rate limit, the gateway's failure of a
killed, stopped or cut worker once the fault outlasted the lease); and every worker serving
again once the supervisor has restarted those that fenced themselves.
"""

from __future__ import annotations

import json
import signal
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from net_cluster import NetCluster
from netns import Network

from lumen_core.engine import Engine, SamplingParams, load_model
from lumen_core.sim.workload import Workload
from lumen_core.worker.scenario import arrivals_from_workload

NETWORK_KINDS = frozenset(
    {"cut_gateway", "cut_writers", "isolate_gateway", "one_way", "loss", "rate", "link_down"}
)
PROCESS_KINDS = frozenset({"sigkill", "sigstop"})
# Faults of a worker's link to the gateway: once longer than the lease, the gateway fails it.
FAILS_WORKER = frozenset({"cut_gateway", "one_way", "link_down", "sigstop", "sigkill"})
WORKER_SLACK_S = 4.0  # past the lease: the gateway's reap period, a starved heartbeat thread


@dataclass(frozen=True)
class Fault:
    kind: str
    start_lease: float  # after the first arrival, in leases
    length_lease: float  # in leases (0 for sigkill)
    target: str = ""  # node name; "" for loss
    percent: int = 5  # loss
    mbit: int = 100  # rate
    # Wait, from the start, until the target worker serves a request with a checkpoint (at most
    # ``Schedule.span_s``): a fault that must catch the worker serving cannot rely on the
    # arrival clock and the router placing a request there in time.
    while_serving: bool = False

    def __post_init__(self) -> None:
        if self.kind not in NETWORK_KINDS | PROCESS_KINDS:
            raise ValueError(
                f"kind must be one of {sorted(NETWORK_KINDS | PROCESS_KINDS)}, got {self.kind!r}"
            )
        if self.start_lease < 0 or self.length_lease < 0:
            raise ValueError(
                f"start_lease and length_lease must be >= 0, got {self.start_lease}, {self.length_lease}"
            )

    def describe(self, lease_s: float) -> str:
        what = {"loss": f"loss {self.percent}%", "rate": f"rate {self.mbit} Mbit/s {self.target}"}.get(
            self.kind, f"{self.kind} {self.target}"
        )
        serving = " once serving" if self.while_serving else ""
        return (
            f"{what} at {self.start_lease * lease_s:.2f} s{serving} for {self.length_lease * lease_s:.2f} s "
            f"({self.length_lease:.2f} x lease)"
        )


@dataclass(frozen=True)
class Schedule:
    """``num_requests`` arrivals over ``span_s`` with ``output_tokens`` each, on ``num_workers``
    workers with lease ``lease_s``; ``faults`` drawn from ``seed``."""

    name: str
    seed: int
    faults: tuple[Fault, ...]
    lease_s: float = 3.0
    num_workers: int = 3
    num_requests: int = 9
    span_s: float = 3.0
    output_tokens: int = 200
    # LUMEN: every worker streams its checkpoints to holders in the other workers' namespaces
    # (test_partition_ucx_crosses_namespaces_over_tcp_only), so a failover restores them.
    policy: str = "LUMEN"

    def describe(self) -> str:
        faults = "; ".join(f.describe(self.lease_s) for f in self.faults)
        return (
            f"schedule {self.name} seed {self.seed} ({self.policy}, lease {self.lease_s} s, "
            f"{self.num_workers} workers, {self.num_requests} requests over {self.span_s} s): {faults}"
        )


def draw(
    name: str,
    seed: int,
    kinds: list[tuple[str, float, float]],
    *,
    while_serving: bool = False,
    **options: object,
) -> Schedule:
    """A schedule of one fault per ``(kind, length_lease, latest_start_lease)``: its target
    worker and its start (uniform in [0.25, latest_start_lease] leases) drawn from ``seed``.
    Kind ``sigstop_client`` is ``sigstop`` of the client; ``while_serving`` applies to every
    fault (``Fault.while_serving``)."""
    rng = np.random.default_rng(seed)
    num_workers = int(options.get("num_workers", 3))  # type: ignore[call-overload]
    faults = []
    workers = [f"w{i}" for i in rng.permutation(num_workers)]  # distinct targets, in drawn order
    for kind, length_lease, latest in kinds:
        fixed = {"loss": "", "isolate_gateway": "gateway", "sigstop_client": "client"}
        target = fixed[kind] if kind in fixed else workers.pop(0)
        start = float(np.round(rng.uniform(0.25, max(0.25, latest)), 2))
        faults.append(
            Fault(kind.removesuffix("_client"), start, length_lease, target, while_serving=while_serving)
        )
    return Schedule(name, seed, tuple(faults), **options)  # type: ignore[arg-type]


@dataclass
class Outcome:
    schedule: Schedule
    records: list[dict[str, object]]
    reference: list[list[int]]
    gateway: dict[str, object]
    worker_stats: list[dict[str, object]]
    evidence: list[dict[str, object]] = field(default_factory=list)  # one per fault
    restarts: list[int] = field(default_factory=list)
    final_workers: list[dict[str, object]] = field(default_factory=list)  # the gateway's, at the end
    # Failures the gateway handled by then (its stopped record also has those of the teardown:
    # a worker slow to exit on SIGTERM can outlive its lease there).
    num_failures: int = 0
    faults_by_class: dict[str, int] = field(default_factory=dict)
    duration_s: float = 0.0


def _arrivals(schedule: Schedule) -> list[dict[str, object]]:
    n = schedule.num_requests
    workload = Workload(
        np.linspace(0.0, schedule.span_s, n), np.full(n, 320), np.full(n, schedule.output_tokens)
    )
    arrivals = arrivals_from_workload(workload, seed=schedule.seed, max_output_tokens=schedule.output_tokens)
    return [
        {"time_s": a.time_s, "prompt": list(a.prompt_token_ids), "max_new_tokens": a.max_new_tokens}
        for a in arrivals
    ]


def reference_outputs(model_path: Path, arrivals: list[dict[str, object]]) -> list[list[int]]:
    """The failure-free outputs: one engine, every request in one batch (float64 greedy
    decoding does not depend on the batch). One torch thread (a loaded 2-core machine)."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        engine = Engine(load_model(model_path))
        return engine.generate(
            [list(a["prompt"]) for a in arrivals],  # type: ignore[call-overload]
            [SamplingParams(max_tokens=int(a["max_new_tokens"])) for a in arrivals],  # type: ignore[call-overload]
        )
    finally:
        torch.set_num_threads(previous)


def _serving(cluster: NetCluster, node: str) -> bool:
    """Whether worker ``node`` runs a request it has checkpointed (so it has served it); for
    the gateway, whether every live worker holds a durable copy of a running request (the
    first to register after the cut restores what it holds: CI saw restored 0 when only one
    copy was durable at the cut)."""
    status = cluster.ask("status")
    by_worker = status["running"]  # type: ignore[index]
    if node == "gateway":
        held = {h for ids in by_worker.values() for r in ids for h in status["holders"].get(str(r), [])}  # type: ignore[attr-defined]
        return bool(by_worker) and {int(w) for w in by_worker} <= held
    running = by_worker.get(node[1:], [])  # type: ignore[attr-defined]
    return any(status["holders"].get(str(r)) for r in running)  # type: ignore[attr-defined]


def _apply(cluster: NetCluster, network: Network, fault: Fault) -> None:
    workers = [f"w{i}" for i in range(cluster.num_workers)]
    match fault.kind:
        case "cut_gateway":
            network.cut(fault.target, "gateway")
        case "cut_writers":
            network.isolate(fault.target, [w for w in workers if w != fault.target])
        case "isolate_gateway":
            network.isolate("gateway")
        case "one_way":
            network.cut("gateway", fault.target, one_way=True)
        case "loss":
            network.loss(fault.percent)
        case "rate":
            network.rate(fault.target, fault.mbit)
        case "link_down":
            network.link_down(fault.target)
        case "sigkill":
            cluster.kill(int(fault.target[1:]))
        case "sigstop":
            cluster.signal(fault.target, signal.SIGSTOP)


def _hear_zombies(cluster: NetCluster, timeout_s: float) -> None:
    """Wait (at most ``timeout_s``) until every worker epoch the gateway fenced has reported
    again. An unfenced worker's reports from a cut sit in its TCP connection, whose backed-off
    retransmission timer delivers them up to about the cut's length after the heal: the
    client may be done by then, and the run must not end before the stale writes it is about."""
    deadline = time.monotonic() + timeout_s
    while cluster.ask("status")["unheard_fenced"] and time.monotonic() < deadline:
        time.sleep(0.1)


def run_schedule(workdir: Path, network: Network, schedule: Schedule, *, unfenced: bool = False) -> Outcome:
    """Run ``schedule`` on a fresh cluster in ``network``; every process is reaped. Prints the
    schedule's line first (replay it from there)."""
    print(schedule.describe(), flush=True)
    lease = schedule.lease_s
    arrivals = _arrivals(schedule)
    last_end_s = max(
        max(f.start_lease * lease, schedule.span_s if f.while_serving else 0.0) + f.length_lease * lease
        for f in schedule.faults
    )
    timeout_s = schedule.span_s + last_end_s + 60.0
    cluster = NetCluster(
        workdir,
        network,
        num_workers=schedule.num_workers,
        lease_s=lease,
        seed=schedule.seed,
        policy=schedule.policy,
        unfenced=unfenced,
    )
    evidence: list[dict[str, object]] = [{} for _ in schedule.faults]
    restarts: list[int] = []
    stopped: dict[str, object] = {}
    final_workers: object = []
    final_failures: object = 0
    started = time.monotonic()
    try:
        cluster.start()
        client = cluster.start_client(arrivals, timeout_s)
        t0 = time.monotonic()
        pending = list(range(len(schedule.faults)))
        active: list[int] = []
        while pending or active:
            now = time.monotonic() - t0
            for i in [i for i in pending if schedule.faults[i].start_lease * lease <= now]:
                fault = schedule.faults[i]
                if fault.while_serving and now < schedule.span_s and not _serving(cluster, fault.target):
                    continue
                _apply(cluster, network, fault)
                evidence[i]["applied_s"] = round(now, 2)
                pending.remove(i)
                active.append(i)
            for i in [
                i
                for i in active
                if evidence[i]["applied_s"] + schedule.faults[i].length_lease * lease <= now  # type: ignore[operator]
            ]:
                fault = schedule.faults[i]
                active.remove(i)
                if fault.kind == "sigstop":
                    cluster.signal(fault.target, signal.SIGCONT)
                elif fault.kind in NETWORK_KINDS and not any(
                    schedule.faults[j].kind in NETWORK_KINDS for j in active
                ):
                    limited_bytes, held = network.limited()
                    dropped = network.heal()
                    for j, other in enumerate(schedule.faults):
                        if (
                            other.kind in NETWORK_KINDS
                            and "healed_s" not in evidence[j]
                            and "applied_s" in evidence[j]
                        ):
                            evidence[j].update(
                                healed_s=round(now, 2),
                                dropped_packets=dropped,
                                limited_bytes=limited_bytes,
                                overlimits=held,
                            )
            if not any(schedule.faults[j].kind in NETWORK_KINDS for j in active):
                restarts += cluster.restart_exited()
            time.sleep(0.05)
        # The faults are over: supervise until the client is done.
        deadline = time.monotonic() + timeout_s + 10.0
        while client.poll() is None and time.monotonic() < deadline:
            restarts += cluster.restart_exited()
            time.sleep(0.1)
        client.wait(timeout=max(1.0, deadline - time.monotonic()))
        records = cluster.client_results()
        if unfenced:  # an unfenced worker never exits (nothing to restart) but may report late
            _hear_zombies(cluster, 2.0 * last_end_s + lease)
        else:
            restarts += cluster.restore_failed(lease + WORKER_SLACK_S + 6.0)
        final = cluster.ask("status")
        final_workers, final_failures = final["workers"], final["failures"]
    finally:
        stopped = cluster.close()
    outcome = Outcome(
        schedule,
        records,
        reference_outputs(cluster.model_path, arrivals),
        stopped,
        cluster.worker_stopped(),
        evidence=evidence,
        restarts=restarts,
        final_workers=final_workers,  # type: ignore[arg-type]
        num_failures=int(final_failures),  # type: ignore[call-overload]
        faults_by_class=dict(Counter(f.kind for f in schedule.faults)),
        duration_s=time.monotonic() - started,
    )
    print("partition-summary " + json.dumps(summary(outcome)), flush=True)
    return outcome


def summary(outcome: Outcome) -> dict[str, object]:
    """One row of bench/RESULTS.md's partition table."""
    return {
        "schedule": outcome.schedule.name,
        "seed": outcome.schedule.seed,
        "faults": outcome.faults_by_class,
        "requests": len(outcome.records),
        "finished": sum(bool(r["finished"]) for r in outcome.records),
        "gateway_failures": outcome.num_failures,
        "restarts": len(outcome.restarts),
        # Requests resumed from a checkpoint (a local or a remote holder) instead of re-prefilled.
        "restored": sum(
            int(s.get("restored", 0)) + int(s.get("remote_restored", 0))  # type: ignore[call-overload]
            for s in outcome.worker_stats
        ),
        # Faults healed together share one count: the largest is the schedule's.
        "dropped_packets": max((int(e.get("dropped_packets", 0)) for e in outcome.evidence), default=0),  # type: ignore[call-overload]
        "violations": len(violations(outcome)),
        "duration_s": round(outcome.duration_s, 1),
    }


def violations(outcome: Outcome) -> list[str]:
    """Every invariant the outcome breaks (see module doc), worded for a test failure."""
    found = []
    for i, (record, expected) in enumerate(zip(outcome.records, outcome.reference, strict=True)):
        if not record["finished"] or int(record["request_id"]) < 0:  # type: ignore[call-overload]
            found.append(f"request {i} lost: {record['error'] or 'not finished'}")
        position = 0
        for start, count in record["chunks"]:  # type: ignore[attr-defined]
            if start < position:
                found.append(f"request {i}: tokens {start}..{position - 1} repeated")
            elif start > position:
                found.append(f"request {i}: tokens {position}..{start - 1} missing")
            position = max(position, start + count)
        if record["finished"] and record["token_ids"] != expected:
            found.append(f"request {i}: output differs from the failure-free run")
    stale = outcome.gateway.get("stale_accepted", None)
    if stale is None:
        found.append("the gateway reported nothing (its stopped record is missing)")
    elif stale:
        found.append(f"{len(stale)} token reports of a fenced or outdated epoch accepted: {stale[:3]}")
    failures = outcome.gateway.get("failures", [])
    lease = outcome.schedule.lease_s
    for fault, seen in zip(outcome.schedule.faults, outcome.evidence, strict=True):
        label = fault.describe(lease)
        if "applied_s" not in seen:
            found.append(f"{label}: never applied")
            continue
        if fault.kind in (
            "cut_gateway",
            "cut_writers",
            "isolate_gateway",
            "one_way",
            "loss",
        ) and not seen.get("dropped_packets"):
            found.append(f"{label}: no packet dropped")
        if fault.kind == "rate" and not seen.get("limited_bytes"):
            found.append(f"{label}: no traffic passed the rate limit")
        outlasts = fault.kind == "sigkill" or fault.length_lease > 1.0
        if fault.kind in FAILS_WORKER and outlasts and fault.target.startswith("w"):
            worker_id = int(fault.target[1:])
            if not any(worker_id in f["worker_ids"] for f in failures):  # type: ignore[index, operator, union-attr]
                found.append(f"{label}: the gateway never failed worker {worker_id}")
    for worker in outcome.final_workers:
        if worker["state"] == "failed":
            found.append(
                f"worker {worker['worker_id']} not serving again after the schedule ({worker['state']})"
            )
    return found
