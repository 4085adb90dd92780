"""``WorkerSide`` on a real holder, without an engine: a resumed request whose checkpoint is a
token ahead of what the client saw recomputes that token (its record may differ in the last
bits), and its checkpoint at the new epoch goes on without a conflict; an abandoned request
(its agent fenced) keeps its checkpoint when vLLM aborts it; a holder that cannot be reached
is logged, and so is a checkpoint a holder refuses; the extra config's ``hold_lines`` and
``cpus`` reach the core."""

from __future__ import annotations

import logging
import os
import socket
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from engines import HEAD_DIM, NUM_KV_HEADS, NUM_LAYERS, durable_tokens, transfer_config

from lumen_core.auth import CapabilityIssuer, Rights
from lumen_core.connector import ConnectorCore, RestoreSource, StepTokens, StreamGrant
from lumen_core.integrations.vllm.metadata import LoadSpec, LumenMetadata, OpenSpec, SaveSpec
from lumen_core.integrations.vllm.params import ConnectorConfig
from lumen_core.integrations.vllm.worker import WorkerSide
from lumen_core.layouts import KVLayout
from lumen_core.ops import gather_tokens, scatter_tokens
from lumen_core.stream import request_key
from lumen_core.transport import Client

NUM_BLOCKS, BLOCK_SIZE = 4, 16
DURABLE = 21  # what the dead engine's checkpoint holds: the client saw one token less


def _layout() -> KVLayout:
    """A random fp32 vLLM CPU cache of the test model's shape."""
    storage = torch.randn(NUM_LAYERS, NUM_BLOCKS, NUM_KV_HEADS, BLOCK_SIZE, 2 * HEAD_DIM)
    return KVLayout.vllm_cpu(list(storage.unbind(0)), isa="vec")


def _worker_side(
    secret_file: Path, issuer_key_file: Path, port: int, layout: KVLayout, **options: Any
) -> WorkerSide:
    """A worker side streaming to the holder on ``port`` by default, over ``layout``, with the
    extra config's ``options``."""
    extra = transfer_config(secret_file, issuer_key_file, port)["kv_connector_extra_config"]
    worker = WorkerSide(
        ConnectorConfig.from_extra_config({**extra, "model_fingerprint": "model-fp", **options}),
        "model-fp",
        0,
    )
    worker.register(layout)
    return worker


def _stream_a_line(worker: WorkerSide, issuer: CapabilityIssuer, address: tuple[str, int]) -> None:
    """Request "r" streams to ``address``: it opens, and one K line (16 tokens) is saved."""
    key = request_key("r")
    line = 16
    spec = OpenSpec("vllm-r", "r", key, (address,), (issuer.issue(key, 0, 0, holder_id=0),), 0, line)
    worker.start_step(LumenMetadata(opens=[spec]))
    worker.save_step(
        LumenMetadata(saves=[SaveSpec("vllm-r", 0, list(range(line)), list(range(1, line + 1)))])
    )


