"""The reference engine (float64) streaming through StreamingConnector to a `lumen holder`
process, then a fresh engine restoring from it (over the transport, or from a local
HolderStore) and continuing with exactly the tokens of an uninterrupted run; the same driven
by a gateway's per-request grants and restore sources (request epochs, its capabilities)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from lumen_core.auth import CapabilityIssuer, Rights, read_issuer_key_file
from lumen_core.connector import RestoreSource, StreamGrant
from lumen_core.engine import (
    CacheConfig,
    Engine,
    Llama,
    ModelConfig,
    SamplingParams,
    model_fingerprint,
    random_weights,
)
from lumen_core.integrations.reference import StreamingConnector
from lumen_core.stream import HolderStore, RestoreStatus

pytestmark = [pytest.mark.ucx, pytest.mark.timeout(90)]

PROMPTS = [[(7 * i + 3 + j) % 256 for i in range(29 + 3 * j)] for j in range(3)]


@pytest.fixture(scope="module")
def model() -> Iterator[Llama]:
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield random_weights(ModelConfig(), seed=0, dtype="float64")
    torch.set_num_threads(previous)


def run_until(engine: Engine, outputs: dict[str, list[int]], count: int) -> None:
    while min(len(v) for v in outputs.values()) < count:
        for rid, new in engine.step().new_token_ids.items():
            outputs[rid].extend(new)


def finish(engine: Engine, outputs: dict[str, list[int]]) -> None:
    while engine.has_unfinished():
        for rid, new in engine.step().new_token_ids.items():
            outputs[rid].extend(new)


@pytest.mark.parametrize("source", ["remote", "local"])
def test_engine_restores_streamed_checkpoints_and_continues_identically(
    issuer: CapabilityIssuer, model: Llama, holder: Any, secret: bytes, source: str
) -> None:
    params = SamplingParams(temperature=0.7, seed=5, max_tokens=24)
    expected = Engine(model).generate(PROMPTS, params)
    fingerprint = model_fingerprint(model)

    store = HolderStore()
    server = (
        store.serve(secret, issuer_public_key=issuer.public_key, tls="tcp") if source == "local" else None
    )
    port = server.port if server is not None else holder().port
    saver = StreamingConnector(
        secret,
        fingerprint,
        holders=[("127.0.0.1", port)],
        capability_for=lambda key, holder: issuer.issue(key, 0, 0, holder_id=0),
        tls="tcp",
        streamer_options={"max_queued_steps": 256},
    )
    worker = Engine(model, CacheConfig(64, 4), connector=saver)
    before: dict[str, list[int]] = {f"r{j}": [] for j in range(len(PROMPTS))}
    for j, prompt in enumerate(PROMPTS):
        worker.add_request(f"r{j}", prompt, params)
    run_until(worker, before, 10)
    assert saver.streamer is not None and saver.streamer.flush(timeout_s=10)
    assert saver.streamer.stats().coverage == 1.0
    saver.close()
    del worker  # the worker dies with its KV cache

    try:
        restorer = StreamingConnector(
            secret,
            fingerprint,
            restore_from=store if source == "local" else ("127.0.0.1", port),
            capability_for=lambda key, holder: issuer.issue(key, 0, 0, holder_id=0, rights=Rights.READ),
            tls="tcp",
        )
        survivor = Engine(model, CacheConfig(128, 8), connector=restorer)
        after: dict[str, list[int]] = {rid: [] for rid in before}
        for j, prompt in enumerate(PROMPTS):
            survivor.add_request(f"r{j}", prompt, params, output_token_ids=before[f"r{j}"])
        first = survivor.step()
        for rid, new in first.new_token_ids.items():
            after[rid].extend(new)
        # Every checkpointed token was restored: only each request's last sampled token ran.
        assert first.num_batched_tokens == len(PROMPTS)
        for j, rid in enumerate(before):
            result = restorer.restores[rid]
            assert result.status is RestoreStatus.COMPLETE
            assert result.restored_tokens == len(PROMPTS[j]) + len(before[rid]) - 1
        finish(survivor, after)
        for j, rid in enumerate(before):
            assert before[rid] + after[rid] == expected[j]
        restorer.close()
    finally:
        if server is not None:
            server.close()


def test_mismatched_model_falls_back_to_reprefill(
    issuer: CapabilityIssuer, model: Llama, secret: bytes
) -> None:
    params = SamplingParams(max_tokens=16)
    expected = Engine(model).generate(PROMPTS[:1], params)[0]
    store = HolderStore()
    server = store.serve(secret, issuer_public_key=issuer.public_key, tls="tcp")
    try:
        saver = StreamingConnector(
            secret,
            model_fingerprint(model),
            holders=[("127.0.0.1", server.port)],
            capability_for=lambda key, holder: issuer.issue(key, 0, 0, holder_id=0),
            tls="tcp",
            streamer_options={"max_queued_steps": 256},
        )
        worker = Engine(model, CacheConfig(64, 4), connector=saver)
        worker.add_request("r0", PROMPTS[0], params)
        before: dict[str, list[int]] = {"r0": []}
        run_until(worker, before, 6)
        assert saver.streamer is not None and saver.streamer.flush(timeout_s=10)
        saver.close()

        restorer = StreamingConnector(secret, "another-model", restore_from=store)
        survivor = Engine(model, CacheConfig(64, 4), connector=restorer)
        survivor.add_request("r0", PROMPTS[0], params, output_token_ids=before["r0"])
        first = survivor.step()
        assert restorer.restores["r0"].status is RestoreStatus.FINGERPRINT_MISMATCH
        assert first.num_batched_tokens == len(PROMPTS[0]) + len(before["r0"])  # re-prefill
        after: dict[str, list[int]] = {"r0": list(first.new_token_ids.get("r0", []))}
        finish(survivor, after)
        assert before["r0"] + after["r0"] == expected
    finally:
        server.close()


GATEWAY_PROMPT = [3, 14, 15, 92, 65, 35, 89, 79, 32, 38, 46, 26, 43, 38, 32, 79, 50, 28, 84, 19]
GATEWAY_MAX_TOKENS = 48


def _gateway_connector(secret: bytes, model: Llama, **options: Any) -> StreamingConnector:
    """As `lumen worker` builds it: the gateway's decimal u64 request ids are the wire keys."""
    return StreamingConnector(secret, model_fingerprint(model), key_for=int, tls="tcp", **options)


