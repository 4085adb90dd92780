"""HolderStore as the transport sink: ordered appends, overlaps, gaps, budget, eviction,
expiry, and the verified restore (local and remote). Real UCX on loopback, in process."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable, Iterator

import numpy as np
import pytest
import torch

from lumen_core import _native
from lumen_core.auth import CapabilityIssuer
from lumen_core.layouts import KVLayout
from lumen_core.ops import checksum, gather_tokens
from lumen_core.stream import (
    Eviction,
    EvictionPolicy,
    HolderStore,
    RestoreStatus,
    fingerprint_bytes,
    remote_restore,
    restorable_tokens,
)
from lumen_core.testing import assert_kv_equal, make_paged_cache, slots_for_blocks
from lumen_core.transport import Client, Conflict, Rejected, Server, StaleEpoch

MODEL = "test-model"
TLS = "tcp"


def small_cache(seed: int = 0, num_blocks: int = 64, block_size: int = 16) -> KVLayout:
    return make_paged_cache(
        "vllm_flash",
        num_layers=2,
        num_blocks=num_blocks,
        block_size=block_size,
        num_kv_heads=2,
        head_dim=16,
        dtype=torch.bfloat16,
        seed=seed,
    )


pytestmark = [pytest.mark.ucx, pytest.mark.timeout(60)]

SHARD = 0
EPOCH = 0


class Rig:
    """A HolderStore served on loopback, a client to it, and a source cache."""

    def __init__(self, secret: bytes, store: HolderStore, *, verify_records: bool = True) -> None:
        self.secret = secret
        self.store = store
        self.issuer = CapabilityIssuer.generate()
        self.caps: dict[tuple[int, int], bytes] = {}
        self.server: Server = store.serve(
            secret, issuer_public_key=self.issuer.public_key, tls=TLS, verify_records=verify_records
        )
        self.client = Client("127.0.0.1", self.server.port, secret, tls=TLS)
        self.layout = small_cache(seed=0)
        fp = fingerprint_bytes(self.layout, MODEL)
        self.layout_fp, self.model_fp = fp[:32], fp[32:]

    def cap(self, rid: int, epoch: int = EPOCH) -> bytes:
        """rid's capability at epoch, issued once: an append repeats the bytes its open verified."""
        if (rid, epoch) not in self.caps:
            self.caps[rid, epoch] = self.issuer.issue(rid, SHARD, epoch, holder_id=0)
        return self.caps[rid, epoch]

    def open(self, rid: int) -> int:
        return self.client.open(
            rid, SHARD, EPOCH, self.layout.record_bytes, self.layout_fp, self.model_fp, self.cap(rid)
        )

    def slots(self, rid: int, n: int) -> torch.Tensor:
        return slots_for_blocks([rid * 4 + b for b in range(4)], block_size=16, num_tokens=n)

    def tokens(self, rid: int, n: int) -> np.ndarray:
        return (np.arange(n, dtype=np.uint32) * 7 + rid) % 1000

    def append(self, rid: int, start: int, end: int) -> int:
        records = gather_tokens(self.layout, self.slots(rid, end)[start:])
        crcs = checksum(records).numpy()
        return self.client.append(
            rid,
            SHARD,
            EPOCH,
            start,
            self.tokens(rid, end)[start:],
            crcs,
            records.numpy(),
            self.cap(rid),
        )

    def close(self) -> None:
        self.client.close()
        self.server.close()


@pytest.fixture
def rig(secret: bytes) -> Iterator[Rig]:
    r = Rig(secret, HolderStore())
    yield r
    r.close()


def test_appends_restore_bit_exact_into_other_slots(rig: Rig) -> None:
    assert rig.open(1) == 0
    assert rig.append(1, 0, 30) == 30
    assert rig.append(1, 30, 50) == 50
    assert rig.store.durable_tokens(1) == 50
    target = small_cache(seed=9, num_blocks=128, block_size=8)
    slots = slots_for_blocks(list(range(100, 110)), block_size=8, num_tokens=60)
    result = rig.store.restore(1, target, slots, token_ids=rig.tokens(1, 60), model_fingerprint=MODEL)
    assert result.status is RestoreStatus.COMPLETE
    assert (result.restored_tokens, result.reprefill_tokens, result.durable_tokens) == (50, 10, 50)
    assert_kv_equal(rig.layout, rig.slots(1, 50), target, slots[:50])


def test_overlap_must_match_and_gap_is_refused(rig: Rig) -> None:
    rig.open(2)
    rig.append(2, 0, 10)
    assert rig.append(2, 5, 15) == 15  # an overlap with the same crcs is accepted
    other = gather_tokens(small_cache(seed=4), rig.slots(2, 15)[5:])  # other KV, valid crcs
    with pytest.raises(Conflict):
        rig.client.append(
            2,
            SHARD,
            EPOCH,
            5,
            rig.tokens(2, 15)[5:],
            checksum(other).numpy(),
            other.numpy(),
            rig.cap(2),
        )
    with pytest.raises(Rejected):
        rig.append(2, 20, 25)
    stats = rig.store.stats()
    assert stats["conflicts"] == 1 and stats["gaps_refused"] == 1
    assert rig.store.durable_tokens(2) == 15


