"""Slower live-cluster scenarios: a holder dies with the worker it holds for, two failures one
after the other, a remote restore, a worker without the cluster secret, a rogue worker acting
with its epochs after it was declared failed, a worker whose lease runs out while it is alive,
every worker killed at once (its requests parked)."""

import json
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from lumen_core import _native
from lumen_core.auth import write_secret_file
from lumen_core.engine import Engine, SamplingParams, load_model
from lumen_core.policy.events import RecoveryAction
from lumen_core.policy.routing import RouterConfig
from lumen_core.sim.workload import Workload
from lumen_core.testing import wait_until
from lumen_core.worker.cluster import LocalCluster, RequestResult
from lumen_core.worker.scenario import Arrival, arrivals_from_workload

pytestmark = [
    pytest.mark.slow,
    pytest.mark.ucx,
    pytest.mark.skipif(not _native.HAS_UCX, reason="lumen_core._C_ucx is not built (LUMEN_UCX=ON)"),
    pytest.mark.timeout(300),
]


def _submit_all(
    cluster: LocalCluster, arrivals: list[Arrival]
) -> tuple[list[RequestResult], list[threading.Thread]]:
    """One thread per request, each submitting at its arrival time (from now)."""
    start_s = time.monotonic()
    results = [RequestResult(i, a.time_s) for i, a in enumerate(arrivals)]

    def run(result: RequestResult, arrival: Arrival) -> None:
        time.sleep(max(0.0, start_s + arrival.time_s - time.monotonic()))
        cluster.run_request(result, list(arrival.prompt_token_ids), arrival.max_new_tokens, 150.0)

    threads = [threading.Thread(target=run, args=(r, a)) for r, a in zip(results, arrivals, strict=True)]
    for thread in threads:
        thread.start()
    return results, threads


