"""The holder's store and the restore path (docs/streaming.md).

``HolderStore`` keeps each (request, shard)'s token records in host memory (fixed-size chunks,
pinned where a GPU is present) under a byte budget; ``serve`` puts it behind a transport
``Server`` so streamers append into it.
``restore`` writes a checkpoint's verified durable prefix into an engine's cache;
``remote_restore`` pulls it from another holder over the transport first.
"""

from __future__ import annotations

import enum
import mmap
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from lumen_core import _native
from lumen_core._validate import U32_MAX, U64_MAX, check_instance, check_int, check_number
from lumen_core.layouts import KVLayout
from lumen_core.ops import checksum, scatter_tokens
from lumen_core.stream._common import as_array, check_str, fingerprint_bytes
from lumen_core.transport import Client, Rejected, Server, WireLimits
from lumen_core.transport.wire import read_reply_bytes

__all__ = [
    "CheckpointInfo",
    "Eviction",
    "EvictionPolicy",
    "HolderStore",
    "RestoreResult",
    "RestoreStatus",
    "remote_restore",
    "restorable_tokens",
]


class EvictionPolicy(enum.Enum):
    """Which checkpoint a full holder evicts: the shortest prefix (cheapest to re-prefill),
    the least recently used, or none (refuse instead)."""

    SHORTEST_PREFIX = 0
    LRU = 1
    NONE = 2


class RestoreStatus(enum.Enum):
    """Why a restore stopped where it did (anything but COMPLETE falls back to re-prefill of
    the tokens after ``restored_tokens``)."""

    COMPLETE = 0
    MISSING = 1
    FINGERPRINT_MISMATCH = 2
    TOKEN_MISMATCH = 3
    CRC_MISMATCH = 4


@dataclass(frozen=True)
class RestoreResult:
    """``restored_tokens`` leading tokens were written into the slots; the caller re-prefills
    the other ``reprefill_tokens``. ``durable_tokens`` is what the holder had."""

    status: RestoreStatus
    restored_tokens: int
    reprefill_tokens: int
    durable_tokens: int


@dataclass(frozen=True)
class CheckpointInfo:
    request_id: int
    shard: int
    epoch: int
    record_bytes: int
    opened: bool
    durable_tokens: int
    reserved_tokens: int


@dataclass(frozen=True)
class Eviction:
    """A checkpoint the store evicted to make room: what it held and had reserved, and the
    charged ``bytes`` its eviction freed."""

    request_id: int
    shard: int
    epoch: int
    durable_tokens: int
    reserved_tokens: int
    bytes: int


def restorable_tokens(durable_per_shard: Sequence[int]) -> int:
    """With tensor parallelism every shard must be restored to the same length: the minimum
    of the shards' durable lengths (0 when a shard is missing)."""
    if isinstance(durable_per_shard, (str, bytes)) or not isinstance(durable_per_shard, Sequence):
        raise TypeError(
            f"durable_per_shard must be a sequence of ints, got {type(durable_per_shard).__name__}"
        )
    if not durable_per_shard:
        raise ValueError("durable_per_shard must name at least one shard, got 0")
    return min(check_int("durable_per_shard[i]", d, 0, U64_MAX) for d in durable_per_shard)


def _check_restore_args(
    layout: object, slot_ids: object, token_ids: object, max_tokens: int | None
) -> tuple[KVLayout, np.ndarray, np.ndarray, int]:
    layout = check_instance("layout", layout, KVLayout)
    slots = as_array("slot_ids", slot_ids, np.int64)
    tokens = as_array("token_ids", token_ids, np.uint32)
    if slots.size and (slots.min() < 0 or slots.max() >= layout.num_slots):
        raise IndexError(f"slot_ids must be in [0, {layout.num_slots}), got values outside")
    if len(np.unique(slots)) != len(slots):
        raise ValueError("slot_ids must not repeat")
    limit = len(tokens) if max_tokens is None else check_int("max_tokens", max_tokens, 0, U64_MAX)
    return layout, slots, tokens, min(limit, len(slots), len(tokens))