def test_release_and_expiry_free_and_are_counted(rig: Rig) -> None:
    for rid in (3, 4, 5):
        rig.open(rid)
        rig.append(rid, 0, 8)
    rig.client.release(3, SHARD, EPOCH, rig.cap(3))
    assert rig.store.expire(4) == 1
    assert rig.store.durable_tokens(3) == 0 and rig.store.durable_tokens(4) == 0
    assert rig.store.expire_idle(3600.0) == 0
    stats = rig.store.stats()
    assert (stats["releases"], stats["expirations"], stats["checkpoints"]) == (1, 1, 1)
    assert stats["bytes_held"] == 8 * (rig.layout.record_bytes + 8)


def token_bytes(layout_record_bytes: int) -> int:
    return layout_record_bytes + 8


def test_open_reserves_the_expected_size_or_is_refused(secret: bytes) -> None:
    layout = small_cache()
    per_token = token_bytes(layout.record_bytes)
    rig = Rig(secret, HolderStore(100 * per_token, eviction=EvictionPolicy.NONE))
    fps = (rig.layout_fp, rig.model_fp)
    try:
        assert rig.client.open(1, SHARD, EPOCH, layout.record_bytes, *fps, rig.cap(1), reserve_tokens=70) == 0
        assert rig.store.stats()["bytes_charged"] == 70 * per_token
        with pytest.raises(Rejected):  # 40 more do not fit: the open is refused
            rig.client.open(2, SHARD, EPOCH, layout.record_bytes, *fps, rig.cap(2), reserve_tokens=40)
        with pytest.raises(Rejected):  # and nothing of it was kept
            rig.append(2, 0, 1)
        assert rig.client.open(3, SHARD, EPOCH, layout.record_bytes, *fps, rig.cap(3), reserve_tokens=30) == 0
        stats = rig.store.stats()
        assert (stats["reservations"], stats["reservations_refused"]) == (2, 1)
        assert stats["checkpoints"] == 2 and stats["bytes_charged"] == 100 * per_token
        reserved = {c.request_id: c.reserved_tokens for c in rig.store.checkpoints()}
        assert reserved == {1: 70, 3: 30}
        with pytest.raises(ValueError, match="`reserve_tokens` must be in"):
            rig.client.open(4, SHARD, EPOCH, layout.record_bytes, *fps, rig.cap(4), reserve_tokens=-1)
    finally:
        rig.close()


@pytest.mark.parametrize("policy", [EvictionPolicy.SHORTEST_PREFIX, EvictionPolicy.LRU])
def test_full_budget_evicts_by_policy(secret: bytes, policy: EvictionPolicy) -> None:
    layout = small_cache()
    per_token = token_bytes(layout.record_bytes)
    rig = Rig(secret, HolderStore(60 * per_token, eviction=policy))
    try:
        # 20 tokens (oldest), then 10, then 25: 55 of 60 tokens charged.
        for rid, n in ((1, 20), (2, 10), (3, 25)):
            rig.open(rid)
            rig.append(rid, 0, n)
        assert rig.store.reserve(9, 12, layout.record_bytes)  # needs 7 more tokens
        held = {c.request_id: c.durable_tokens for c in rig.store.checkpoints()}
        evicted = 2 if policy is EvictionPolicy.SHORTEST_PREFIX else 1
        assert evicted not in held and len(held) == 3
        stats = rig.store.stats()
        assert stats["evictions"] == 1
        assert stats["evicted_tokens"] == {1: 20, 2: 10}[evicted]
        with pytest.raises(Rejected):  # the evicted checkpoint is gone for its writer too
            rig.append(evicted, 0, 4)
    finally:
        rig.close()


def test_full_budget_without_eviction_refuses(secret: bytes) -> None:
    layout = small_cache()
    per_token = token_bytes(layout.record_bytes)
    rig = Rig(secret, HolderStore(30 * per_token, eviction=EvictionPolicy.NONE))
    try:
        assert rig.store.reserve(1, 20, layout.record_bytes)
        assert not rig.store.reserve(2, 20, layout.record_bytes)
        rig.open(1)
        assert rig.append(1, 0, 20) == 20  # inside its reservation
        rig.open(3)
        assert rig.append(3, 0, 10) == 10  # the last 10 tokens of budget
        with pytest.raises(Rejected):
            rig.append(3, 10, 11)
        stats = rig.store.stats()
        assert stats["reservations_refused"] == 1 and stats["appends_refused_budget"] == 1
        assert stats["evictions"] == 0 and stats["bytes_charged"] == 30 * per_token
    finally:
        rig.close()


def corrupted_rig(secret: bytes) -> Rig:
    """A rig whose request 1 holds 40 tokens, the record at position 28 corrupted after its crc
    was computed (verify_records=False: the holder keeps what arrives, so restore catches it)."""
    rig = Rig(secret, HolderStore(), verify_records=False)
    rig.open(1)
    rig.append(1, 0, 20)
    records = gather_tokens(rig.layout, rig.slots(1, 40)[20:]).clone()
    crcs = checksum(records).numpy()
    records[8, 3] ^= 0x40
    rig.client.append(1, SHARD, EPOCH, 20, rig.tokens(1, 40)[20:], crcs, records.numpy(), rig.cap(1))
    return rig