def _reference(workdir: Path, arrivals: list[Arrival]) -> list[list[int]]:
    """The failure-free outputs (float64 greedy decoding does not depend on the batch). One
    torch thread: on a loaded 2-core machine spinning intra-op threads can be 100x slower."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        engine = Engine(load_model(workdir / "target.pt"))
        return engine.generate(
            [list(a.prompt_token_ids) for a in arrivals],
            [SamplingParams(max_tokens=a.max_new_tokens) for a in arrivals],
        )
    finally:
        torch.set_num_threads(previous)


def _checkpointed_worker(cluster: LocalCluster, exclude: set[int], min_tokens: int = 32) -> int | None:
    """A serving worker outside ``exclude`` running a request with ``min_tokens`` durable."""
    with cluster.gateway.condition:
        monitor = cluster.gateway.coordinator.monitor
        for worker_id in monitor.live_worker_ids():
            if worker_id in exclude:
                continue
            for request_id in monitor.running_on(worker_id):
                view = monitor.request(request_id)
                if view.durable_tokens and max(d for _, d in view.durable_tokens) >= min_tokens:
                    return worker_id
    return None


def test_worker_and_its_holder_killed_nothing_lost(tmp_path: Path) -> None:
    n = 12
    arrivals = arrivals_from_workload(
        Workload(np.linspace(0, 1.0, n), np.full(n, 320), np.full(n, 300)), seed=5, max_output_tokens=300
    )
    with LocalCluster(tmp_path, policy="LUMEN", num_workers=4) as cluster:
        cluster.start()
        results, threads = _submit_all(cluster, arrivals)

        def victim_and_holder() -> tuple[int, int] | None:
            with cluster.gateway.condition:
                monitor = cluster.gateway.coordinator.monitor
                for worker_id in monitor.live_worker_ids():
                    for request_id in monitor.running_on(worker_id):
                        view = monitor.request(request_id)
                        if view.durable_tokens and max(d for _, d in view.durable_tokens) >= 32:
                            return worker_id, view.holder_ids[0]
            return None

        assert wait_until(lambda: victim_and_holder() is not None, 30)
        victim, holder = victim_and_holder()  # type: ignore[misc]
        cluster.kill(holder)
        cluster.kill(victim)
        for thread in threads:
            thread.join(120)
    assert all(r.finished and not r.error for r in results)
    assert [r.token_ids for r in results] == _reference(tmp_path, arrivals)
    assert len(cluster.gateway.coordinator.failures) == 2


@pytest.mark.timeout(180)
def test_two_failures_one_after_the_other_lose_nothing(tmp_path: Path) -> None:
    n = 40  # arrivals over 20 s: requests with checkpoints run at both failures
    arrivals = arrivals_from_workload(
        Workload(np.linspace(0, 20.0, n), np.full(n, 320), np.full(n, 360)), seed=6, max_output_tokens=360
    )
    with LocalCluster(tmp_path, policy="LUMEN", num_workers=4, modelled_full_load_s=1.0) as cluster:
        cluster.start()
        results, threads = _submit_all(cluster, arrivals)
        victims: list[int] = []
        for failure in range(2):
            assert wait_until(lambda: _checkpointed_worker(cluster, set(victims)) is not None, 60), (
                f"failure {failure}: no worker outside {victims} runs a checkpointed request at "
                f"{cluster.now_s():.1f} s"
            )
            victim = _checkpointed_worker(cluster, set(victims))
            assert victim is not None
            cluster.kill(victim)
            with cluster.gateway.condition:
                interrupted = [r.request_id for r in cluster.gateway.coordinator.failures[-1].routes]
            assert interrupted
            cluster.restart(victim)
            victims.append(victim)
            # The first failure's requests run again before the second worker dies.
            with cluster.gateway.condition:
                before = {r: len(cluster.gateway.coordinator.tokens(r)[0]) for r in interrupted}

            def resumed() -> bool:  # waited on within this iteration: the loop variables are current
                with cluster.gateway.condition:
                    return all(
                        len(tokens) > before[r] or finished  # noqa: B023
                        for r in interrupted  # noqa: B023
                        for tokens, finished, _ in [cluster.gateway.coordinator.tokens(r)]
                    )

            assert wait_until(resumed, 60)
        for thread in threads:
            thread.join(150)
        with cluster.gateway.condition:
            failures = cluster.gateway.coordinator.failures
    assert [f.worker_ids for f in failures] == [(victims[0],), (victims[1],)] and victims[0] != victims[1]
    assert [(r.error, r.finished) for r in results] == [("", True)] * n
    assert [r.token_ids for r in results] == _reference(tmp_path, arrivals)
    # Checkpoints served the failures (the router restored rather than re-prefilled).
    assert any(r.action is not RecoveryAction.REPREFILL for f in failures for r in f.routes)


@pytest.mark.timeout(180)
def test_remote_restore_pulls_a_checkpoint_from_a_busier_holder(tmp_path: Path) -> None:
    # theta 0: every holder counts as overloaded, so a prefix over tau (16 tokens) is pulled by
    # the least-loaded survivor when that one is less loaded than the holder.
    router = RouterConfig(remote_restore=True, theta_multiple=0.0, tau_tokens=16)
    n = 24
    arrivals = arrivals_from_workload(
        Workload(np.linspace(0, 6.0, n), np.full(n, 320), np.full(n, 360)), seed=8, max_output_tokens=360
    )
    with LocalCluster(tmp_path, policy="LUMEN", num_workers=4, router_config=router) as cluster:
        cluster.start()
        results, threads = _submit_all(cluster, arrivals)
        monitor = cluster.gateway.coordinator.monitor

        def victim() -> int | None:
            """A worker running a checkpointed request whose holder is busier than another
            survivor (so the router pulls it to that one)."""
            with cluster.gateway.condition:
                live = monitor.live_worker_ids()
                for worker_id in live:
                    for request_id in monitor.running_on(worker_id):
                        for holder_id, durable in monitor.request(request_id).durable_tokens:
                            others = [monitor.load(w) for w in live if w not in (worker_id, holder_id)]
                            if durable >= 32 and others and min(others) + 1 < monitor.load(holder_id):
                                return worker_id
            return None

        assert wait_until(lambda: victim() is not None, 60)
        cluster.kill(victim())  # type: ignore[arg-type]
        with cluster.gateway.condition:
            routes = cluster.gateway.coordinator.failures[-1].routes
        for thread in threads:
            thread.join(150)
    remote = [r for r in routes if r.action is RecoveryAction.REMOTE_RESTORE]
    assert remote and all(r.target_worker_id != r.source_holder_id for r in remote)
    assert sum(int(s["remote_restored"]) for s in cluster.worker_stats()) == len(remote)
    assert [(r.error, r.finished) for r in results] == [("", True)] * n
    assert [r.token_ids for r in results] == _reference(tmp_path, arrivals)


def test_worker_without_the_secret_is_refused(tmp_path: Path) -> None:
    with LocalCluster(tmp_path, policy="LUMEN", num_workers=2) as cluster:
        cluster.start()
        cluster.secret_path = tmp_path / "rogue.secret"
        write_secret_file(cluster.secret_path)
        rogue = cluster.spawn(7)
        assert rogue.process.wait(timeout=60) == 2
        assert "UNAUTHENTICATED" in rogue.stderr_path.read_text()
        assert 7 not in [w.worker_id for w in cluster.client.status().workers]


@pytest.mark.timeout(180)
def test_rogue_worker_acting_with_its_old_epochs_is_refused(tmp_path: Path) -> None:
    n = 8
    arrivals = arrivals_from_workload(
        Workload(np.zeros(n), np.full(n, 320), np.full(n, 400)), seed=7, max_output_tokens=400
    )
    with LocalCluster(tmp_path, policy="LUMEN", num_workers=3) as cluster:
        cluster.start()
        rogue = subprocess.Popen(
            [
                sys.executable, str(Path(__file__).with_name("rogue.py")),
                "--gateway", cluster.gateway.address, "--secret-file", str(cluster.secret_path),
                "--worker-id", "3",
            ],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
        )  # fmt: skip
        try:
            assert rogue.stdin is not None and rogue.stdout is not None
            rogue_epoch = json.loads(rogue.stdout.readline())["epoch"]
            results, threads = _submit_all(cluster, arrivals)

            def rogue_requests() -> list[int]:
                with cluster.gateway.condition:
                    return cluster.gateway.coordinator.monitor.running_on(3)

            assert wait_until(lambda: bool(rogue_requests()), 30)
            rogue.stdin.write("take\n")
            rogue.stdin.flush()
            taken = json.loads(rogue.stdout.readline())["requests"]
            assert taken and all(t["epoch"] == 1 for t in taken)
            # Failed now, or already by its lease (the rogue heartbeats from one thread that a
            # loaded machine can starve): either way its epoch is over, which is what is tested.
            if not cluster.gateway.report_exit(3, rogue_epoch, "declared failed by the test"):
                with cluster.gateway.condition:
                    assert 3 not in cluster.gateway.coordinator.monitor.live_worker_ids()
            # Each request it had resumes on a real worker at epoch 2 and streams its new
            # checkpoint; the rogue then attacks the holder of one of them.
            coordinator = cluster.gateway.coordinator
            monitor = coordinator.monitor

            def current_holder() -> tuple[int, int] | None:
                """A holder with epoch-2 records, the one the rogue's capability names first."""
                with cluster.gateway.condition:
                    candidates = []
                    for t in taken:
                        rid = t["request_id"]
                        if not monitor.has_request(rid) or coordinator.request_worker(rid)[1] != 2:
                            continue
                        for holder_id, durable in monitor.request(rid).durable_tokens:
                            if durable > 0:  # reported for epoch 2 (older reports are dropped)
                                candidates.append(([holder_id] != t["holders"][:1], rid, holder_id))
                return min(candidates)[1:] if candidates else None

            found: list[tuple[int, int]] = []

            def holder_found() -> bool:  # keeps what it saw: asking again could see nothing
                holder = current_holder()
                if holder is not None:
                    found.append(holder)
                return holder is not None

            assert wait_until(holder_found, 60)
            request_id, holder_id = found[0]
            holder = next(
                e["holder"] for e in cluster.workers[holder_id].events if e.get("event") == "registered"
            )
            rogue.stdin.write(f"attack {request_id} {holder}\n")
            rogue.stdin.flush()
            attack = json.loads(rogue.stdout.readline())
            for thread in threads:
                thread.join(150)
        finally:
            rogue.kill()
            rogue.communicate(timeout=10)
    # The rogue's capability names its request's first epoch-1 holder. There the holder looks
    # at the epoch and fences it (StaleEpoch); on a holder the request moved to (placement
    # decides, timing with it) the capability itself is refused first (Rejected). Either way
    # nothing the rogue sent was taken.
    named = next(t["holders"][:1] for t in taken if t["request_id"] == request_id) == [holder_id]
    refused = "StaleEpoch" if named else "Rejected"
    assert attack == {
        "heartbeat_fenced": True,
        "report": "FAILED_PRECONDITION",  # a fenced worker epoch: the whole report is refused
        "open": refused,
        # An append is checked against the grant its connection's open recorded: the refused
        # open recorded none, so the append is refused before its epoch is looked at.
        "append": "Rejected",
        "release": refused,
    }
    assert [(r.error, r.finished) for r in results] == [("", True)] * n
    assert [r.token_ids for r in results] == _reference(tmp_path, arrivals)  # no fake token landed


