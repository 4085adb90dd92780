"""Payload encryption live (issue 19): ``lumen worker --encrypt-payloads`` processes stream a
request's checkpoint in AES-256-GCM to the other worker's holder, and after the serving
worker's SIGKILL the survivor restores it (crc-checked plaintext) and finishes the request
with the tokens an undisturbed engine produces."""

import threading
import time
from pathlib import Path

import pytest

from lumen_core import _native
from lumen_core.engine import Engine, SamplingParams, load_model
from lumen_core.worker.cluster import LocalCluster, RequestResult

pytestmark = [
    pytest.mark.ucx,
    pytest.mark.skipif(not _native.HAS_UCX, reason="lumen_core._C_ucx is not built (LUMEN_UCX=ON)"),
    pytest.mark.timeout(240),
]

PROMPT = list(range(1, 17))
MAX_NEW_TOKENS = 160  # ~18 ms a paced step: about 3 s of decoding to kill it in
MIN_DURABLE = 48


def test_an_encrypted_checkpoint_is_restored_after_its_writer_dies(tmp_path: Path) -> None:
    with LocalCluster(
        tmp_path, policy="FC", num_workers=2, pace="qwen3-32b/h100x2", encrypt_payloads=True
    ) as cluster:
        cluster.start()
        result = RequestResult(0, 0.0)
        runner = threading.Thread(target=cluster.run_request, args=(result, PROMPT, MAX_NEW_TOKENS, 120.0))
        runner.start()
        coordinator = cluster.gateway.coordinator
        serving = None
        deadline = time.monotonic() + 60.0
        while serving is None and runner.is_alive() and time.monotonic() < deadline:
            with cluster.gateway.condition:
                if result.request_id >= 0 and coordinator.has_request(result.request_id):
                    view = coordinator.monitor.request(result.request_id)
                    if max((d for _, d in view.durable_tokens), default=0) >= MIN_DURABLE:
                        serving = coordinator.request_worker(result.request_id)[0]
            time.sleep(0.01)
        assert serving is not None, "the checkpoint never became durable on the holder"
        cluster.kill(serving)
        runner.join()
    assert result.error == "" and result.finished
    reference = Engine(load_model(tmp_path / "target.pt")).generate(
        [PROMPT], [SamplingParams(max_tokens=MAX_NEW_TOKENS)]
    )[0]
    assert result.token_ids == reference
    (survivor,) = cluster.worker_stats()
    assert int(survivor["restored_tokens"]) >= MIN_DURABLE, survivor
    # The dead worker's streamer connected to the survivor's holder proving its identity and
    # encrypting (the capabilities were bound to it); nothing else connected there.
    assert int(survivor["encrypted_connections"]) >= 1 and int(survivor["identified_connections"]) >= 1