def test_corrupted_record_mismatched_fingerprint_and_token_fall_back(secret: bytes) -> None:
    rig = corrupted_rig(secret)
    try:
        target = small_cache(seed=5)
        slots = torch.arange(40, dtype=torch.int64)
        tokens = rig.tokens(1, 40)

        result = rig.store.restore(1, target, slots, token_ids=tokens, model_fingerprint=MODEL)
        assert result.status is RestoreStatus.CRC_MISMATCH
        assert (result.restored_tokens, result.reprefill_tokens) == (28, 12)
        assert_kv_equal(rig.layout, rig.slots(1, 28), target, slots[:28])

        other = rig.store.restore(1, target, slots, token_ids=tokens, model_fingerprint="other")
        assert other.status is RestoreStatus.FINGERPRINT_MISMATCH and other.restored_tokens == 0

        wrong = tokens.copy()
        wrong[11] += 1
        mismatch = rig.store.restore(1, target, slots, token_ids=wrong, model_fingerprint=MODEL)
        assert mismatch.status is RestoreStatus.TOKEN_MISMATCH
        assert mismatch.restored_tokens == 11 and mismatch.reprefill_tokens == 29

        remote = remote_restore(
            rig.client,
            1,
            target,
            slots,
            token_ids=tokens,
            model_fingerprint=MODEL,
            capability=rig.cap(1),
            chunk_tokens=8,
        )
        assert remote.status is RestoreStatus.CRC_MISMATCH and remote.restored_tokens == 28
        missing = rig.store.restore(77, target, slots, token_ids=tokens, model_fingerprint=MODEL)
        assert missing.status is RestoreStatus.MISSING and missing.reprefill_tokens == 40
        # Nothing to restore still says what the holder has, locally and remotely.
        for rid, status in ((77, RestoreStatus.MISSING), (1, RestoreStatus.COMPLETE)):
            empty = rig.store.restore(rid, target, [], token_ids=[], model_fingerprint=MODEL)
            assert (empty.status, empty.restored_tokens) == (status, 0)
        empty = remote_restore(
            rig.client, 1, target, [], token_ids=[], model_fingerprint="other", capability=rig.cap(1)
        )
        assert (empty.status, empty.restored_tokens, empty.durable_tokens) == (
            RestoreStatus.FINGERPRINT_MISMATCH,
            0,
            40,
        )
    finally:
        rig.close()


@pytest.mark.parametrize("corrupt_at", [27, 28, 29])
def test_a_local_restore_writes_nothing_past_the_verified_prefix(secret: bytes, corrupt_at: int) -> None:
    # Records are verified in groups of three: the corrupt one first, in the middle, last.
    rig = Rig(secret, HolderStore(), verify_records=False)
    try:
        rig.open(1)
        records = gather_tokens(rig.layout, rig.slots(1, 40)).clone()
        crcs = checksum(records).numpy()
        records[corrupt_at, 3] ^= 0x40
        rig.client.append(1, SHARD, EPOCH, 0, rig.tokens(1, 40), crcs, records.numpy(), rig.cap(1))
        target, untouched = small_cache(seed=5), small_cache(seed=5)
        slots = torch.arange(40, dtype=torch.int64)
        result = rig.store.restore(1, target, slots, token_ids=rig.tokens(1, 40), model_fingerprint=MODEL)
        assert (result.status, result.restored_tokens) == (RestoreStatus.CRC_MISMATCH, corrupt_at)
        assert_kv_equal(rig.layout, rig.slots(1, corrupt_at), target, slots[:corrupt_at])
        assert_kv_equal(untouched, slots[corrupt_at:], target, slots[corrupt_at:])
    finally:
        rig.close()


def _wide_cache(seed: int) -> KVLayout:
    """256 slots of 32 KiB records: 8 MiB, a restore large enough to verify on a second thread
    (kPipelineBytes in csrc/include/lumen/holder/verified_write.h), in batches of 30 records."""
    return make_paged_cache(
        "vllm_flash",
        num_layers=8,
        num_blocks=16,
        block_size=16,
        num_kv_heads=8,
        head_dim=128,
        dtype=torch.bfloat16,
        seed=seed,
    )


@pytest.mark.parametrize(
    "corrupt_at,wrong_token_at", [(None, None), (0, None), (100, None), (255, None), (None, 200), (150, 120)]
)
def test_a_pipelined_local_restore_writes_only_verified_records(
    issuer: CapabilityIssuer, secret: bytes, corrupt_at: int | None, wrong_token_at: int | None
) -> None:
    source, n = _wide_cache(0), 256
    assert n * source.record_bytes >= 8 << 20
    store = HolderStore()
    tokens = np.arange(n, dtype=np.uint32)
    slots = torch.arange(n, dtype=torch.int64)
    records = gather_tokens(source, slots).clone()
    crcs = checksum(records).numpy()
    if corrupt_at is not None:
        records[corrupt_at, 5] ^= 0x01
    cap = issuer.issue(1, SHARD, EPOCH, holder_id=0)
    fp = fingerprint_bytes(source, MODEL)
    with (
        store.serve(secret, tls=TLS, verify_records=False, issuer_public_key=issuer.public_key) as server,
        Client("127.0.0.1", server.port, secret, tls=TLS) as client,
    ):
        client.open(1, SHARD, EPOCH, source.record_bytes, fp[:32], fp[32:], cap)
        assert client.append(1, SHARD, EPOCH, 0, tokens, crcs, records.numpy(), cap) == n
    expected = tokens.copy()
    if wrong_token_at is not None:
        expected[wrong_token_at] += 1
    target, untouched = _wide_cache(5), _wide_cache(5)
    order = torch.randperm(n, generator=torch.Generator().manual_seed(0))  # other slots
    result = store.restore(1, target, order, token_ids=expected, model_fingerprint=MODEL)
    good = min((i for i in (corrupt_at, wrong_token_at) if i is not None), default=n)
    status = (
        RestoreStatus.COMPLETE
        if good == n
        else RestoreStatus.CRC_MISMATCH
        if good == corrupt_at
        else RestoreStatus.TOKEN_MISMATCH
    )
    assert (result.status, result.restored_tokens) == (status, good)
    if good > 0:
        assert_kv_equal(source, slots[:good], target, order[:good])
    if good < n:
        assert_kv_equal(untouched, order[good:], target, order[good:])


