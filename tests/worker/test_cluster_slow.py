"""Slower live-cluster scenarios: two failures (a holder dies with the worker it holds for),
a worker without the cluster secret, a worker whose lease runs out while it is alive."""

import time
from pathlib import Path

import numpy as np
import pytest

from lumen_core import _native
from lumen_core.engine import Engine, SamplingParams, load_model
from lumen_core.gateway.auth import write_secret_file
from lumen_core.sim.workload import Workload
from lumen_core.worker.cluster import LocalCluster, RequestResult
from lumen_core.worker.scenario import arrivals_from_workload

pytestmark = [
    pytest.mark.slow,
    pytest.mark.ucx,
    pytest.mark.skipif(not _native.HAS_UCX, reason="lumen_core._C_ucx is not built (LUMEN_UCX=ON)"),
    pytest.mark.timeout(300),
]


def _wait(predicate, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.05)
    return False


def test_worker_and_its_holder_killed_nothing_lost(tmp_path: Path) -> None:
    import threading

    n = 12
    arrivals = arrivals_from_workload(
        Workload(np.linspace(0, 1.0, n), np.full(n, 320), np.full(n, 300)), seed=5, max_output_tokens=300
    )
    with LocalCluster(tmp_path, policy="LUMEN", num_workers=4) as cluster:
        cluster.start()
        results = [RequestResult(i, 0.0) for i in range(n)]
        threads = [
            threading.Thread(target=cluster.run_request, args=(r, list(a.prompt_token_ids), a.max_new_tokens, 120.0))
            for r, a in zip(results, arrivals, strict=True)
        ]
        for thread in threads:
            thread.start()

        def victim_and_holder() -> tuple[int, int] | None:
            with cluster.gateway.condition:
                monitor = cluster.gateway.coordinator.monitor
                for worker_id in monitor.live_worker_ids():
                    for request_id in monitor.running_on(worker_id):
                        view = monitor.request(request_id)
                        if view.durable_tokens and max(d for _, d in view.durable_tokens) >= 32:
                            return worker_id, view.holder_ids[0]
            return None

        assert _wait(lambda: victim_and_holder() is not None, 30)
        victim, holder = victim_and_holder()  # type: ignore[misc]
        cluster.kill(holder)
        cluster.kill(victim)
        for thread in threads:
            thread.join(120)
    assert all(r.finished and not r.error for r in results)
    engine = Engine(load_model(tmp_path / "target.pt"))
    reference = engine.generate(
        [list(a.prompt_token_ids) for a in arrivals], [SamplingParams(max_tokens=a.max_new_tokens) for a in arrivals]
    )
    assert [r.token_ids for r in results] == reference
    assert len(cluster.gateway.coordinator.failures) == 2


def test_worker_without_the_secret_is_refused(tmp_path: Path) -> None:
    with LocalCluster(tmp_path, policy="LUMEN", num_workers=2) as cluster:
        cluster.start()
        cluster.secret_path = tmp_path / "rogue.secret"
        write_secret_file(cluster.secret_path)
        rogue = cluster.spawn(7)
        assert rogue.process.wait(timeout=60) == 2
        assert "UNAUTHENTICATED" in rogue.stderr_path.read_text()
        assert 7 not in [w.worker_id for w in cluster.client.status().workers]


def test_worker_whose_lease_runs_out_fences_itself(tmp_path: Path) -> None:
    with LocalCluster(tmp_path, policy="LUMEN", num_workers=2, lease_s=2.0, heartbeat_s=0.25) as cluster:
        cluster.start()
        cluster.gateway.stop(grace_s=0.1)  # the gateway goes silent; the workers are alive
        for worker in cluster.workers.values():
            assert worker.process.wait(timeout=60) == 3
            assert _wait(lambda: bool([e for e in worker.events if e.get("event") == "stopped"]), 5)
            stopped = [e for e in worker.events if e.get("event") == "stopped"]
            assert stopped[0]["status"] == 3 and "lease" in str(stopped[0]["reason"])
