"""Checkpoint streaming, the holder store and restore: the data plane of mechanism 1
(DESIGN.md 3.1, 3.3, 3.4). Needs the native UCX module (``lumen_core._C_ucx``)."""

from typing import Any

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
    "RestoreSource",
    "RestoreResult",
    "RestoreStatus",
    "StreamGrant",
    "StreamStats",
    "StreamingConnector",
    "fingerprint_bytes",
    "remote_restore",
    "request_key",
    "restorable_tokens",
]


def __getattr__(name: str) -> Any:
    # The reference engine's connector is an adapter over lumen_core.connector, which itself
    # builds on this package: imported on first use, so neither import sees the other half-made.
    if name in {"RestoreSource", "StreamGrant", "StreamingConnector"}:
        from lumen_core.stream import connector

        return getattr(connector, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