def test_remote_restore_matches_local(rig: Rig) -> None:
    rig.open(6)
    rig.append(6, 0, 45)
    target = small_cache(seed=3)
    slots = torch.arange(200, 250, dtype=torch.int64)
    result = remote_restore(
        rig.client,
        6,
        target,
        slots,
        token_ids=rig.tokens(6, 50),
        model_fingerprint=MODEL,
        capability=rig.cap(6),
        chunk_tokens=16,
    )
    assert (result.status, result.restored_tokens, result.reprefill_tokens) == (RestoreStatus.COMPLETE, 45, 5)
    assert_kv_equal(rig.layout, rig.slots(6, 45), target, slots[:45])


def test_restorable_tokens_is_the_shortest_shard() -> None:
    assert restorable_tokens([64, 40, 80]) == 40
    with pytest.raises(ValueError, match="at least one shard"):
        restorable_tokens([])
    with pytest.raises(TypeError, match="durable_per_shard must be a sequence"):
        restorable_tokens(5)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"`durable_per_shard\[i\]` must be in"):
        restorable_tokens([3, -1])


def test_records_straddling_chunks_round_trip_and_memory_is_reused(
    issuer: CapabilityIssuer, secret: bytes
) -> None:
    # 384-byte records in 4 KiB chunks: every 32 records, 11 straddle a chunk boundary.
    def layout(seed: int) -> KVLayout:
        return make_paged_cache(
            "vllm_flash",
            num_layers=2,
            num_blocks=32,
            block_size=16,
            num_kv_heads=3,
            head_dim=16,
            dtype=torch.bfloat16,
            seed=seed,
        )

    source = layout(0)
    assert source.record_bytes == 384
    store = HolderStore(chunk_bytes=4096)
    fp = fingerprint_bytes(source, MODEL)
    cap = issuer.issue(1, SHARD, EPOCH, holder_id=0)
    slots = torch.arange(3, 203, dtype=torch.int64)
    records = gather_tokens(source, slots)
    crcs = checksum(records).numpy()
    tokens = np.arange(200, dtype=np.uint32)
    with (
        store.serve(secret, issuer_public_key=issuer.public_key, tls=TLS) as server,
        Client("127.0.0.1", server.port, secret, tls=TLS) as c,
    ):
        c.open(1, SHARD, EPOCH, source.record_bytes, fp[:32], fp[32:], cap)
        for start, end in [(0, 5), (5, 120), (100, 130), (130, 200)]:  # (100, 130) overlaps
            c.append(
                1, SHARD, EPOCH, start, tokens[start:end], crcs[start:end], records[start:end].numpy(), cap
            )
        got = c.read(1, SHARD, EPOCH, 7, 150, source.record_bytes, cap)
        assert np.array_equal(got.records, records[7:157].numpy())
        assert np.array_equal(got.crcs, crcs[7:157])
        target = layout(1)
        into = torch.arange(300, 500, dtype=torch.int64)
        result = store.restore(1, target, into, token_ids=tokens, model_fingerprint=MODEL)
        assert (result.status, result.restored_tokens) == (RestoreStatus.COMPLETE, 200)
        assert_kv_equal(source, slots, target, into)
        stats = store.stats()
        assert stats["appends_in_place"] == 3  # the overlapping append was received aside
        held = stats["arena_bytes"] - stats["arena_free_bytes"]
        assert held == -(-200 * 384 // 4096) * 4096 and stats["pinned"] is False
        c.release(1, SHARD, EPOCH, cap)
        after = store.stats()
        assert after["arena_free_bytes"] == after["arena_bytes"] == stats["arena_bytes"]


def test_a_reserve_is_mapped_at_start_and_stays(secret: bytes) -> None:
    """``reserve_bytes`` are mapped (whole slabs: 9 chunks of 4 KiB under this budget) before
    any append, hold the first checkpoint without mapping more, and stay after its release."""
    source = small_cache(seed=0)
    budget = 8 * 4096
    assert HolderStore(budget, chunk_bytes=4096).stats()["arena_bytes"] == 0
    store = HolderStore(budget, chunk_bytes=4096, reserve_bytes=budget)
    slab = 9 * 4096
    assert (store.stats()["arena_bytes"], store.stats()["arena_free_bytes"]) == (slab, slab)
    n = 4 * 4096 // source.record_bytes
    slots = torch.arange(n, dtype=torch.int64)
    records = gather_tokens(source, slots)
    hold_checkpoint(secret, source, np.arange(n, dtype=np.uint32), checksum(records).numpy(), records, store)
    held = store.stats()
    assert held["tokens_held"] == n and held["arena_bytes"] == slab and held["arena_free_bytes"] < slab
    store.expire(1)
    assert (store.stats()["arena_bytes"], store.stats()["arena_free_bytes"]) == (slab, slab)
    with pytest.raises(ValueError, match=r"`reserve_bytes` must be in \[0, 32768\], got 32769"):
        HolderStore(budget, reserve_bytes=budget + 1)


def test_store_arguments_are_checked(issuer: CapabilityIssuer, rig: Rig) -> None:
    with pytest.raises(TypeError, match="eviction must be an EvictionPolicy"):
        HolderStore(eviction="lru")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="`budget_bytes` must be in"):
        HolderStore(-1)
    with pytest.raises(ValueError, match="chunk_bytes must be a multiple of 4096, got 6000"):
        HolderStore(chunk_bytes=6000)
    with pytest.raises(ValueError, match="`chunk_bytes` must be in"):
        HolderStore(chunk_bytes=512)
    with pytest.raises(TypeError, match="pinned must be a bool or None, got str"):
        HolderStore(pinned="yes")  # type: ignore[arg-type]
    if not _native.HAS_CUDA:
        with pytest.raises(ValueError, match="pinned must be False or None without a CUDA device"):
            HolderStore(pinned=True)
    with pytest.raises(ValueError, match="`record_bytes` must be in"):
        rig.store.reserve(1, 4, 0)
    with pytest.raises(ValueError, match="`num_tokens` must be in"):
        rig.store.reserve(1, 2**62, 256)
    with pytest.raises(ValueError, match="`max_idle_s` must be > 0"):
        rig.store.expire_idle(0)
    with pytest.raises(TypeError, match="store must be a HolderStore"):
        Server(rig.secret, issuer_public_key=issuer.public_key, store=object())
    target = small_cache(seed=2)
    with pytest.raises(IndexError, match="slot_ids must be in"):
        rig.store.restore(1, target, [0, 10**6], token_ids=[1, 2], model_fingerprint=MODEL)
    with pytest.raises(ValueError, match="slot_ids must not repeat"):
        rig.store.restore(1, target, [3, 3], token_ids=[1, 2], model_fingerprint=MODEL)
    with pytest.raises(TypeError, match="`layout` must be a KVLayout"):
        rig.store.restore(1, "cache", [3], token_ids=[1], model_fingerprint=MODEL)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="`model_fingerprint` must be a non-empty str"):
        rig.store.restore(1, target, [3], token_ids=[1], model_fingerprint="")
    with pytest.raises(TypeError, match="token_ids must hold ints"):
        rig.store.restore(1, target, [3], token_ids=[1.5], model_fingerprint=MODEL)


