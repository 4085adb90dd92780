"""A gateway restart under a live reference worker: the worker registers again with what it
runs (``Worker.running``: each request's epoch, prompt and outputs), the restarted gateway
adopts it, and a client that watches the request again gets the rest of its output, each token
once and equal to an undisturbed run's. Real workers in this process, a real gateway on
loopback, restarted on the same address within the lease."""

import threading
from pathlib import Path

import pytest

from lumen_core import _native
from lumen_core.engine import Engine, SamplingParams, load_model
from lumen_core.gateway.client import GatewayClient
from lumen_core.gateway.config import GatewayConfig
from lumen_core.gateway.errors import GatewayError
from lumen_core.gateway.server import GatewayServer
from lumen_core.testing import wait_until
from lumen_core.worker.cluster import write_models
from lumen_core.worker.process import Worker, WorkerConfig

pytestmark = [
    pytest.mark.ucx,
    pytest.mark.skipif(not _native.HAS_UCX, reason="lumen_core._C_ucx is not built (LUMEN_UCX=ON)"),
    pytest.mark.timeout(180),
]

CONFIG = GatewayConfig(policy="FC", lease_s=10.0, heartbeat_s=0.1)  # the restart is well inside it
PROMPT = list(range(1, 40))
MAX_TOKENS = 1200
CUT = 20  # tokens the client has when the gateway goes away


def test_a_restarted_gateway_adopts_what_the_worker_runs_and_its_client_watches_the_rest(
    tmp_path: Path, secret: bytes
) -> None:
    model_path, _ = write_models(tmp_path, seed=0)
    gateway = GatewayServer(CONFIG, secret, host="127.0.0.1", port=0).start()
    port = int(gateway.address.rsplit(":", 1)[1])
    worker = Worker(WorkerConfig(0, gateway.address, str(model_path), budget_bytes=1 << 30), secret)
    statuses: list[int] = []
    thread = threading.Thread(target=lambda: statuses.append(worker.run()), daemon=True)
    worker.start()
    thread.start()
    successor = None
    try:
        with GatewayClient(gateway.address, secret) as client:
            stream = client.submit(PROMPT, MAX_TOKENS, timeout_s=60.0)
            request_id = next(stream).request_id
            got: list[int] = []
            while len(got) < CUT:
                got += next(stream).token_ids
            gateway.stop(grace_s=0.1)  # the stream ends with the gateway
            with pytest.raises(GatewayError, match="gateway is stopping|UNAVAILABLE"):
                for chunk in stream:
                    got += chunk.token_ids
        successor = GatewayServer(CONFIG, secret, host="127.0.0.1", port=port).start()

        def adopted() -> bool:
            with successor.condition:
                return successor.coordinator.has_request(request_id)

        # The gateway adopts the request before the worker has read the register reply.
        assert wait_until(lambda: adopted() and worker.client.epoch == 2, timeout_s=20.0)
        assert statuses == [] and not worker.fenced.is_set()  # it served on across the restart
        rest: list[int] = []
        with GatewayClient(successor.address, secret) as client:
            try:
                for chunk in client.watch(request_id, len(got), timeout_s=60.0):
                    rest += chunk.token_ids
            except GatewayError as exc:  # say where the request stood
                with successor.condition:
                    state = successor.coordinator.tokens(request_id)
                    worker_state = successor.coordinator.worker_state(0)
                pytest.fail(
                    f"{exc}: the gateway has {len(state[0])} tokens (finished {state[1]}, lost {state[2]}), "
                    f"worker 0 {worker_state}, fenced {worker.fenced.is_set()}, serving {dict(worker.served)}"
                )
    finally:
        worker.stop()
        thread.join(10)
        worker.close()
        gateway.stop(grace_s=0.1)
        if successor is not None:
            successor.stop(grace_s=0.1)
    (expected,) = Engine(load_model(model_path)).generate([PROMPT], [SamplingParams(max_tokens=MAX_TOKENS)])
    assert got + rest == list(expected)  # none repeated, none missing, none changed
