"""A fenced worker keeps its holder up (issue 23): real workers in this process, a real
gateway on loopback. Its lease lost, a worker stops serving but keeps the checkpoints it holds
and registers again every heartbeat for ``holder_linger_s``; the next gateway on the same
address hears of those checkpoints. Past the linger it exits fenced."""

import threading
import time
from pathlib import Path

import pytest

from lumen_core import _native
from lumen_core.gateway.client import GatewayClient
from lumen_core.gateway.config import GatewayConfig
from lumen_core.gateway.server import GatewayServer
from lumen_core.testing import wait_until
from lumen_core.worker.cluster import write_models
from lumen_core.worker.exits import EXIT_FENCED
from lumen_core.worker.process import Worker, WorkerConfig

pytestmark = [
    pytest.mark.ucx,
    pytest.mark.skipif(not _native.HAS_UCX, reason="lumen_core._C_ucx is not built (LUMEN_UCX=ON)"),
    pytest.mark.timeout(120),
]

CONFIG = GatewayConfig(policy="FC", lease_s=1.0, heartbeat_s=0.1)


def _workers(tmp_path: Path, secret: bytes, address: str, linger_s: float) -> list[Worker]:
    model_path, _ = write_models(tmp_path, seed=0)
    return [
        Worker(
            WorkerConfig(w, address, str(model_path), budget_bytes=1 << 30, holder_linger_s=linger_s), secret
        )
        for w in range(2)
    ]


def _run(workers: list[Worker]) -> tuple[list[threading.Thread], list[int]]:
    statuses: list[int] = []
    threads = [threading.Thread(target=lambda w=w: statuses.append(w.run()), daemon=True) for w in workers]
    for worker in workers:
        worker.start()
    for thread in threads:
        thread.start()
    return threads, statuses


def test_a_fenced_worker_keeps_its_holder_and_registers_again_with_what_it_holds(
    tmp_path: Path, secret: bytes
) -> None:
    gateway = GatewayServer(CONFIG, secret, host="127.0.0.1", port=0).start()
    port = int(gateway.address.rsplit(":", 1)[1])
    workers = _workers(tmp_path, secret, gateway.address, linger_s=30.0)
    submitter = GatewayClient(gateway.address, secret)
    threads, statuses = _run(workers)
    successor = None
    try:
        stream = submitter.submit(list(range(1, 40)), 2000, timeout_s=60.0)
        request_id = next(stream).request_id
        holder = workers[1 - gateway.coordinator.request_worker(request_id)[0]]
        assert wait_until(lambda: any(c.durable_tokens > 8 for c in holder.store.checkpoints()))
        gateway.stop(grace_s=0.1)  # both leases run out: both workers fence themselves
        assert wait_until(lambda: all(w.fenced.is_set() for w in workers), 10.0)
        held = {c.request_id for c in holder.store.checkpoints()}
        assert held == {request_id}  # kept while fenced
        successor = GatewayServer(CONFIG, secret, host="127.0.0.1", port=port).start()
        assert wait_until(lambda: all(w.stats()["relinked"] == 1 for w in workers))
        assert [w.client.epoch for w in workers] == [2, 2]
        with successor.condition:  # the holder reported its checkpoint with its registration
            pending = successor.coordinator._pending_holds  # noqa: SLF001 - what the next gateway heard
            assert [(h, report.request_id) for h, report, _ in pending.get(request_id, [])] == [
                (holder.config.worker_id, request_id)
            ]
        assert statuses == [] and all(t.is_alive() for t in threads)  # serving again
    finally:
        for worker in workers:
            worker.stop()
        for thread in threads:
            thread.join(10)
        for worker in workers:
            worker.close()
        submitter.close()
        gateway.stop(grace_s=0.1)
        if successor is not None:
            successor.stop(grace_s=0.1)


def test_past_its_linger_a_fenced_worker_exits(tmp_path: Path, secret: bytes) -> None:
    gateway = GatewayServer(CONFIG, secret, host="127.0.0.1", port=0).start()
    workers = _workers(tmp_path, secret, gateway.address, linger_s=0.5)
    threads, statuses = _run(workers)
    try:
        gateway.stop(grace_s=0.1)
        for thread in threads:
            thread.join(20)
        assert statuses == [EXIT_FENCED, EXIT_FENCED]
        assert all(w.stats()["relinked"] == 0 and "lease" in w.fence_reason for w in workers)
    finally:
        for worker in workers:
            worker.stop()
            worker.close()


def test_a_request_that_comes_back_at_a_newer_epoch_is_served_to_its_end(
    tmp_path: Path, secret: bytes
) -> None:
    """The gateway stalls (its lock held) past the worker's 5 s call timeout: the worker's token
    reports fail and are kept to send again, its lease lapses, it fences itself and registers
    again; the gateway parks its only request and gives it back to it at a newer epoch. The
    kept reports are of the fenced epoch: the gateway refuses them, and a refusal must not drop
    the request served again (it then never finished: the partition suite's stuck stream)."""
    gateway = GatewayServer(CONFIG, secret, host="127.0.0.1", port=0).start()
    model_path, _ = write_models(tmp_path, seed=0)
    worker = Worker(
        WorkerConfig(0, gateway.address, str(model_path), budget_bytes=1 << 30, holder_linger_s=30.0), secret
    )
    submitter = GatewayClient(gateway.address, secret)
    threads, statuses = _run([worker])
    try:
        stream = submitter.submit(list(range(1, 40)), 400, timeout_s=60.0)
        chunks = [next(stream)]
        with gateway.condition:  # the stall; the worker's calls wait, then time out
            assert wait_until(lambda: worker.fenced.is_set(), 15.0)
            time.sleep(0.5)  # its first registration again is waiting too
        chunks += list(stream)
        tokens = [t for c in chunks for t in c.token_ids]
        assert chunks[-1].finished and len(tokens) == 400
        assert worker.stats()["relinked"] >= 1 and worker.client.epoch >= 2
        assert statuses == [] and all(t.is_alive() for t in threads)
    finally:
        worker.stop()
        for thread in threads:
            thread.join(10)
        worker.close()
        submitter.close()
        gateway.stop(grace_s=0.1)