def hold_checkpoint(
    secret: bytes,
    source: KVLayout,
    tokens: np.ndarray,
    crcs: np.ndarray,
    records: torch.Tensor,
    store: HolderStore | None = None,
) -> HolderStore:
    """A store (a new one by default) holding request 1: ``records`` of ``source``'s format
    appended as they are (the holder does not check crcs on receipt, so a restore is what
    catches a bad record)."""
    store = HolderStore() if store is None else store
    fp = fingerprint_bytes(source, MODEL)
    issuer = CapabilityIssuer.generate()
    cap = issuer.issue(1, SHARD, EPOCH, holder_id=0)
    with (
        store.serve(secret, issuer_public_key=issuer.public_key, tls=TLS, verify_records=False) as server,
        Client("127.0.0.1", server.port, secret, tls=TLS) as c,
    ):
        c.open(1, SHARD, EPOCH, source.record_bytes, fp[:32], fp[32:], cap)
        c.append(1, SHARD, EPOCH, 0, tokens, crcs, records.numpy(), cap)
    return store


@pytest.mark.parametrize(
    "kind", ["vllm_flash_hnd", "vllm_flashinfer", "sglang", "mla", "vllm_flash_fp8_scales"]
)
def test_restore_is_bit_exact_for_every_layout(secret: bytes, kind: str) -> None:
    def layout(seed: int) -> KVLayout:
        return make_paged_cache(
            kind, num_layers=2, num_blocks=16, block_size=8, num_kv_heads=2, head_dim=16, seed=seed
        )

    source, target = layout(0), layout(1)
    slots = torch.arange(5, 42, dtype=torch.int64)
    records = gather_tokens(source, slots)
    tokens = np.arange(37, dtype=np.uint32)
    store = hold_checkpoint(secret, source, tokens, checksum(records).numpy(), records)
    into = torch.arange(60, 97, dtype=torch.int64).flip(0)
    result = store.restore(1, target, into, token_ids=tokens, model_fingerprint=MODEL)
    assert (result.status, result.restored_tokens) == (RestoreStatus.COMPLETE, 37)
    assert_kv_equal(source, slots, target, into)