def _interrupted(
    model: Llama, secret: bytes, issuer: CapabilityIssuer, holder_port: int
) -> tuple[list[int], int]:
    """Request 1 runs 20 steps streaming to the holder at epoch 1 as granted; request 2 has
    an empty grant (not checkpointed). Request 1's outputs so far and its durable length."""
    connector = _gateway_connector(secret, model)
    engine = Engine(model, connector=connector)
    connector.grant("1", StreamGrant(1, (("127.0.0.1", holder_port),), (issuer.issue(1, 0, 1, holder_id=0),)))
    connector.grant("2", StreamGrant(1, (), ()))
    params = SamplingParams(max_tokens=GATEWAY_MAX_TOKENS)
    engine.add_request("1", GATEWAY_PROMPT, params)
    engine.add_request("2", GATEWAY_PROMPT[:7], params)
    outputs: list[int] = []
    for _ in range(20):
        outputs += engine.step().new_token_ids.get("1", [])
    assert connector.streamer is not None and connector.streamer.flush(timeout_s=10)
    durable = connector.durable_tokens()
    assert list(durable) == ["1"]  # request 2 streamed nowhere
    connector.close()
    return outputs, durable["1"]


def _resume(model: Llama, connector: StreamingConnector, outputs: list[int]) -> tuple[list[int], Engine]:
    engine = Engine(model, connector=connector)
    engine.add_request(
        "1", GATEWAY_PROMPT, SamplingParams(max_tokens=GATEWAY_MAX_TOKENS), output_token_ids=outputs
    )
    rest = list(engine.step().new_token_ids.get("1", []))
    return outputs + rest, engine


