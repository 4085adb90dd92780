"""A reference worker whose engine refuses a RUN (more tokens than its cache holds) reports the
refusal: the client's stream ends with the engine's message, and the worker serves on."""

import threading
from pathlib import Path

import pytest

from lumen_core import _native
from lumen_core.gateway.client import GatewayClient
from lumen_core.gateway.config import GatewayConfig
from lumen_core.gateway.errors import GatewayError
from lumen_core.gateway.server import GatewayServer
from lumen_core.worker.cluster import write_models
from lumen_core.worker.process import Worker, WorkerConfig

pytestmark = [
    pytest.mark.ucx,
    pytest.mark.skipif(not _native.HAS_UCX, reason="lumen_core._C_ucx is not built (LUMEN_UCX=ON)"),
    pytest.mark.timeout(120),
]

PROMPT = list(range(10, 30))


def test_a_run_the_engine_refuses_ends_at_the_client_and_the_worker_serves_on(
    tmp_path: Path, secret: bytes
) -> None:
    model_path, _ = write_models(tmp_path, seed=0)
    gateway = GatewayServer(GatewayConfig(policy="FC", heartbeat_s=0.1), secret, port=0).start()
    submitter = GatewayClient(gateway.address, secret)
    config = WorkerConfig(0, gateway.address, str(model_path), num_blocks=4, block_size=16)
    worker = Worker(config, secret)
    thread = threading.Thread(target=worker.run, daemon=True)
    try:
        worker.start()
        thread.start()
        refused = (
            r"INVALID_ARGUMENT: request \d+ lost: worker 0 refused it: `prompt_token_ids` plus max_tokens "
            r"must fit the cache's 4 blocks, got 8 blocks"
        )
        with pytest.raises(GatewayError, match=refused):
            list(submitter.submit(PROMPT, 100, timeout_s=30.0))  # 120 tokens: 8 blocks of 16
        chunks = list(submitter.submit(PROMPT, 4, timeout_s=30.0))
        assert chunks[-1].finished and sum(len(c.token_ids) for c in chunks) == 4
        assert thread.is_alive() and not worker.fenced.is_set()
    finally:
        worker.stop()
        thread.join(10)
        worker.close()
        submitter.close()
        gateway.stop(grace_s=0.1)