@pytest.mark.parametrize("heads, head_dim", [(4, 128), (3, 40)])
@pytest.mark.parametrize("flip", [None, 5, -1])
def test_restore_checks_every_byte_of_wide_and_unaligned_rows(
    secret: bytes, heads: int, head_dim: int, flip: int | None
) -> None:
    """1 KiB rows (64-byte aligned: the verified scatter's wide stores) and 240-byte rows
    (mostly unaligned, with tails: its narrow ones) restore bit for bit, and a byte flipped at
    the start or the end of record 17 after its crc was taken stops the restore there."""

    def layout(seed: int) -> KVLayout:
        return make_paged_cache(
            "vllm_flash",
            num_layers=2,
            num_blocks=16,
            block_size=8,
            num_kv_heads=heads,
            head_dim=head_dim,
            seed=seed,
        )

    source, target = layout(0), layout(1)
    slots = torch.arange(3, 43, dtype=torch.int64)
    records = gather_tokens(source, slots)
    crcs = checksum(records).numpy()
    sent = records.clone()
    if flip is not None:
        sent[17, flip] ^= 0x10
    tokens = np.arange(40, dtype=np.uint32)
    store = hold_checkpoint(secret, source, tokens, crcs, sent)
    into = torch.arange(60, 100, dtype=torch.int64).flip(0)
    result = store.restore(1, target, into, token_ids=tokens, model_fingerprint=MODEL)
    restored = 40 if flip is None else 17
    status = RestoreStatus.COMPLETE if flip is None else RestoreStatus.CRC_MISMATCH
    assert (result.status, result.restored_tokens) == (status, restored)
    assert_kv_equal(source, slots[:restored], target, into[:restored])


@pytest.mark.cuda
@pytest.mark.skipif(not _native.HAS_CUDA, reason="needs a CUDA device")
def test_holder_memory_is_pinned_where_a_gpu_is_present(rig: Rig) -> None:
    rig.open(1)
    assert rig.append(1, 0, 20) == 20
    stats = rig.store.stats()
    assert stats["pinned"] is True and stats["arena_bytes"] > 0


@pytest.mark.cuda
@pytest.mark.skipif(not _native.HAS_CUDA, reason="needs a CUDA device")
@pytest.mark.parametrize("remote", [False, True])
@pytest.mark.parametrize("kind", ["vllm_flash", "vllm_paged"])
def test_restore_into_a_cuda_cache_stops_at_the_first_bad_record(
    secret: bytes, remote: bool, kind: str
) -> None:
    """A vllm_flash checkpoint restores into a CUDA cache of its own kind or of vLLM's GPU
    backends' (same records, same fingerprint), up to the corrupted record."""
    rig = corrupted_rig(secret)
    try:
        target = make_paged_cache(
            kind,
            num_layers=2,
            num_blocks=64,
            block_size=16,
            num_kv_heads=2,
            head_dim=16,
            dtype=torch.bfloat16,
            seed=5,
            device="cuda",
        )
        slots = torch.arange(40, dtype=torch.int64).flip(0)
        if remote:
            result = remote_restore(
                rig.client,
                1,
                target,
                slots,
                token_ids=rig.tokens(1, 40),
                model_fingerprint=MODEL,
                capability=rig.cap(1),
                chunk_tokens=8,
            )
        else:
            result = rig.store.restore(1, target, slots, token_ids=rig.tokens(1, 40), model_fingerprint=MODEL)
        assert (result.status, result.restored_tokens) == (RestoreStatus.CRC_MISMATCH, 28)
        restored = gather_tokens(target, slots[:28].to(target.device)).cpu()
        assert torch.equal(restored, gather_tokens(rig.layout, rig.slots(1, 28)))
    finally:
        rig.close()


@pytest.mark.cuda
@pytest.mark.skipif(not _native.HAS_CUDA, reason="needs a CUDA device")
@pytest.mark.parametrize("pinned", [True, False])
@pytest.mark.parametrize("flip", [None, 2800])
def test_restore_into_a_cuda_cache_runs_its_groups_through_the_native_pipeline(
    secret: bytes, pinned: bool, flip: int | None
) -> None:
    """3,000 records of 24 KiB: three groups of the native pipeline (32 MiB each), records
    straddling the store's 2 MiB chunks, copied straight from pinned chunks or through the
    bounce buffers of an unpinned store, restored on a side stream. The cache then holds the
    sent records bit for bit; a byte flipped in the third group stops the restore at that
    record, and no slot after it is written."""

    def cache(seed: int, device: str) -> KVLayout:
        return make_paged_cache(
            "vllm_flash",
            num_layers=8,
            num_blocks=200,
            block_size=16,
            num_kv_heads=6,
            head_dim=128,
            dtype=torch.bfloat16,
            seed=seed,
            device=device,
        )

    source, target = cache(0, "cpu"), cache(1, "cuda")
    assert target.record_bytes == 24 << 10
    records = gather_tokens(source, torch.arange(3000, dtype=torch.int64))
    crcs = checksum(records).numpy()
    sent = records.clone()
    if flip is not None:
        sent[flip, 100] ^= 0x01
    tokens = np.arange(3000, dtype=np.uint32)
    store = hold_checkpoint(secret, source, tokens, crcs, sent, HolderStore(pinned=pinned))
    into = torch.randperm(3200, generator=torch.Generator().manual_seed(3))
    before = gather_tokens(target, into.cuda()).cpu()
    with torch.cuda.stream(torch.cuda.Stream()):
        result = store.restore(1, target, into[:3000], token_ids=tokens, model_fingerprint=MODEL)
    restored = 3000 if flip is None else flip
    status = RestoreStatus.COMPLETE if flip is None else RestoreStatus.CRC_MISMATCH
    assert (result.status, result.restored_tokens) == (status, restored)
    after = gather_tokens(target, into.cuda()).cpu()
    assert torch.equal(after[:restored], records[:restored])
    assert torch.equal(after[restored:], before[restored:])


