"""Checkpoint streaming, the holder store and restore: the data plane of mechanism 1
(docs/streaming.md, docs/transport.md). Needs the native UCX module (``lumen_core._C_ucx``)."""

from lumen_core.stream._common import fingerprint_bytes, request_key
from lumen_core.stream.holder import (
    CheckpointInfo,
    Eviction,
    EvictionPolicy,
    HolderStore,
    RestoreResult,
    RestoreStatus,
    remote_restore,
    restorable_tokens,
)
from lumen_core.stream.streamer import Address, CheckpointStreamer, ReplicaStats, StreamStats

__all__ = [
    "Address",
    "CheckpointInfo",
    "CheckpointStreamer",
    "Eviction",
    "EvictionPolicy",
    "HolderStore",
    "ReplicaStats",
    "RestoreResult",
    "RestoreStatus",
    "StreamStats",
    "fingerprint_bytes",
    "remote_restore",
    "request_key",
    "restorable_tokens",
]
