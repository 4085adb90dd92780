"""Fault tests on real processes: the serving worker SIGKILLed while appends are in flight,
alone or together with one of two holder replicas."""

from __future__ import annotations

import importlib.util
import signal
import sys
import time
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch

from lumen_core.auth import CapabilityIssuer
from lumen_core.ops import gather_tokens
from lumen_core.stream import RestoreStatus, remote_restore
from lumen_core.transport import Client, Rejected

pytestmark = [pytest.mark.ucx, pytest.mark.timeout(90)]

WORKER_PATH = Path(__file__).with_name("worker.py")
NUM_REQUESTS = 8
MIN_DURABLE = 64
MAX_TOKENS = 480


def _load_worker() -> ModuleType:
    spec = importlib.util.spec_from_file_location("lumen_stream_test_worker", WORKER_PATH)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _durable(client: Client, issuer: CapabilityIssuer, rid: int, record_bytes: int) -> int:
    """The holder's durable length of rid (0 while the worker has not opened it yet)."""
    try:
        result = client.read(rid, 0, 0, 0, 1, record_bytes, issuer.issue(rid, 0, 0, holder_id=0))
    except Rejected:
        return 0
    return result.durable_tokens


@pytest.mark.parametrize("also_kill_a_holder", [False, True])
def test_worker_killed_mid_stream_leaves_restorable_bit_exact_prefixes(
    issuer: CapabilityIssuer,
    holders: Any,
    spawn: Any,
    secret: bytes,
    secret_file: Path,
    issuer_key_file: Path,
    also_kill_a_holder: bool,
) -> None:
    """The worker streams to one holder, or to two replicas of which one dies with it."""
    w = _load_worker()
    procs = holders(2 if also_kill_a_holder else 1)
    h = procs[-1]  # the holder that survives
    worker = spawn(
        [
            sys.executable,
            str(WORKER_PATH),
            "--port",
            *(str(p.port) for p in procs),
            "--secret-file",
            str(secret_file),
            "--issuer-key-file",
            str(issuer_key_file),
            "--requests",
            str(NUM_REQUESTS),
            "--max-tokens",
            str(MAX_TOKENS),
            "--step-ms",
            "5",
        ]
    )
    rids = [w.request_id(i) for i in range(NUM_REQUESTS)]
    probe = w.make_layout(1)
    record_bytes = probe.record_bytes
    client = Client("127.0.0.1", h.port, secret, tls="tcp")
    try:
        assert worker.read()["step"] == 1  # streaming has started
        deadline = time.monotonic() + 30
        while True:
            durable = [_durable(client, issuer, r, record_bytes) for r in rids]
            if min(durable) >= MIN_DURABLE:
                break
            assert time.monotonic() < deadline, f"durable lengths stuck at {durable}"
            time.sleep(0.01)
        assert worker.proc.poll() is None, "the worker finished before it was killed"
        worker.proc.send_signal(signal.SIGKILL)
        if also_kill_a_holder:
            procs[0].proc.send_signal(signal.SIGKILL)
        worker.proc.wait(timeout=10)
        time.sleep(0.2)  # whatever was in flight is settled (committed or aborted) by now
        held = [_durable(client, issuer, r, record_bytes) for r in rids]
        assert all(MIN_DURABLE <= d < MAX_TOKENS for d in held), held

        # A fresh engine cache (other contents, other page size): restore, check, compare.
        fresh = w.make_layout(NUM_REQUESTS * 64, seed=7)
        for i, (rid, d) in enumerate(zip(rids, held, strict=True)):
            slots = torch.arange(i * 512, i * 512 + MAX_TOKENS, dtype=torch.int64)
            result = remote_restore(
                client,
                rid,
                fresh,
                slots,
                token_ids=w.tokens_for(rid, MAX_TOKENS),
                model_fingerprint=w.MODEL,
                capability=issuer.issue(rid, 0, 0, holder_id=0),
                chunk_tokens=128,
            )
            assert result.status is RestoreStatus.COMPLETE
            assert (result.restored_tokens, result.reprefill_tokens) == (d, MAX_TOKENS - d)
            restored = gather_tokens(fresh, slots[:d])
            assert torch.equal(restored, w.records_for(rid, d, record_bytes))
            # Nothing past the durable prefix was written.
            untouched = gather_tokens(fresh, slots[d:])
            assert not torch.equal(untouched, w.records_for(rid, MAX_TOKENS, record_bytes)[d:])
        stats = h.ask("stats")
        assert stats["store"]["checkpoints"] == NUM_REQUESTS
        assert stats["store"]["tokens_held"] == sum(held)
        assert stats["server"]["crc_failures"] == 0
    finally:
        client.close()