_OUT_OF_MEMORY_SCRIPT = r"""
import json, resource
import numpy as np, torch
from lumen_core.ops import checksum
from lumen_core.stream import HolderStore
from lumen_core.auth import CapabilityIssuer
from lumen_core.transport import Client, Rejected

secret, record_bytes = b"s" * 32, 64 << 10
issuer = CapabilityIssuer.generate()
store = HolderStore(budget_bytes=1 << 30)  # 32 MiB slabs of 2 MiB chunks
server = store.serve(secret, issuer_public_key=issuer.public_key, tls="tcp")
client = Client("127.0.0.1", server.port, secret, tls="tcp")
cap = issuer.issue(1, 0, 0, holder_id=0)
client.open(1, 0, 0, record_bytes, b"L" * 32, b"M" * 32, cap)
records = np.full((1024, record_bytes), 7, np.uint8)
crcs = checksum(torch.from_numpy(records)).numpy()
ids = np.arange(2048, dtype=np.uint32)

def append(start, n):
    return client.append(1, 0, 0, start, ids[start:start + n], crcs[:n], records[:n], cap)

append(0, 16)  # the first slab is mapped
before = store.stats()["bytes_charged"]
vm_bytes = int([l for l in open("/proc/self/status") if l.startswith("VmSize")][0].split()[1]) << 10
soft, hard = resource.getrlimit(resource.RLIMIT_AS)
resource.setrlimit(resource.RLIMIT_AS, (vm_bytes + (16 << 20), hard))  # no room for a slab
try:
    append(16, 1024)  # 64 MiB: needs new slabs
    refused = False
except Rejected:
    refused = True
resource.setrlimit(resource.RLIMIT_AS, (soft, hard))
after = store.stats()["bytes_charged"]
durable = append(16, 8)
print(json.dumps({"refused": refused, "before": before, "after": after, "durable": durable,
                  "charged": store.stats()["bytes_charged"]}))
client.close()
server.close()
"""


