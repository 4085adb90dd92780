"""A starting worker and a gateway it cannot reach yet: real worker in this process, a real
gateway on loopback started after it. It tries again (START_REGISTER_S) rather than exit: CI
saw a worker's first connect time out on a loaded machine and end its cluster test."""

import socket
import threading
from pathlib import Path

import pytest

from lumen_core import _native
from lumen_core.gateway.config import GatewayConfig
from lumen_core.gateway.errors import AuthError
from lumen_core.gateway.server import GatewayServer
from lumen_core.testing import wait_until
from lumen_core.worker.cluster import write_models
from lumen_core.worker.process import Worker, WorkerConfig

pytestmark = [
    pytest.mark.ucx,
    pytest.mark.skipif(not _native.HAS_UCX, reason="lumen_core._C_ucx is not built (LUMEN_UCX=ON)"),
    pytest.mark.timeout(120),
]

CONFIG = GatewayConfig(policy="FC", lease_s=1.0, heartbeat_s=0.1)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _starting(worker: Worker) -> tuple[threading.Thread, list[BaseException]]:
    errors: list[BaseException] = []

    def start() -> None:
        try:
            worker.start()
        except BaseException as exc:  # noqa: BLE001 - the test reads it
            errors.append(exc)

    thread = threading.Thread(target=start, daemon=True)
    thread.start()
    return thread, errors


def test_a_worker_registers_with_a_gateway_that_starts_after_it(tmp_path: Path, secret: bytes) -> None:
    port = _free_port()
    model_path, _ = write_models(tmp_path, seed=0)
    worker = Worker(WorkerConfig(0, f"127.0.0.1:{port}", str(model_path), budget_bytes=1 << 30), secret)
    thread, errors = _starting(worker)
    gateway = None
    try:
        assert not wait_until(lambda: not thread.is_alive(), 2.0)  # still trying, not exited
        gateway = GatewayServer(CONFIG, secret, host="127.0.0.1", port=port).start()
        thread.join(20.0)
        assert errors == [] and not thread.is_alive()
        with gateway.condition:
            assert 0 in gateway.coordinator.monitor.live_worker_ids()
    finally:
        worker.stop()
        worker.close()
        if gateway is not None:
            gateway.stop(grace_s=0.1)


def test_a_refused_registration_ends_the_start_at_once(tmp_path: Path, secret: bytes) -> None:
    gateway = GatewayServer(CONFIG, secret, host="127.0.0.1", port=0).start()
    model_path, _ = write_models(tmp_path, seed=0)
    worker = Worker(WorkerConfig(0, gateway.address, str(model_path), budget_bytes=1 << 30), b"x" * 32)
    thread, errors = _starting(worker)
    try:
        thread.join(10.0)  # well under START_REGISTER_S: a wrong secret is not retried
        assert not thread.is_alive() and [type(e) for e in errors] == [AuthError]
    finally:
        worker.stop()
        worker.close()
        gateway.stop(grace_s=0.1)
