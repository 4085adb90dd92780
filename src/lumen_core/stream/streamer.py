"""The engine side of checkpoint streaming (docs/streaming.md): a Python face over the native
streamer, which gathers, checksums and sends on its own thread while the engine decodes."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from lumen_core import _native
from lumen_core._validate import U32_MAX, U64_MAX, check_bytes, check_instance, check_int, check_number
from lumen_core.auth import WorkerIdentity, check_secret
from lumen_core.layouts import KVLayout
from lumen_core.stream._common import as_array, check_str, fingerprint_bytes
from lumen_core.transport import CAPABILITY_BYTES, WireLimits

__all__ = ["CheckpointStreamer", "ReplicaStats", "StreamStats"]

Address = tuple[str, int]


@dataclass(frozen=True)
class ReplicaStats:
    """One replica of a request: ``live`` while its holder is reachable and keeps it;
    ``lost`` for good once its holder refused it (evicted, conflict, stale epoch) or is gone
    for good (failing for ``give_up_after_s``): whoever placed it must place it again."""

    holder: Address
    sent_tokens: int
    durable_tokens: int
    live: bool
    lost: bool


@dataclass(frozen=True)
class StreamStats:
    """What the streamer did. ``counters``: steps enqueued/dropped, tokens saved/dropped/
    deferred, bytes sent/acked/dropped, appends started/failed, holder failures (stalled past
    the ack timeout or disconnected) and reconnects, holders gone for good, replicas lost,
    replacements, releases failed, gather failures (CUDA errors; the step was not sent).
    ``durable``: per request, the longest durable prefix on a live replica; ``saved``: per
    request, tokens saved; ``stale``: requests with saved tokens not durable on any live
    replica; ``coverage``: durable over saved tokens, all requests together (1.0 when nothing
    is saved); ``gone_holders``: holders given up for good; ``lost``: (request, holder) of
    every replica lost for good, for whoever placed it."""

    counters: dict[str, int]
    saved: dict[int, int]
    durable: dict[int, int]
    replicas: dict[int, tuple[ReplicaStats, ...]]
    stale: tuple[int, ...]
    coverage: float
    gone_holders: tuple[Address, ...]
    lost: tuple[tuple[int, Address], ...]


def _check_address(name: str, value: object) -> Address:
    if (
        not isinstance(value, tuple)
        or len(value) != 2
        or not isinstance(value[0], str)
        or isinstance(value[1], bool)
        or not isinstance(value[1], int)
    ):
        raise TypeError(f"{name} must be an (address, port) tuple, got {value!r}")
    check_int(f"{name}.port", value[1], 1, 65535)
    return value[0], int(value[1])


def _check_capabilities(value: object, num_holders: int | None) -> list[bytes]:
    """``value`` as a list of capabilities, ``num_holders`` of them (None: the native side
    checks the count)."""
    if isinstance(value, (str, bytes, bytearray)) or not isinstance(value, Sequence):
        raise TypeError(
            f"capabilities must be a sequence of bytes (one per holder), got {type(value).__name__}"
        )
    if num_holders is not None and len(value) != num_holders:
        raise ValueError(f"capabilities must be one per holder ({num_holders}), got {len(value)}")
    return [check_bytes(f"capabilities[{i}]", cap, CAPABILITY_BYTES) for i, cap in enumerate(value)]


class CheckpointStreamer:
    """Streams the token records of an engine's KV cache (CPU or CUDA) to holders.

    On a CUDA cache, ``save_step`` records an event on the current stream of the cache's
    device (call it after queueing the work that wrote the step's KV, on that stream); the
    streamer's own stream waits for that event, gathers into device staging and copies into
    pinned host staging, so the engine's stream never waits. ``gather_threads`` then only
    sets the crc threads.

    ``add_request`` names a request's holders (replicas) and its capability on each; ``save_step``
    (once per engine step, accepted tokens only) only enqueues and returns a fence;
    ``wait_for_save`` must return before the engine frees or reuses a request's pages;
    ``release`` at completion. When the queue (``max_queued_steps``) or the staging pool
    (``staging_buffers`` x ``staging_bytes``) is full, or a holder is slow (no ack within
    ``ack_timeout_s``) or gone, tokens are not sent and the request is stale from there; its
    next step catches up when there is room. Nothing here blocks the engine.

    A holder that fails (no ack within ``ack_timeout_s``, connection lost) is reconnected
    after ``reconnect_backoff_s``, doubling per consecutive failure; each of its replicas then
    resumes from the durable length the holder reports. A holder failing for
    ``give_up_after_s`` is gone for good: its replicas are ``lost`` in ``stats()``.

    With ``identity``, connections prove the worker's latest credential (taken at each
    ``add_request``), which capabilities bound to the worker require; with ``encrypt`` their
    appends' records travel in AES-256-GCM (``transport.Client``).
    """

    def __init__(
        self,
        layout: KVLayout,
        secret: bytes,
        *,
        model_fingerprint: str,
        shard: int = 0,
        staging_buffers: int = 4,
        staging_bytes: int = 64 << 20,
        max_queued_steps: int = 8,
        ack_timeout_s: float = 2.0,
        connect_timeout_s: float = 2.0,
        reconnect_backoff_s: float = 0.1,
        give_up_after_s: float = 30.0,
        gather_threads: int = 1,
        tls: str = "",
        limits: WireLimits = WireLimits(),
        identity: WorkerIdentity | None = None,
        encrypt: bool = False,
    ) -> None:
        self.layout = check_instance("layout", layout, KVLayout)
        if not isinstance(encrypt, bool):
            raise TypeError(f"encrypt must be a bool, got {type(encrypt).__name__}")
        if identity is not None and not isinstance(identity, WorkerIdentity):
            raise TypeError(f"identity must be a WorkerIdentity, got {type(identity).__name__}")
        self._identity = identity
        self._proved: bytes | None = None  # the credential the native streamer was given last
        native = _native.require_ucx()
        cuda_device = -1
        if self.layout.device.type == "cuda":
            if not native.STREAMER_CUDA:
                raise RuntimeError("this build of lumen_core has no CUDA: it cannot stream a CUDA cache")
            cuda_device = self.layout.device.index
            if cuda_device is None:
                cuda_device = torch.cuda.current_device()
        secret = check_secret(secret)
        self.model_fingerprint = check_str("model_fingerprint", model_fingerprint)
        self.shard = check_int("shard", shard, 0, U32_MAX)
        if not isinstance(tls, str):
            raise TypeError(f"tls must be a str, got {type(tls).__name__}")
        if not isinstance(limits, WireLimits):
            raise TypeError(f"limits must be a WireLimits, got {type(limits).__name__}")
        check_int("staging_buffers", staging_buffers, 1, 1 << 16)
        check_int("staging_bytes", staging_bytes, layout.record_bytes, 1 << 40)
        # One step is staged in one buffer: the rest of a larger one is deferred.
        self.step_tokens = staging_bytes // layout.record_bytes
        check_int("max_queued_steps", max_queued_steps, 1, 1 << 20)
        check_int("gather_threads", gather_threads, 1, 256)
        self._native = native.Streamer(
            secret=secret,
            tls=tls,
            shard=self.shard,
            descriptors=layout.descriptors().numpy(),
            record_bytes=layout.record_bytes,
            fingerprints=fingerprint_bytes(layout, model_fingerprint),
            staging_buffers=staging_buffers,
            staging_bytes=staging_bytes,
            max_queued_steps=max_queued_steps,
            ack_timeout_s=check_number("ack_timeout_s", ack_timeout_s, positive=True),
            connect_timeout_s=check_number("connect_timeout_s", connect_timeout_s, positive=True),
            reconnect_backoff_s=check_number("reconnect_backoff_s", reconnect_backoff_s, positive=True),
            give_up_after_s=check_number("give_up_after_s", give_up_after_s, positive=True),
            gather_threads=gather_threads,
            cuda_device=cuda_device,
            **limits._kwargs(),
            encrypt=encrypt,
        )

    def add_request(
        self,
        request_id: int,
        holders: Sequence[Address],
        capabilities: Sequence[bytes],
        *,
        epoch: int = 0,
        expected_tokens: int = 0,
    ) -> None:
        """Stream ``request_id`` to ``holders`` (each an (address, port)), with
        ``capabilities[i]``, the capability of (request_id, shard, epoch) on ``holders[i]``
        (each names the one holder it is valid on). Each holder reserves ``expected_tokens`` records for it
        when it is opened (placement's expected size: prompt + expected output); a holder that
        refuses is a lost replica in ``stats()``. ValueError if it is already added or the
        capabilities are not one per holder."""
        check_int("request_id", request_id, 0, U64_MAX)
        if isinstance(holders, (str, bytes)) or not isinstance(holders, Sequence) or not holders:
            raise ValueError(f"holders must be a non-empty sequence of (address, port), got {holders!r}")
        addresses = [_check_address("holders[i]", h) for h in holders]
        caps = _check_capabilities(capabilities, len(addresses))
        check_int("epoch", epoch, 0, U32_MAX)
        check_int("expected_tokens", expected_tokens, 0, U64_MAX)
        self._prove_latest_identity()
        self._native.add_request(request_id, addresses, caps, epoch, expected_tokens)

    def _prove_latest_identity(self) -> None:
        # A registration may have brought a new credential since the last request: the
        # connections opened from now on prove that one.
        if self._identity is None or self._identity.credential in (None, self._proved):
            return
        self._native.set_identity(**self._identity.native_kwargs())
        self._proved = self._identity.credential

    def renew(self, request_id: int, capabilities: Sequence[bytes]) -> None:
        """A long request's fresh capabilities (same epoch, later expiry), one per replica in
        ``add_request``'s holder order: each replica re-opens its checkpoint with its new one
        before the next append, which renews the holder's grant. Call it before the old ones
        expire: a holder refuses appends past their capability's expiry. ValueError for an
        unknown request or not one capability per replica."""
        check_int("request_id", request_id, 0, U64_MAX)
        self._native.renew(request_id, _check_capabilities(capabilities, None))

    def save_step(self, request_ids: object, positions: object, slot_ids: object, token_ids: object) -> int:
        """Enqueue one step: token i of request ``request_ids[i]`` at position ``positions[i]``
        was written into slot ``slot_ids[i]`` and is token ``token_ids[i]``. A request's tokens
        are adjacent and consecutive. A step is staged in one staging buffer
        (``step_tokens``): requests past it are deferred, as when the pool is full. Returns
        the fence of the step (0: dropped, nothing to wait for). ValueError: an unknown
        request, a gap, tokens out of order, a cache freed or reallocated under the layout."""
        ids = as_array("request_ids", request_ids, np.uint64)
        pos = as_array("positions", positions, np.uint64)
        slots = as_array("slot_ids", slot_ids, np.int64)
        tokens = as_array("token_ids", token_ids, np.uint32)
        if not len(ids) == len(pos) == len(slots) == len(tokens):
            raise ValueError(
                "request_ids, positions, slot_ids and token_ids must have one entry per token, "
                f"got {len(ids)}, {len(pos)}, {len(slots)}, {len(tokens)}"
            )
        if slots.size and (slots.min() < 0 or slots.max() >= self.layout.num_slots):
            raise IndexError(f"slot_ids must be in [0, {self.layout.num_slots}), got values outside")
        self.layout.check_allocated()  # the native side gathers from the layout's addresses
        engine_stream = 0
        if self.layout.device.type == "cuda":  # the step's KV is written by work queued here
            engine_stream = torch.cuda.current_stream(self.layout.device).cuda_stream
        return int(self._native.save_step(ids, pos, slots, tokens, engine_stream))

    def wait_for_save(self, request_id: int, *, timeout_s: float = 10.0) -> None:
        """Returns once no queued step still reads ``request_id``'s pages; TimeoutError if
        that takes longer than ``timeout_s``."""
        check_int("request_id", request_id, 0, U64_MAX)
        if not self._native.wait_for_save(request_id, check_number("timeout_s", timeout_s, positive=True)):
            raise TimeoutError(f"saves of request {request_id} still pending after {timeout_s} s")

    def wait_fence(self, fence: int, *, timeout_s: float = 10.0) -> None:
        """Returns once the step of ``fence`` has been gathered (its pages may be reused)."""
        check_int("fence", fence, 0, U64_MAX)
        if not self._native.wait_fence(fence, check_number("timeout_s", timeout_s, positive=True)):
            raise TimeoutError(f"step {fence} not gathered after {timeout_s} s")

    def flush(self, *, timeout_s: float = 10.0) -> bool:
        """Waits until every queued step is sent and answered; False on timeout."""
        return bool(self._native.flush(check_number("timeout_s", timeout_s, positive=True)))

    def release(self, request_id: int) -> None:
        """The request finished: forget it and free its checkpoints on its holders."""
        self._native.release(check_int("request_id", request_id, 0, U64_MAX))

    def forget(self, request_id: int) -> None:
        """The request finished: forget it, leaving its checkpoints on its holders for whoever
        granted them to release (a gateway that has not learned the end may restore them)."""
        self._native.forget(check_int("request_id", request_id, 0, U64_MAX))

    def replace_holder(
        self, old_holder: Address, new_holder: Address, capabilities: Mapping[int, bytes]
    ) -> int:
        """Re-placement: every replica on ``old_holder`` moves to ``new_holder``, with
        ``capabilities[request_id]`` for the new holder, and its full saved prefix is re-streamed
        with the request's next step; a replica of a request missing from ``capabilities`` is
        lost. Returns the replicas moved."""
        if not isinstance(capabilities, Mapping):
            raise TypeError(
                f"capabilities must be a mapping of request_id to bytes, got {type(capabilities).__name__}"
            )
        caps = {
            check_int("request_id", request_id, 0, U64_MAX): check_bytes(
                "capabilities[i]", cap, CAPABILITY_BYTES
            )
            for request_id, cap in capabilities.items()
        }
        return int(
            self._native.replace_holder(
                _check_address("old_holder", old_holder), _check_address("new_holder", new_holder), caps
            )
        )

    def counters(self) -> dict[str, int]:
        """``stats().counters`` alone, without walking the requests."""
        return dict(self._native.stats())

    def stats(self) -> StreamStats:
        saved: dict[int, int] = {}
        durable: dict[int, int] = {}
        replicas: dict[int, tuple[ReplicaStats, ...]] = {}
        for request_id, num_saved, reps in self._native.requests():
            states = tuple(
                ReplicaStats((str(a), int(p)), int(s), int(d), bool(live), bool(lost))
                for a, p, s, d, live, lost in reps
            )
            saved[int(request_id)] = int(num_saved)
            replicas[int(request_id)] = states
            durable[int(request_id)] = max((r.durable_tokens for r in states if r.live), default=0)
        total_saved = sum(saved.values())
        total_durable = sum(min(durable[r], saved[r]) for r in saved)
        return StreamStats(
            counters=self.counters(),
            saved=saved,
            durable=durable,
            replicas=replicas,
            stale=tuple(sorted(r for r in saved if durable[r] < saved[r])),
            coverage=total_durable / total_saved if total_saved else 1.0,
            gone_holders=tuple((str(a), int(p)) for a, p in self._native.gone_holders()),
            lost=tuple(sorted((r, rep.holder) for r, reps in replicas.items() for rep in reps if rep.lost)),
        )

    def close(self) -> None:
        self._native.close()

    def __enter__(self) -> CheckpointStreamer:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