@pytest.mark.parametrize("remote", [True, False])
def test_granted_request_resumes_at_its_next_epoch_and_is_streamed_again(
    issuer: CapabilityIssuer, model: Llama, secret: bytes, remote: bool
) -> None:
    reference = Engine(model).generate([GATEWAY_PROMPT], SamplingParams(max_tokens=GATEWAY_MAX_TOKENS))[0]
    holder = HolderStore()
    server = holder.serve(secret, issuer_public_key=issuer.public_key, tls="tcp")
    next_holder = HolderStore()
    next_server = next_holder.serve(secret, issuer_public_key=issuer.public_key, tls="tcp")
    try:
        outputs, durable = _interrupted(model, secret, issuer, server.port)
        assert durable >= len(GATEWAY_PROMPT) + len(outputs) - 2 > 0
        if remote:  # a survivor pulls the checkpoint at the request's next epoch
            connector = _gateway_connector(secret, model)
            source = RestoreSource(2, ("127.0.0.1", server.port), issuer.issue(1, 0, 2, holder_id=0))
        else:  # the holder itself resumes the request from its own store
            connector = _gateway_connector(secret, model, store=holder)
            source = RestoreSource(2, None, b"")
        connector.set_restore_source("1", source)
        connector.grant(
            "1", StreamGrant(2, (("127.0.0.1", next_server.port),), (issuer.issue(1, 0, 2, holder_id=0),))
        )
        tokens, engine = _resume(model, connector, outputs)
        restored = connector.restores["1"].restored_tokens
        assert connector.restores["1"].status is RestoreStatus.COMPLETE and restored >= durable - 16 > 0
        # The restored prefix went to the new holder at epoch 2 before the request went on.
        assert connector.streamer is not None and connector.streamer.flush(timeout_s=10)
        [checkpoint] = next_holder.checkpoints()
        assert (checkpoint.request_id, checkpoint.epoch) == (1, 2)
        assert checkpoint.durable_tokens == len(GATEWAY_PROMPT) + len(tokens) - 1
        assert connector.durable_tokens() == {"1": checkpoint.durable_tokens}
        while engine.has_unfinished():
            tokens += engine.step().new_token_ids.get("1", [])
        assert tokens == reference
        connector.close()
    finally:
        server.close()
        next_server.close()


@pytest.mark.parametrize("source", ["forged capability", "unreachable holder"])
def test_a_source_that_cannot_serve_the_checkpoint_means_reprefill(
    issuer: CapabilityIssuer, model: Llama, secret: bytes, source: str
) -> None:
    reference = Engine(model).generate([GATEWAY_PROMPT], SamplingParams(max_tokens=GATEWAY_MAX_TOKENS))[0]
    holder = HolderStore()
    server = holder.serve(secret, issuer_public_key=issuer.public_key, tls="tcp")
    try:
        outputs, _ = _interrupted(model, secret, issuer, server.port)
        connector = _gateway_connector(secret, model, connect_timeout_s=0.5)
        if source == "forged capability":
            address = ("127.0.0.1", server.port)
            capability = CapabilityIssuer.generate().issue(1, 0, 2, holder_id=0)  # not the holder's issuer
        else:
            closed = HolderStore().serve(secret, issuer_public_key=issuer.public_key, tls="tcp")
            address = ("127.0.0.1", closed.port)
            closed.close()
            capability = issuer.issue(1, 0, 2, holder_id=0)
        connector.set_restore_source("1", RestoreSource(2, address, capability))
        tokens, engine = _resume(model, connector, outputs)
        while engine.has_unfinished():
            tokens += engine.step().new_token_ids.get("1", [])
        assert tokens == reference
        assert "1" not in connector.restores  # nothing matched: the prefix was recomputed
        assert connector.streamer is None  # no grant, no default holders: nothing streamed
        connector.close()
    finally:
        server.close()