class HolderStore:
    """Budgeted host-memory store of checkpoints (native; see module doc).

    ``budget_bytes`` bounds what checkpoints are charged: per checkpoint, the larger of its
    reservation and what it holds, at ``record_bytes + 8`` bytes a token (record, token id,
    crc). ``stats()`` counts every reservation refused, append refused for lack of budget,
    gap, conflict, eviction, expiry and release, and the host memory mapped for records.

    A reservation is a promise: making room evicts checkpoints without a reservation first
    (by ``eviction``), and one that holds a reservation only for another reservation, never
    for a checkpoint growing past its own. ``take_evictions()`` says what was evicted.
    A checkpoint released, evicted or expired at an epoch is re-opened only at a newer one.

    Records live in chunks of ``chunk_bytes`` (a page multiple) that never move, so appends
    are received in place; a record may straddle two chunks. ``pinned`` page-locks them for
    fast restores into GPU memory; default: when a CUDA device is present. ``reserve_bytes``
    (at most the budget) are mapped and populated now, and stay: otherwise chunks are mapped
    32 MiB at a time as checkpoints grow, each first touch a page fault the kernel zeroes
    while appends arrive (most of a loopback holder's CPU beside a busy vLLM, bench/RESULTS.md).
    """

    def __init__(
        self,
        budget_bytes: int = U64_MAX,
        *,
        eviction: EvictionPolicy = EvictionPolicy.SHORTEST_PREFIX,
        chunk_bytes: int = 2 << 20,
        pinned: bool | None = None,
        reserve_bytes: int = 0,
    ) -> None:
        check_int("budget_bytes", budget_bytes, 0, U64_MAX)
        check_int("reserve_bytes", reserve_bytes, 0, budget_bytes)
        if not isinstance(eviction, EvictionPolicy):
            raise TypeError(f"eviction must be an EvictionPolicy, got {type(eviction).__name__}")
        page = mmap.PAGESIZE
        check_int("chunk_bytes", chunk_bytes, page, 1 << 40)
        if chunk_bytes % page:
            raise ValueError(f"chunk_bytes must be a multiple of {page}, got {chunk_bytes}")
        native = _native.require_ucx()
        if pinned is None:
            pinned = bool(native.holder_can_pin())
        elif not isinstance(pinned, bool):
            raise TypeError(f"pinned must be a bool or None, got {type(pinned).__name__}")
        elif pinned and not native.holder_can_pin():
            raise ValueError("pinned must be False or None without a CUDA device, got True")
        self.eviction = eviction
        self._native = native.HolderStore(
            budget_bytes=int(budget_bytes),
            policy=eviction.value,
            chunk_bytes=int(chunk_bytes),
            pinned=pinned,
            reserve_bytes=int(reserve_bytes),
        )

    def serve(
        self,
        secret: bytes,
        *,
        address: str = "127.0.0.1",
        port: int = 0,
        tls: str = "",
        limits: WireLimits = WireLimits(),
        verify_records: bool = True,
        holder_id: int = 0,
        issuer_public_key: bytes | None = None,
    ) -> Server:
        """A transport ``Server`` that keeps what it receives in this store, for the clients
        whose capabilities ``issuer_public_key`` verifies and name ``holder_id`` (see
        ``Server``)."""
        return Server(
            secret,
            holder_id=holder_id,
            issuer_public_key=issuer_public_key,
            address=address,
            port=port,
            tls=tls,
            limits=limits,
            verify_records=verify_records,
            store=self,
        )

    def reserve(self, request_id: int, num_tokens: int, record_bytes: int, *, shard: int = 0) -> bool:
        """Placement: charge ``num_tokens`` records for (request_id, shard), evicting when
        needed (see the class doc). False (counted in stats, nothing evicted) when the budget
        cannot make room."""
        check_int("request_id", request_id, 0, U64_MAX)
        check_int("shard", shard, 0, U32_MAX)
        check_int("record_bytes", record_bytes, 1, U32_MAX)
        check_int("num_tokens", num_tokens, 0, U64_MAX // (int(record_bytes) + 8))
        return bool(self._native.reserve(request_id, shard, num_tokens, record_bytes))

    def expire(self, request_id: int) -> int:
        """The request is gone: drop its checkpoints (every shard); how many were dropped."""
        return int(self._native.expire(check_int("request_id", request_id, 0, U64_MAX)))

    def expire_idle(self, max_idle_s: float) -> int:
        """Drop checkpoints untouched for more than ``max_idle_s``; how many were dropped."""
        return int(self._native.expire_idle(check_number("max_idle_s", max_idle_s, positive=True)))

    def stats(self) -> dict[str, int]:
        return dict(self._native.stats())

    def take_evictions(self) -> list[Eviction]:
        """The checkpoints evicted since the last call, oldest first (the last 4096 at most;
        ``stats()["evictions"]`` counts them all)."""
        return [Eviction(*map(int, e)) for e in self._native.take_evictions()]

    def checkpoints(self) -> list[CheckpointInfo]:
        return [
            CheckpointInfo(
                request_id=int(c["request_id"]),
                shard=int(c["shard"]),
                epoch=int(c["epoch"]),
                record_bytes=int(c["record_bytes"]),
                opened=bool(c["opened"]),
                durable_tokens=int(c["durable_tokens"]),
                reserved_tokens=int(c["reserved_tokens"]),
            )
            for c in self._native.checkpoints()
        ]

    def durable_tokens(self, request_id: int, *, shard: int = 0) -> int:
        """Durable length of (request_id, shard); 0 when the store has no such checkpoint."""
        return int(
            self._native.durable_tokens(
                check_int("request_id", request_id, 0, U64_MAX), check_int("shard", shard, 0, U32_MAX)
            )
        )

    def restore(
        self,
        request_id: int,
        layout: KVLayout,
        slot_ids: object,
        *,
        token_ids: object,
        model_fingerprint: str,
        shard: int = 0,
        max_tokens: int | None = None,
    ) -> RestoreResult:
        """Write the verified durable prefix of (request_id, shard) into ``slot_ids`` of
        ``layout`` (newly allocated slots, one per position from 0).

        ``token_ids`` are the request's known tokens (prompt, then outputs); the checkpoint
        must name this layout and ``model_fingerprint``, each restored token must have the
        expected id and its record its crc. The prefix up to the first failed check (at most
        ``max_tokens``, e.g. the minimum over TP shards) is restored; the caller re-prefills
        the rest (``reprefill_tokens`` of ``token_ids``). A CPU cache is written while its
        records are verified, in one pass. A CUDA cache is written by a native pipeline: groups
        of records are checked on the host while the group before is copied to the device and
        scattered on the current CUDA stream; the call returns once the cache holds them.
        """
        layout, slots, tokens, limit = _check_restore_args(layout, slot_ids, token_ids, max_tokens)
        check_str("model_fingerprint", model_fingerprint)
        args = (
            check_int("request_id", request_id, 0, U64_MAX),
            check_int("shard", shard, 0, U32_MAX),
            fingerprint_bytes(layout, model_fingerprint),
            tokens[:limit],
            layout.descriptors().numpy(),
            slots[:limit],
            layout.record_bytes,
        )
        if layout.device.type == "cuda":
            device = layout.device.index if layout.device.index is not None else torch.cuda.current_device()
            stream = torch.cuda.current_stream(device).cuda_stream
            status, restored, durable = self._native.restore_into_cuda(
                *args, device=device, stream=stream, num_threads=os.cpu_count() or 1
            )
        else:
            status, restored, durable = self._native.restore_into(*args)
        return RestoreResult(
            status=RestoreStatus(status),
            restored_tokens=int(restored),
            reprefill_tokens=len(tokens) - int(restored),
            durable_tokens=int(durable),
        )


def remote_restore(
    client: Client,
    request_id: int,
    layout: KVLayout,
    slot_ids: object,
    *,
    token_ids: object,
    model_fingerprint: str,
    capability: bytes,
    shard: int = 0,
    epoch: int = 0,
    max_tokens: int | None = None,
    chunk_tokens: int = 1024,
    timeout_s: float = 10.0,
) -> RestoreResult:
    """``HolderStore.restore`` for a checkpoint held by another process: reads it from the
    holder over ``client`` (``chunk_tokens`` at a time) and checks fingerprints, token ids and
    crcs here before scattering the verified prefix into ``slot_ids``. Each read asks for at
    most what one reply may carry under ``client.limits`` (the holder's included)."""
    if not isinstance(client, Client):
        raise TypeError(f"client must be a transport Client, got {type(client).__name__}")
    layout, slots, tokens, limit = _check_restore_args(layout, slot_ids, token_ids, max_tokens)
    check_str("model_fingerprint", model_fingerprint)
    check_int("chunk_tokens", chunk_tokens, 1, U32_MAX)
    limits = client.limits
    fit = (limits.max_payload_bytes - read_reply_bytes(0, 0)) // (layout.record_bytes + 8)
    chunk = max(1, min(chunk_tokens, limits.max_tokens_per_message, fit))  # 0 fit: read refuses

    def read(start: int, records: torch.Tensor) -> _Chunk | None:
        try:
            result = client.read(
                request_id,
                shard,
                epoch,
                start,
                len(records),
                layout.record_bytes,
                capability,
                out=records.numpy(),
                timeout_s=timeout_s,
            )
        except Rejected:  # the holder has no such checkpoint (released, evicted, expired)
            return None
        return _Chunk(
            result.layout_fingerprint + result.model_fingerprint,
            result.token_ids,
            result.crcs,
            result.durable_tokens,
        )

    return _restore_in_chunks(
        read, layout, slots, tokens, limit, fingerprint_bytes(layout, model_fingerprint), chunk
    )


@dataclass(frozen=True)
class _Chunk:
    """What one read of a restore returned: the checkpoint's fingerprints, the ids and crcs of
    the tokens read (their records are in the caller's buffer) and its durable length."""

    fingerprints: bytes
    token_ids: np.ndarray
    crcs: np.ndarray
    durable_tokens: int


def _restore_in_chunks(
    read: Callable[[int, torch.Tensor], _Chunk | None],
    layout: KVLayout,
    slots: np.ndarray,
    tokens: np.ndarray,
    limit: int,
    expected_fingerprints: bytes,
    chunk: int,
) -> RestoreResult:
    """A restore whose records are read out ``chunk`` tokens at a time: ``read(start,
    records)`` fills ``records`` (a host buffer, pinned for a CUDA cache) from position
    ``start`` and says what it read (None: no such checkpoint). Each chunk's token ids and
    crcs are checked here and its verified prefix scattered. For a CUDA cache reads alternate
    between two buffers, so the next chunk is read and verified while the last one is still on
    its way to the device; the restore returns once the cache holds every restored record."""
    cuda = layout.device.type == "cuda"
    rows = min(chunk, max(limit, 1))
    buffers = [
        torch.empty((rows, layout.record_bytes), dtype=torch.uint8, pin_memory=cuda)
        for _ in range(2 if cuda else 1)
    ]
    # The event after the last scatter from each buffer: it must pass before a read refills it.
    scattered: list[torch.cuda.Event | None] = [None] * len(buffers)
    restored = durable = reads = 0
    status = RestoreStatus.COMPLETE
    try:
        while reads == 0 or restored < limit:
            # Read at least once, even for nothing to restore: a missing or mismatched
            # checkpoint is reported as it is by the one-pass restore.
            which = reads % len(buffers)
            reads += 1
            pending = scattered[which]
            if pending is not None:
                pending.synchronize()
            buffer = buffers[which]
            got = read(restored, buffer[: max(1, min(rows, limit - restored))])
            if got is None:
                status = RestoreStatus.MISSING
                break
            durable = got.durable_tokens
            if got.fingerprints != expected_fingerprints:
                status = RestoreStatus.FINGERPRINT_MISMATCH
                break
            n = min(len(got.token_ids), limit - restored)
            if n == 0:
                break
            records = buffer[:n]
            good = n
            bad_tokens = np.nonzero(got.token_ids != tokens[restored : restored + n])[0]
            if bad_tokens.size:
                good, status = int(bad_tokens[0]), RestoreStatus.TOKEN_MISMATCH
            bad_crcs = np.nonzero(checksum(records[:good]).numpy() != got.crcs[:good])[0]
            if bad_crcs.size:
                good, status = int(bad_crcs[0]), RestoreStatus.CRC_MISMATCH
            if good:
                scatter_tokens(layout, torch.from_numpy(slots[restored : restored + good]), records[:good])
                if cuda:
                    event = torch.cuda.Event()
                    event.record(torch.cuda.current_stream(layout.device))
                    scattered[which] = event
            restored += good
            if status != RestoreStatus.COMPLETE:
                break
    finally:
        for event in scattered:  # the buffers are freed on return: no copy may still read them
            if event is not None:
                event.synchronize()
    return RestoreResult(
        status=status,
        restored_tokens=restored,
        reprefill_tokens=len(tokens) - restored,
        durable_tokens=durable,
    )