def test_an_append_refused_for_want_of_host_memory_is_not_charged() -> None:
    """The host cannot map another slab (address-space limit): the append is refused, the
    checkpoint's charge stays what it was and the next append goes on."""
    out = subprocess.run(
        [sys.executable, "-c", _OUT_OF_MEMORY_SCRIPT], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr[-2000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    token_bytes = (64 << 10) + 8
    assert got["refused"] is True
    assert got["before"] == got["after"] == 16 * token_bytes
    assert got["durable"] == 24 and got["charged"] == 24 * token_bytes


# ---- the budget as a hard invariant, reservations as promises, epochs (issue 17) ----

PER_TOKEN = token_bytes(small_cache().record_bytes)


@pytest.fixture
def make_rig(secret: bytes) -> Iterator[Callable[..., Rig]]:
    rigs: list[Rig] = []

    def _make(budget_tokens: int, policy: EvictionPolicy = EvictionPolicy.SHORTEST_PREFIX) -> Rig:
        rigs.append(Rig(secret, HolderStore(budget_tokens * PER_TOKEN, eviction=policy)))
        return rigs[-1]

    yield _make
    for rig in rigs:
        rig.close()


def open_reserving(rig: Rig, rid: int, reserve_tokens: int, epoch: int = EPOCH) -> int:
    return rig.client.open(
        rid,
        SHARD,
        epoch,
        rig.layout.record_bytes,
        rig.layout_fp,
        rig.model_fp,
        rig.cap(rid, epoch),
        reserve_tokens=reserve_tokens,
    )


@pytest.mark.parametrize("reserve_tokens", ["wraps", 2**64 - 1, 2**63])
def test_a_reservation_the_budget_arithmetic_cannot_hold_is_refused(make_rig, reserve_tokens) -> None:
    rig = make_rig(1024)
    if reserve_tokens == "wraps":  # reserve_tokens * token bytes wraps to fewer than PER_TOKEN
        reserve_tokens = -(-(2**64) // PER_TOKEN)
        assert reserve_tokens * PER_TOKEN % 2**64 < PER_TOKEN
    with pytest.raises(Rejected):
        open_reserving(rig, 1, reserve_tokens)
    stats = rig.store.stats()
    assert (stats["reservations_refused"], stats["checkpoints"], stats["bytes_charged"]) == (1, 0, 0)
    with pytest.raises(Rejected):  # nothing was kept: no checkpoint to append to
        rig.append(1, 0, 1)


def test_a_writer_cannot_append_past_the_budget_whatever_it_reserved(make_rig) -> None:
    rig = make_rig(40, EvictionPolicy.NONE)
    with pytest.raises(Rejected):
        open_reserving(rig, 1, -(-(2**64) // PER_TOKEN))
    assert open_reserving(rig, 1, 30) == 0
    assert rig.append(1, 0, 40) == 40
    with pytest.raises(Rejected):
        rig.append(1, 40, 41)
    stats = rig.store.stats()
    assert stats["bytes_charged"] == 40 * PER_TOKEN <= stats["budget_bytes"]


def test_unreserved_growth_never_evicts_a_reservation(make_rig) -> None:
    # 8 checkpoints reserve 10 tokens each and hold 5; request 9 (no reservation) grows into
    # the last 20 tokens of budget and then asks for more: it is refused, nobody is evicted.
    rig = make_rig(100)
    for rid in range(1, 9):
        open_reserving(rig, rid, 10)
        rig.append(rid, 0, 5)
    rig.open(9)
    assert rig.append(9, 0, 20) == 20
    with pytest.raises(Rejected):
        rig.append(9, 20, 40)
    held = {c.request_id: c.durable_tokens for c in rig.store.checkpoints()}
    assert held == {**{rid: 5 for rid in range(1, 9)}, 9: 20}
    stats = rig.store.stats()
    assert (stats["evictions"], stats["appends_refused_budget"]) == (0, 1)
    assert rig.store.take_evictions() == []
    for rid in range(1, 9):  # each reservation is still there for its writer
        assert rig.append(rid, 5, 10) == 10


def test_eviction_takes_unreserved_checkpoints_first_and_says_what_it_took(make_rig) -> None:
    # Shortest prefix first would pick request 1 (4 tokens), but it is reserved: the
    # unreserved request 2 (6 tokens) goes instead.
    rig = make_rig(30)
    open_reserving(rig, 1, 4, epoch=EPOCH)
    rig.append(1, 0, 4)
    rig.open(2)
    rig.append(2, 0, 6)
    rig.open(3)
    assert rig.append(3, 0, 20) == 20
    assert rig.append(3, 20, 24) == 24  # 30 tokens of budget: 4 more evict request 2
    assert {c.request_id for c in rig.store.checkpoints()} == {1, 3}
    evictions = rig.store.take_evictions()
    assert evictions == [
        Eviction(
            request_id=2, shard=SHARD, epoch=EPOCH, durable_tokens=6, reserved_tokens=0, bytes=6 * PER_TOKEN
        )
    ]
    assert rig.store.take_evictions() == []  # taken once
    stats = rig.store.stats()
    assert (stats["evictions"], stats["evicted_tokens"], stats["evicted_bytes"]) == (1, 6, 6 * PER_TOKEN)
    assert stats["evictions_reserved"] == 0


def test_a_reservation_displaces_another_only_when_no_unreserved_bytes_are_left(make_rig) -> None:
    rig = make_rig(30)
    for rid in (1, 2):
        open_reserving(rig, rid, 10)
        rig.append(rid, 0, 10 - rid)  # 9 and 8 tokens
    rig.open(3)
    rig.append(3, 0, 10)
    # Placement wants 15: the unreserved request 3 goes first, then the shortest reserved one.
    assert rig.store.reserve(4, 15, rig.layout.record_bytes)
    taken = [(e.request_id, e.reserved_tokens) for e in rig.store.take_evictions()]
    assert taken == [(3, 0), (2, 10)]
    assert rig.store.stats()["evictions_reserved"] == 1
    assert not rig.store.reserve(5, 21, rig.layout.record_bytes)  # more than can be freed: nothing goes
    assert rig.store.take_evictions() == []


def test_a_checkpoint_dropped_at_an_epoch_is_re_created_only_at_a_newer_one(make_rig) -> None:
    rig = make_rig(100)
    rig.open(1)
    rig.append(1, 0, 5)
    rig.client.release(1, SHARD, EPOCH, rig.cap(1))
    with pytest.raises(StaleEpoch):  # the writer of the released incarnation
        rig.open(1)
    assert open_reserving(rig, 1, 0, epoch=EPOCH + 1) == 0
    assert [(c.request_id, c.epoch) for c in rig.store.checkpoints()] == [(1, EPOCH + 1)]


def test_a_refused_open_changes_nothing(make_rig) -> None:
    rig = make_rig(20, EvictionPolicy.NONE)
    rig.open(1)
    rig.append(1, 0, 5)
    with pytest.raises(Rejected):  # a newer incarnation whose reservation does not fit
        open_reserving(rig, 1, 50, epoch=EPOCH + 1)
    assert [(c.epoch, c.reserved_tokens) for c in rig.store.checkpoints()] == [(EPOCH, 0)]
    assert rig.append(1, 5, 10) == 10  # the old writer is not fenced
    assert open_reserving(rig, 1, 15, epoch=EPOCH + 1) == 10  # one that fits fences it
    with pytest.raises(StaleEpoch):
        rig.append(1, 10, 12)


def test_spare_receive_buffers_count_against_the_budget_and_give_way_first(make_rig) -> None:
    # Request 1's overlapping append is received aside; its buffer (20 records and their ids)
    # is kept for reuse once it commits. Kept buffers are mapped memory: with the charge they
    # stay within the budget, and a checkpoint that needs the room gets it, nobody evicted.
    rig = make_rig(60, EvictionPolicy.NONE)
    rig.open(1)
    rig.append(1, 0, 20)
    assert rig.append(1, 10, 30) == 30  # (10, 30) overlaps the durable prefix: aside
    stats = rig.store.stats()
    assert stats["spare_bytes"] >= 20 * PER_TOKEN
    assert stats["bytes_charged"] + stats["spare_bytes"] <= stats["budget_bytes"]
    rig.open(2)
    assert rig.append(2, 0, 30) == 30  # the last 30 tokens of budget
    stats = rig.store.stats()
    assert stats["bytes_charged"] == 60 * PER_TOKEN and stats["spare_bytes"] == 0
    assert (stats["evictions"], stats["appends_refused_budget"]) == (0, 0)