def test_connector_arguments_are_checked(issuer: CapabilityIssuer, secret: bytes) -> None:
    with pytest.raises(TypeError, match="`secret` must be bytes, got str"):
        StreamingConnector("s", "m")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="`secret` must be at least 16 bytes, got 3"):
        StreamingConnector(b"abc", "m")
    with pytest.raises(TypeError, match="`model_fingerprint` must be a non-empty str"):
        StreamingConnector(secret, "")
    with pytest.raises(
        TypeError, match=r"`restore_from` must be a HolderStore or an \(address, port\) tuple"
    ):
        StreamingConnector(secret, "m", restore_from=object())  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="`restore_from` must be `store` when both are HolderStores"):
        StreamingConnector(secret, "m", restore_from=HolderStore(), store=HolderStore())
    with pytest.raises(TypeError, match="`store` must be a HolderStore, got dict"):
        StreamingConnector(secret, "m", store={})  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="`key_for` must be callable, got int"):
        StreamingConnector(secret, "m", key_for=5)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="`tls` must be a str, got int"):
        StreamingConnector(secret, "m", tls=1)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="`connect_timeout_s` must be > 0, got 0"):
        StreamingConnector(secret, "m", connect_timeout_s=0)
    with pytest.raises(TypeError, match=r"holders\[i\] must be an \(address, port\) tuple"):
        StreamingConnector(secret, "m", holders=["127.0.0.1:1"])  # type: ignore[list-item]
    capability = issuer.issue(1, 0, 1, holder_id=0)
    with pytest.raises(ValueError, match=r"`epoch` must be in \[0, 4294967295\], got -1"):
        StreamGrant(-1, (), ())
    with pytest.raises(TypeError, match="`holders` must be a tuple of"):
        StreamGrant(1, [("127.0.0.1", 1)], (capability,))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"`holders\[i\].port` must be in"):
        StreamGrant(1, (("127.0.0.1", 0),), (capability,))
    with pytest.raises(ValueError, match=r"`capabilities\[0\]` must be non-empty bytes"):
        StreamGrant(1, (("127.0.0.1", 1),), (b"",))
    with pytest.raises(
        ValueError, match=r"`capabilities` must be a tuple of one capability per holder \(1\)"
    ):
        StreamGrant(1, (("127.0.0.1", 1),), (capability, capability))
    with pytest.raises(ValueError, match="`capability_for` must be given with `holders`"):
        StreamingConnector(secret, "m", holders=[("127.0.0.1", 1)])
    with pytest.raises(ValueError, match="`capability_for` must be given with `holders`"):
        StreamingConnector(secret, "m", restore_from=("127.0.0.1", 1))
    with pytest.raises(TypeError, match="`capability_for` must be callable, got int"):
        StreamingConnector(secret, "m", holders=[("127.0.0.1", 1)], capability_for=5)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="`capability` must be bytes, got str"):
        RestoreSource(1, ("127.0.0.1", 1), "cap")  # type: ignore[arg-type]
    connector = StreamingConnector(secret, "m")
    with pytest.raises(TypeError, match="`grant` must be a StreamGrant, got tuple"):
        connector.grant("1", (1, (), b""))  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="`request_id` must be a non-empty str"):
        connector.grant("", StreamGrant(1, (), ()))
    with pytest.raises(TypeError, match="`source` must be a RestoreSource, got NoneType"):
        connector.set_restore_source("1", None)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="`source` must name an address: this connector has no store"):
        connector.set_restore_source("1", RestoreSource(2, None, b""))


def test_a_renewed_grant_keeps_a_request_streaming_past_its_first_capabilities_expiry(
    issuer_key_file: Any, model: Llama, secret: bytes
) -> None:
    short = CapabilityIssuer(read_issuer_key_file(issuer_key_file), ttl_s=2.0)  # the holders' issuer
    stores = [HolderStore(), HolderStore()]
    servers = [
        s.serve(secret, issuer_public_key=short.public_key, tls="tcp", holder_id=i)
        for i, s in enumerate(stores)
    ]
    holders = tuple(("127.0.0.1", server.port) for server in servers)
    try:
        connector = _gateway_connector(secret, model)
        engine = Engine(model, connector=connector)

        def grant(epoch: int, order: tuple[int, ...], later_s: float = 0.0) -> StreamGrant:
            now_s = time.time() + later_s
            return StreamGrant(
                epoch,
                tuple(holders[i] for i in order),
                tuple(short.issue(1, 0, 1, holder_id=i, now_s=now_s) for i in order),
            )

        assert not connector.renew("1", grant(1, (0, 1)))  # nothing granted yet
        connector.grant("1", grant(1, (0, 1)))
        engine.add_request("1", GATEWAY_PROMPT, SamplingParams(max_tokens=GATEWAY_MAX_TOKENS))
        outputs: list[int] = []
        for _ in range(5):
            outputs += engine.step().new_token_ids.get("1", [])
        assert not connector.renew("1", grant(2, (0, 1), later_s=3.0))  # another epoch: stale
        assert not connector.renew("1", grant(1, (0,), later_s=3.0))  # other holders: stale
        assert connector.renew("1", grant(1, (1, 0), later_s=3.0))  # any order: matched by holder
        time.sleep(2.2)  # the first capabilities have expired, the renewed ones have not
        for _ in range(5):
            outputs += engine.step().new_token_ids.get("1", [])
        assert connector.streamer is not None and connector.streamer.flush(timeout_s=10)
        stats = connector.streamer.stats()
        assert stats.lost == () and stats.counters["replicas_lost"] == 0
        for store in stores:
            [checkpoint] = store.checkpoints()
            assert (checkpoint.request_id, checkpoint.epoch) == (1, 1)
            assert checkpoint.durable_tokens == len(GATEWAY_PROMPT) + len(outputs) - 1
        connector.close()
    finally:
        for server in servers:
            server.close()
