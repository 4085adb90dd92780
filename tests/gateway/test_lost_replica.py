"""A live cluster (gateway + 3 worker processes on loopback): the holder of a running request's
checkpoint is SIGSTOPped past its streamer's ``give_up_after_s``; the serving worker reports the
replica lost, the gateway places it on the third worker, which then holds it."""

import os
import signal
import threading
import time
from pathlib import Path

import pytest

from lumen_core import _native
from lumen_core.testing import wait_until
from lumen_core.worker.cluster import LocalCluster, RequestResult

pytestmark = [
    pytest.mark.ucx,
    pytest.mark.skipif(not _native.HAS_UCX, reason="lumen_core._C_ucx is not built (LUMEN_UCX=ON)"),
    pytest.mark.timeout(180),
]

GIVE_UP_AFTER_S = 2.0


def test_a_replica_lost_for_good_is_reported_and_placed_on_another_holder(tmp_path: Path) -> None:
    # The lease (60 s) outlives the stop: the holder is not failed, only its replica is lost.
    # Paced steps (a 32B model on 2 H100s, stretched 3x) keep the request running ~30 s.
    with LocalCluster(
        tmp_path,
        policy="LUMEN",
        num_workers=3,
        lease_s=60.0,
        pace="qwen3-32b/h100x2",
        time_scale=3.0,
        ack_timeout_s=0.5,
        give_up_after_s=GIVE_UP_AFTER_S,
    ) as cluster:
        cluster.start()
        result = RequestResult(0, 0.0)
        threading.Thread(
            target=cluster.run_request, args=(result, list(range(10, 74)), 600, 120.0), daemon=True
        ).start()
        gateway = cluster.gateway
        monitor = gateway.coordinator.monitor

        def view():
            with gateway.condition:
                return monitor.request(result.request_id)

        assert wait_until(
            lambda: result.request_id >= 0 and any(n > 0 for _, n in view().durable_tokens), 60
        ), "durable"
        (holder,) = view().holder_ids
        serving = view().worker_id
        (spare,) = {0, 1, 2} - {holder, serving}
        stopped = cluster.workers[holder].process.pid
        os.killpg(stopped, signal.SIGSTOP)
        try:
            stopped_s = time.monotonic()
            assert wait_until(lambda: view().holder_ids == (spare,), 20), "placed on the spare holder"
            assert time.monotonic() - stopped_s >= GIVE_UP_AFTER_S  # not before the streamer gave up
            with gateway.condition:
                assert monitor.refused_by(result.request_id) == {holder}
            assert wait_until(lambda: any(h == spare and n > 0 for h, n in view().durable_tokens), 60), (
                "spare durable"
            )
            assert not result.finished and result.error == ""  # re-placed while it ran
        finally:
            os.killpg(stopped, signal.SIGCONT)