def _wait_until(condition: Callable[[], bool], timeout_s: float = 30.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def test_a_resumed_request_recomputing_a_durable_token_keeps_streaming(
    holder: Callable[..., Any],
    secret: bytes,
    secret_file: Path,
    issuer: CapabilityIssuer,
    issuer_key_file: Path,
) -> None:
    server = holder()
    address = ("127.0.0.1", server.port)
    key = request_key("r")
    token_ids = list(range(1, DURABLE + 4))
    slots = list(range(BLOCK_SIZE, BLOCK_SIZE + len(token_ids)))  # the same slots in both caches

    # Engine A streamed DURABLE tokens at epoch 0, then died.
    a_layout = _layout()
    dead = ConnectorCore(secret, "model-fp")
    dead.register(a_layout)
    dead.begin("r", key, StreamGrant(0, (address,), (issuer.issue(key, 0, 0, holder_id=0),)))
    dead.save_step([StepTokens("r", 0, slots[:DURABLE], token_ids[:DURABLE])])
    dead.flush()  # the tail it holds back to a whole line too: the checkpoint ends at DURABLE
    assert _wait_until(lambda: dead.durable_tokens()["r"] == DURABLE)
    dead.close()

    # Engine B resumes at epoch 1 with the DURABLE tokens as its prompt: it restores all but
    # the last, which vLLM recomputes (one bit off, as another batch's matmul may leave it).
    b_layout = _layout()
    worker = _worker_side(secret_file, issuer_key_file, server.port, b_layout)
    capability = issuer.issue(key, 0, 1, holder_id=0)
    source = RestoreSource(1, address, issuer.issue(key, 0, 1, holder_id=0, rights=Rights.READ))
    opens = [OpenSpec("vllm-r", "r", key, (address,), (capability,), 1, len(token_ids))]
    restored = DURABLE - 1
    loads = [LoadSpec("vllm-r", "r", key, slots[:restored], token_ids[:restored], source)]
    worker.start_step(LumenMetadata(loads=loads))  # the load runs while vLLM steps on
    finished: set[str] = set()
    assert _wait_until(lambda: bool(finished.update(worker.finished_loads()) or finished))
    assert finished == {"vllm-r"} and not worker.load_errors()
    assert worker.restores["r"].restored_tokens == restored
    worker.start_step(LumenMetadata(opens=opens))  # vLLM schedules it: it opens, saving from 0
    # The streamer's thread may run anything enqueued so far before the forward ends.
    assert worker.streamer is None or worker.streamer.flush(timeout_s=10.0)
    recomputed = torch.tensor(slots[DURABLE - 1 : DURABLE])
    record = gather_tokens(a_layout, recomputed)
    record[0, 0] ^= 1  # the lowest mantissa bit of its first value
    scatter_tokens(b_layout, recomputed, record)
    worker.save_step(LumenMetadata(saves=[SaveSpec("vllm-r", 0, slots[:DURABLE], token_ids[:DURABLE])]))
    for position in range(DURABLE, len(token_ids)):  # B decodes on
        worker.save_step(
            LumenMetadata(saves=[SaveSpec("vllm-r", position, [slots[position]], [token_ids[position]])])
        )
    worker.core.flush()  # no line ends past slot 31: hand the held tail over, as a finish would

    client = Client("127.0.0.1", server.port, secret, tls="tcp")
    try:
        assert _wait_until(lambda: durable_tokens(client, issuer, "r", epoch=1) == len(token_ids))
    finally:
        client.close()
        worker.close()
    assert server.ask("stats")["store"]["conflicts"] == 0


def test_an_abandoned_request_keeps_its_checkpoint_when_vllm_aborts_it(
    holder: Callable[..., Any],
    secret: bytes,
    secret_file: Path,
    issuer: CapabilityIssuer,
    issuer_key_file: Path,
) -> None:
    """A fenced agent sends control ``abandon`` and then closes its streams: the aborted
    request finishes (its blocks free) without a release, so the holder keeps its checkpoint
    for the gateway; a request opened in the abandon's step streams as usual."""
    server = holder()
    address = ("127.0.0.1", server.port)
    line = 16  # a whole line of fp32 K: saved at once, not held back
    worker = _worker_side(secret_file, issuer_key_file, server.port, _layout())

    def opened(request_id: str, first_slot: int) -> tuple[OpenSpec, SaveSpec]:
        key = request_key(request_id)
        spec = OpenSpec(f"vllm-{request_id}", request_id, key, (address,),
                        (issuer.issue(key, 0, 0, holder_id=0),), 0, line)  # fmt: skip
        return spec, SaveSpec(
            spec.req_id, 0, list(range(first_slot, first_slot + line)), list(range(1, line + 1))
        )

    fenced, fenced_save = opened("fenced", 0)
    worker.start_step(LumenMetadata(opens=[fenced]))
    worker.save_step(LumenMetadata(saves=[fenced_save]))
    client = Client("127.0.0.1", server.port, secret, tls="tcp")
    try:
        assert _wait_until(lambda: durable_tokens(client, issuer, "fenced") == line)
        later, later_save = opened("later", BLOCK_SIZE)
        worker.start_step(LumenMetadata(opens=[later], abandon=True))
        worker.save_step(LumenMetadata(saves=[fenced_save, later_save]))
        assert worker.finished({"vllm-fenced"}) == {"vllm-fenced"}  # vLLM aborted it: blocks free
        assert _wait_until(lambda: durable_tokens(client, issuer, "later") == line)
        assert durable_tokens(client, issuer, "fenced") == line  # kept: not released
        assert worker.counters["abandoned"] == 1 and worker.counters["released"] == 0
    finally:
        client.close()
        worker.close()


def _warnings_of_a_sample(worker: WorkerSide, caplog: pytest.LogCaptureFixture, phrase: str) -> list[str]:
    """The worker side samples its stats once: the warnings it logs that contain ``phrase``."""
    with caplog.at_level(logging.WARNING, logger="lumen_core.integrations.vllm.worker"):
        worker.interval_stats()
    return [r.getMessage() for r in caplog.records if phrase in r.getMessage()]


def test_a_holder_that_cannot_be_reached_is_logged(
    holder: Callable[..., Any],
    secret_file: Path,
    issuer: CapabilityIssuer,
    issuer_key_file: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Streaming to an address where nothing listens is otherwise silent (the lag grows): the
    worker side warns, naming the holder, when it samples the lag."""
    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))
        nobody = closed.getsockname()
    server = holder()
    worker = _worker_side(secret_file, issuer_key_file, server.port, _layout())
    _stream_a_line(worker, issuer, nobody)
    try:
        assert _wait_until(lambda: worker.core.streamer_counters()["holder_failures"] > 0)
        warned = _warnings_of_a_sample(worker, caplog, "holder failure")
        assert len(warned) == 1 and f"{nobody[0]}:{nobody[1]}" in warned[0]
        caplog.clear()
        assert not _warnings_of_a_sample(worker, caplog, "")  # within the sample's second: not again
    finally:
        worker.close()


def test_a_checkpoint_a_holder_refuses_is_logged(
    holder: Callable[..., Any],
    secret_file: Path,
    issuer: CapabilityIssuer,
    issuer_key_file: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A holder over its budget refuses the append: the replica is lost, which is otherwise
    seen only as a lag that never closes."""
    layout = _layout()
    server = holder(2 * layout.record_bytes)
    worker = _worker_side(secret_file, issuer_key_file, server.port, layout)
    _stream_a_line(worker, issuer, ("127.0.0.1", server.port))
    try:
        assert _wait_until(lambda: worker.core.streamer_counters()["replicas_lost"] == 1)
        assert _warnings_of_a_sample(worker, caplog, "replica(s) lost")
        assert worker.durable_tokens() == {"r": 0}
    finally:
        worker.close()


def test_the_save_path_options_reach_the_core(
    holder: Callable[..., Any],
    secret: bytes,
    secret_file: Path,
    issuer: CapabilityIssuer,
    issuer_key_file: Path,
) -> None:
    """Without held lines, tokens go to the streamer in their step (not held to the 16th slot
    of their K line), the streamer's threads start on the configured CPU, and a step hands over
    at most one staging buffer of the configured size."""
    server = holder()
    cpu = max(os.sched_getaffinity(0))
    options = {"hold_lines": False, "cpus": [cpu], "staging_bytes": 1 << 20, "staging_buffers": 2}
    worker = _worker_side(secret_file, issuer_key_file, server.port, _layout(), **options)
    key = request_key("r")
    address = ("127.0.0.1", server.port)
    spec = OpenSpec("vllm-r", "r", key, (address,), (issuer.issue(key, 0, 0, holder_id=0),), 0, 3)
    client = Client("127.0.0.1", server.port, secret, tls="tcp")
    try:
        worker.start_step(LumenMetadata(opens=[spec]))
        worker.save_step(LumenMetadata(saves=[SaveSpec("vllm-r", 0, [0, 1, 2], [1, 2, 3])]))
        assert worker.core.counters["saved_tokens"] == 3
        assert worker.core.cpus == frozenset({cpu})
        assert worker.core.streamer is not None
        assert worker.core.streamer.step_tokens == (1 << 20) // worker.core.layout.record_bytes
        assert _wait_until(lambda: durable_tokens(client, issuer, "r") == 3)
    finally:
        client.close()
        worker.close()
