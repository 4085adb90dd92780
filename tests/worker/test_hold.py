"""A real worker (in this process) against a real gateway: HOLD reserves in its embedded
HolderStore, and a reservation its budget cannot take is refused, reported with the next
heartbeat, and the gateway places the copy on another worker."""

import threading
import time
from pathlib import Path

import pytest

from lumen_core import _native
from lumen_core.gateway.client import GatewayClient
from lumen_core.gateway.config import GatewayConfig
from lumen_core.gateway.directives import Hold, Run, Stream
from lumen_core.gateway.server import GatewayServer
from lumen_core.policy.load import LoadConfig
from lumen_core.testing import wait_until
from lumen_core.worker.cluster import write_models
from lumen_core.worker.process import Worker, WorkerConfig

pytestmark = [
    pytest.mark.ucx,
    pytest.mark.skipif(not _native.HAS_UCX, reason="lumen_core._C_ucx is not built (LUMEN_UCX=ON)"),
    pytest.mark.timeout(120),
]

GIB = 1 << 30


@pytest.mark.parametrize("budget_bytes", [2048, GIB])
def test_hold_reserves_and_a_worker_without_room_refuses_to_the_gateway(
    tmp_path: Path, secret: bytes, budget_bytes: int
) -> None:
    model_path, _ = write_models(tmp_path, seed=0)
    # 16 bytes a token at the gateway: the copy, (30 + 8) * 16 = 608 bytes, fits a 2 KiB
    # holder there; the worker's store charges a whole record, 2048 + 8 bytes (float64), and
    # cannot take it.
    config = GatewayConfig(policy="LUMEN", heartbeat_s=0.1, load_config=LoadConfig(kv_bytes_per_token=16))
    gateway = GatewayServer(config, secret, port=0).start()
    serving = GatewayClient(gateway.address, secret)  # worker 0 serves (join-shortest-queue, lowest id)
    spare = GatewayClient(gateway.address, secret)
    submitter = GatewayClient(gateway.address, secret)
    worker = Worker(WorkerConfig(1, gateway.address, str(model_path), budget_bytes=budget_bytes), secret)
    thread = threading.Thread(target=worker.run, daemon=True)
    try:
        serving.register(0, budget_bytes=GIB, holder_address="127.0.0.1:7000")
        worker.start()  # worker 1: the least-loaded holder (ties: lowest id)
        thread.start()
        spare.register(2, budget_bytes=GIB, holder_address="127.0.0.1:7002")
        stream = submitter.submit(list(range(10, 40)), 8, timeout_s=30.0)
        request_id = next(stream).request_id
        (run,) = [d for d in serving.heartbeat().directives if isinstance(d, Run)]
        assert [h.worker_id for h in run.holders] == [1]
        store = worker.store
        if budget_bytes == GIB:  # reserved at placement: 608 bytes, one record
            assert wait_until(lambda: store.stats()["reservations"] == 1)
            (checkpoint,) = store.checkpoints()
            assert (checkpoint.request_id, checkpoint.reserved_tokens, checkpoint.opened) == (
                request_id,
                1,
                False,
            )
            time.sleep(0.5)  # a few heartbeats: nothing is refused, the copy stays on worker 1
            with gateway.condition:
                assert gateway.coordinator.monitor.request(request_id).holder_ids == (1,)
            return
        monitor = gateway.coordinator.monitor

        def placed_elsewhere() -> bool:
            with gateway.condition:
                return monitor.request(request_id).holder_ids == (2,)

        assert wait_until(placed_elsewhere)
        with gateway.condition:
            assert monitor.refused_by(request_id) == {1}
        assert store.stats()["reservations_refused"] == 1 and store.checkpoints() == []
        assert [(type(d), d.request_id) for d in spare.heartbeat().directives] == [(Hold, request_id)]
        (moved,) = serving.heartbeat().directives
        assert (type(moved), [h.worker_id for h in moved.holders]) == (Stream, [2])
        assert wait_until(lambda: worker.report().refused_request_ids == ())  # acknowledged: not sent again
    finally:
        worker.stop()
        thread.join(10)
        worker.close()
        for client in (serving, spare, submitter):
            client.close()
        gateway.stop(grace_s=0.1)