def test_worker_whose_lease_runs_out_fences_itself(tmp_path: Path) -> None:
    # It keeps its holder up for the linger, registering again in vain, then exits 3.
    with LocalCluster(
        tmp_path, policy="LUMEN", num_workers=2, lease_s=2.0, heartbeat_s=0.25, holder_linger_s=1.0
    ) as cluster:
        cluster.start()
        cluster.gateway.stop(grace_s=0.1)  # the gateway goes silent; the workers are alive
        for worker in cluster.workers.values():
            assert worker.process.wait(timeout=60) == 3
            assert wait_until(lambda: bool([e for e in worker.events if e.get("event") == "stopped"]), 5)  # noqa: B023
            stopped = [e for e in worker.events if e.get("event") == "stopped"]
            assert stopped[0]["status"] == 3 and "lease" in str(stopped[0]["reason"])


@pytest.mark.timeout(240)
def test_every_worker_killed_then_one_restarted_parks_and_loses_nothing(tmp_path: Path) -> None:
    """Issue 23: with no worker left serving the gateway parks the requests (their streams stay
    open) and resumes them on the worker that comes back, output equal to a failure-free run."""
    n = 4
    arrivals = arrivals_from_workload(
        Workload(np.linspace(0, 0.5, n), np.full(n, 200), np.full(n, 200)), seed=7, max_output_tokens=200
    )
    with LocalCluster(tmp_path, policy="LUMEN", num_workers=2) as cluster:
        cluster.start()
        results, threads = _submit_all(cluster, arrivals)
        assert wait_until(lambda: all(len(r.token_ids) >= 4 for r in results), 60)
        cluster.kill(0)
        cluster.kill(1)
        with cluster.gateway.condition:
            plan = cluster.gateway.coordinator.failures[-1]
            assert plan.parked_request_ids and not plan.lost_request_ids
        cluster.restart(0)
        for thread in threads:
            thread.join(150)
    assert all(r.finished and not r.error for r in results), [r.error for r in results]
    assert [r.token_ids for r in results] == _reference(tmp_path, arrivals)
    assert cluster.gateway.coordinator.metrics().num_parked_total >= 1
