"""GatewayConnector in one process: stream a request to a holder with the gateway's capability,
then resume it in a fresh engine from that holder (over the transport, and from the holder's
own store); the output equals an uninterrupted run."""

import time

import pytest

from lumen_core import _native
from lumen_core.engine import Engine, ModelConfig, SamplingParams, model_fingerprint, random_weights
from lumen_core.gateway.auth import issue_capability

pytestmark = [
    pytest.mark.ucx,
    pytest.mark.skipif(not _native.HAS_UCX, reason="lumen_core._C_ucx is not built (LUMEN_UCX=ON)"),
    pytest.mark.timeout(120),
]

SECRET = b"worker-connector-tests-0123456789abcdef"
PROMPT = [3, 14, 15, 92, 65, 35, 89, 79, 32, 38, 46, 26, 43, 38, 32, 79, 50, 28, 84, 19]
MAX_TOKENS = 48


@pytest.fixture(scope="module")
def model():
    return random_weights(ModelConfig(), seed=1, dtype="float64")


def _interrupted(model, holder_port: int) -> tuple[list[int], int]:
    """Run request 1 for 20 steps streaming to the holder at epoch 1; its outputs so far."""
    from lumen_core.stream import HolderStore
    from lumen_core.worker.connector import GatewayConnector, StreamGrant

    connector = GatewayConnector(SECRET, model_fingerprint(model), HolderStore())
    engine = Engine(model, connector=connector)
    connector.grant("1", StreamGrant(1, (("127.0.0.1", holder_port),), issue_capability(SECRET, 1, 0, 1)))
    engine.add_request("1", PROMPT, SamplingParams(max_tokens=MAX_TOKENS))
    outputs: list[int] = []
    for _ in range(20):
        outputs += engine.step().new_token_ids.get("1", [])
    assert connector.streamer is not None and connector.streamer.flush(timeout_s=10)
    durable = connector.streamer.stats().durable[1]
    connector.close()
    return outputs, durable


def _resume(model, connector, outputs: list[int]) -> list[int]:
    engine = Engine(model, connector=connector)
    engine.add_request("1", PROMPT, SamplingParams(max_tokens=MAX_TOKENS), output_token_ids=outputs)
    rest: list[int] = []
    deadline = time.monotonic() + 60
    while engine.has_unfinished() and time.monotonic() < deadline:
        rest += engine.step().new_token_ids.get("1", [])
    return outputs + rest


@pytest.mark.parametrize("remote", [True, False])
def test_resume_from_holder_equals_uninterrupted_run(model, remote: bool) -> None:
    from lumen_core.stream import HolderStore
    from lumen_core.worker.connector import GatewayConnector, RestoreSource

    reference = Engine(model).generate([PROMPT], SamplingParams(max_tokens=MAX_TOKENS))[0]
    holder = HolderStore()
    server = holder.serve(SECRET, address="127.0.0.1", port=0)
    try:
        outputs, durable = _interrupted(model, server.port)
        assert durable >= len(PROMPT) + len(outputs) - 2 > 0
        if remote:  # a survivor pulls the checkpoint at the request's next epoch
            connector = GatewayConnector(SECRET, model_fingerprint(model), HolderStore())
            source = RestoreSource(2, ("127.0.0.1", server.port), issue_capability(SECRET, 1, 0, 2))
        else:  # the holder itself resumes the request from its own store
            connector = GatewayConnector(SECRET, model_fingerprint(model), holder)
            source = RestoreSource(2, None, b"")
        connector.restore_from("1", source)
        assert _resume(model, connector, outputs) == reference
        assert connector.restores["1"].restored_tokens >= durable - 16 > 0
        connector.close()
    finally:
        server.close()


def test_remote_restore_with_a_wrong_capability_reprefills(model) -> None:
    from lumen_core.stream import HolderStore
    from lumen_core.worker.connector import GatewayConnector, RestoreSource

    reference = Engine(model).generate([PROMPT], SamplingParams(max_tokens=MAX_TOKENS))[0]
    holder = HolderStore()
    server = holder.serve(SECRET, address="127.0.0.1", port=0)
    try:
        outputs, _ = _interrupted(model, server.port)
        connector = GatewayConnector(SECRET, model_fingerprint(model), HolderStore())
        forged = issue_capability(b"another-secret-0123456789abcdefgh", 1, 0, 2)
        connector.restore_from("1", RestoreSource(2, ("127.0.0.1", server.port), forged))
        assert _resume(model, connector, outputs) == reference
        assert "1" not in connector.restores  # nothing matched: the prefix was recomputed
        connector.close()
    finally:
        server.close()
