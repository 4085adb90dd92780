"""Python face of the native UCX transport: moves checkpoint bytes, knows no layout or policy.

A ``Server`` listens (on 127.0.0.1 unless given an address) and keeps what authenticated
clients append in an in-memory store; a ``Client`` connects, proves the cluster secret, and
opens, appends to, reads and releases checkpoints keyed by (request_id, shard), each bound to
a capability from ``issue_capability``. The data path (send, receive, crc check) runs in C++
on a progress thread with no GIL. Failures raise the typed errors of ``errors``.
"""

from __future__ import annotations

import os
import warnings
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from lumen_core import _native
from lumen_core.auth import MIN_SECRET_BYTES, check_secret, read_secret_file
from lumen_core.transport.errors import (
    Aborted,
    Conflict,
    Malformed,
    PeerGone,
    Rejected,
    StaleEpoch,
    Timeout,
    TransportError,
)

if TYPE_CHECKING:
    from lumen_core.stream.holder import HolderStore

__all__ = [
    "Aborted",
    "Client",
    "Conflict",
    "Malformed",
    "PeerGone",
    "ReadResult",
    "Rejected",
    "SelfTest",
    "Server",
    "StaleEpoch",
    "Timeout",
    "TransportError",
    "WireLimits",
    "MIN_SECRET_BYTES",
    "issue_capability",
    "read_secret_file",
]

FINGERPRINT_BYTES = 32
CAPABILITY_BYTES = 32
_U32_MAX = 2**32 - 1
_U64_MAX = 2**64 - 1


@dataclass(frozen=True)
class WireLimits:
    """What a receiver accepts in one message; larger messages are refused as malformed."""

    max_tokens_per_message: int = 1 << 16
    max_record_bytes: int = 1 << 24
    max_payload_bytes: int = 1 << 30

    def __post_init__(self) -> None:
        _check_int("max_tokens_per_message", self.max_tokens_per_message, 1, _U32_MAX)
        _check_int("max_record_bytes", self.max_record_bytes, 1, _U32_MAX)
        _check_int("max_payload_bytes", self.max_payload_bytes, 1, _U64_MAX)

    def _kwargs(self) -> dict[str, int]:
        return {
            "max_tokens_per_message": self.max_tokens_per_message,
            "max_record_bytes": self.max_record_bytes,
            "max_payload_bytes": self.max_payload_bytes,
        }


@dataclass(frozen=True)
class SelfTest:
    """What ``Client.self_test`` measured: the (transport, device) pairs UCX chose for the
    connection and the append bandwidth in payload GB/s."""

    transports: tuple[tuple[str, str], ...]
    gb_per_s: float


@dataclass(frozen=True)
class ReadResult:
    """Durable tokens read back: ``records`` is ``[num_tokens, record_bytes]`` uint8 (a view of
    the caller's buffer when one was given), ``token_ids`` and ``crcs`` are uint32[num_tokens]."""

    start_pos: int
    token_ids: np.ndarray
    crcs: np.ndarray
    records: np.ndarray
    durable_tokens: int
    layout_fingerprint: bytes
    model_fingerprint: bytes


def _check_int(name: str, value: object, low: int, high: int) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if not low <= int(value) <= high:
        raise ValueError(f"{name} must be in [{low}, {high}], got {value}")
    return int(value)


def _check_bytes(name: str, value: object, size: int | None = None) -> bytes:
    if not isinstance(value, (bytes, bytearray)):
        raise TypeError(f"{name} must be bytes, got {type(value).__name__}")
    if size is not None and len(value) != size:
        raise ValueError(f"{name} must be {size} bytes, got {len(value)}")
    return bytes(value)


def _check_timeout(timeout_s: object, name: str = "timeout_s") -> float:
    if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)):
        raise TypeError(f"{name} must be a number, got {type(timeout_s).__name__}")
    if not timeout_s > 0:
        raise ValueError(f"{name} must be > 0, got {timeout_s}")
    return float(timeout_s)


def _check_array(name: str, value: object, dtype: type, ndim: int) -> np.ndarray:
    if not isinstance(value, np.ndarray):
        raise TypeError(f"{name} must be a numpy.ndarray, got {type(value).__name__}")
    if value.dtype != dtype:
        raise ValueError(f"{name} must have dtype {np.dtype(dtype)}, got {value.dtype}")
    if value.ndim != ndim:
        raise ValueError(f"{name} must have {ndim} dimension(s), got {value.ndim}")
    if not value.flags.c_contiguous:
        raise ValueError(f"{name} must be C-contiguous, got a strided array")
    return value


def _check_key(request_id: object, shard: object, epoch: object) -> tuple[int, int, int]:
    return (
        _check_int("request_id", request_id, 0, _U64_MAX),
        _check_int("shard", shard, 0, _U32_MAX),
        _check_int("epoch", epoch, 0, _U32_MAX),
    )


def issue_capability(secret: bytes, request_id: int, shard: int, epoch: int) -> bytes:
    """The 32-byte capability HMAC-SHA256(secret, request_id, shard, epoch) that lets a peer
    open, append to, read and release exactly this checkpoint at this epoch."""
    key = check_secret(secret)
    request_id, shard, epoch = _check_key(request_id, shard, epoch)
    return bytes(_native.require_ucx().issue_capability(key, request_id, shard, epoch))


class Server:
    """A listener keeping appended checkpoints in ``store``, a ``lumen_core.stream.HolderStore``
    (budgeted host memory; a new unbudgeted one when not given).

    Runs its own UCX progress thread; ``stats()`` returns the counters of every refusal.
    ``tls`` sets UCX_TLS for this server only ("" leaves UCX's choice). A connection that has
    not proven the secret within ``handshake_timeout_s`` is dropped.
    """

    def __init__(
        self,
        secret: bytes,
        *,
        address: str = "127.0.0.1",
        port: int = 0,
        tls: str = "",
        limits: WireLimits = WireLimits(),
        verify_records: bool = True,
        handshake_timeout_s: float = 10.0,
        store: HolderStore | None = None,
    ) -> None:
        key = check_secret(secret)
        if not isinstance(address, str):
            raise TypeError(f"address must be a str, got {type(address).__name__}")
        _check_int("port", port, 0, 65535)
        if not isinstance(tls, str):
            raise TypeError(f"tls must be a str, got {type(tls).__name__}")
        if not isinstance(limits, WireLimits):
            raise TypeError(f"limits must be a WireLimits, got {type(limits).__name__}")
        from lumen_core.stream.holder import HolderStore  # noqa: F811 - the run-time import

        if store is None:
            store = HolderStore()
        elif not isinstance(store, HolderStore):
            raise TypeError(f"store must be a HolderStore, got {type(store).__name__}")
        self._native = _native.require_ucx().serve_holder_store(
            store._native,
            secret=key,
            address=address,
            port=port,
            tls=tls,
            verify_records=bool(verify_records),
            handshake_timeout_s=_check_timeout(handshake_timeout_s, "handshake_timeout_s"),
            **limits._kwargs(),
        )
        self.address = address
        self.store = store

    @property
    def port(self) -> int:
        """The port listened on (the one the OS chose when constructed with port 0)."""
        return int(self._native.port)

    def stats(self) -> dict[str, int]:
        """Counters: connections, handshakes, every kind of refusal, committed appends/bytes."""
        return dict(self._native.stats())

    def close(self) -> None:
        """Stops listening and drops every connection (appends in flight fail). Idempotent."""
        self._native.close()

    def __enter__(self) -> Server:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


class Client:
    """One authenticated connection to a ``Server``.

    Every call takes a deadline (``timeout_s``) and raises ``Timeout`` when it passes (an
    operation whose transfer was still in flight drops the connection, so the caller's arrays
    are never touched after the call returns), ``PeerGone`` when the connection fails, and
    ``Rejected``/``Conflict``/``StaleEpoch``/``Malformed``/``Aborted`` when the server refuses.
    """

    def __init__(
        self,
        address: str,
        port: int,
        secret: bytes,
        *,
        tls: str = "",
        connect_timeout_s: float = 10.0,
        limits: WireLimits = WireLimits(),
    ) -> None:
        key = check_secret(secret)
        if not isinstance(address, str):
            raise TypeError(f"address must be a str, got {type(address).__name__}")
        _check_int("port", port, 1, 65535)
        if not isinstance(limits, WireLimits):
            raise TypeError(f"limits must be a WireLimits, got {type(limits).__name__}")
        self.limits = limits
        self._native = _native.require_ucx().Client(
            address=address,
            port=port,
            secret=key,
            tls=tls,
            connect_timeout_s=_check_timeout(connect_timeout_s, "connect_timeout_s"),
            **limits._kwargs(),
        )

    @property
    def connected(self) -> bool:
        """False once the connection failed or was closed; every call then raises PeerGone."""
        return bool(self._native.connected)

    def open(
        self,
        request_id: int,
        shard: int,
        epoch: int,
        record_bytes: int,
        layout_fingerprint: bytes,
        model_fingerprint: bytes,
        capability: bytes,
        *,
        reserve_tokens: int = 0,
        timeout_s: float = 10.0,
    ) -> int:
        """Opens (or re-opens at a newer epoch) a checkpoint; returns its durable length.
        With ``reserve_tokens`` the holder also reserves that many records for it (placement's
        expected size) or refuses the open (``Rejected``) when its budget cannot make room."""
        key = _check_key(request_id, shard, epoch)
        _check_int("record_bytes", record_bytes, 1, self.limits.max_record_bytes)
        fingerprints = _check_bytes(
            "layout_fingerprint", layout_fingerprint, FINGERPRINT_BYTES
        ) + _check_bytes("model_fingerprint", model_fingerprint, FINGERPRINT_BYTES)
        cap = _check_bytes("capability", capability, CAPABILITY_BYTES)
        return int(
            self._native.open(
                *key,
                record_bytes,
                fingerprints,
                cap,
                _check_int("reserve_tokens", reserve_tokens, 0, 2**64 - 1),
                _check_timeout(timeout_s),
            )
        )

    def start_append(
        self,
        request_id: int,
        shard: int,
        epoch: int,
        start_pos: int,
        token_ids: np.ndarray,
        crcs: np.ndarray,
        records: np.ndarray,
        capability: bytes,
    ) -> int:
        """Starts sending ``records`` ([n, record_bytes] uint8, n >= 1) with their token ids and
        crc32c (uint32[n] each) for positions [start_pos, start_pos + n); returns an op id for
        ``wait``. The arrays are kept alive, and must not be modified, until then."""
        key = _check_key(request_id, shard, epoch)
        _check_int("start_pos", start_pos, 0, _U64_MAX)
        records = _check_array("records", records, np.uint8, 2)
        num_tokens = records.shape[0]
        if not 1 <= num_tokens <= self.limits.max_tokens_per_message:
            raise ValueError(
                f"records must hold 1 to {self.limits.max_tokens_per_message} tokens, got {num_tokens}"
            )
        if records.shape[1] < 1:
            raise ValueError("records must have record_bytes >= 1, got 0")
        for name, array in (("token_ids", token_ids), ("crcs", crcs)):
            _check_array(name, array, np.uint32, 1)
            if array.shape[0] != num_tokens:
                raise ValueError(f"{name} must have {num_tokens} entries, got {array.shape[0]}")
        cap = _check_bytes("capability", capability, CAPABILITY_BYTES)
        return int(self._native.start_append(*key, start_pos, token_ids, crcs, records, cap))

    def wait(self, op_id: int, *, timeout_s: float = 10.0) -> int:
        """Waits for a started append; returns the checkpoint's durable length after it."""
        _check_int("op_id", op_id, 1, _U64_MAX)
        return int(self._native.wait(op_id, _check_timeout(timeout_s)))

    def append(
        self,
        request_id: int,
        shard: int,
        epoch: int,
        start_pos: int,
        token_ids: np.ndarray,
        crcs: np.ndarray,
        records: np.ndarray,
        capability: bytes,
        *,
        timeout_s: float = 10.0,
    ) -> int:
        """``start_append`` then ``wait``."""
        op_id = self.start_append(request_id, shard, epoch, start_pos, token_ids, crcs, records, capability)
        return self.wait(op_id, timeout_s=timeout_s)

    def release(
        self, request_id: int, shard: int, epoch: int, capability: bytes, *, timeout_s: float = 10.0
    ) -> None:
        """Frees the checkpoint on the server."""
        key = _check_key(request_id, shard, epoch)
        cap = _check_bytes("capability", capability, CAPABILITY_BYTES)
        self._native.release(*key, cap, _check_timeout(timeout_s))

    def read(
        self,
        request_id: int,
        shard: int,
        epoch: int,
        start_pos: int,
        max_tokens: int,
        record_bytes: int,
        capability: bytes,
        *,
        out: np.ndarray | None = None,
        timeout_s: float = 10.0,
    ) -> ReadResult:
        """Reads up to ``max_tokens`` durable tokens from ``start_pos``, received straight into
        ``out`` ([max_tokens, record_bytes] uint8) when given. Reading at a newer epoch fences
        the checkpoint's older writers."""
        key = _check_key(request_id, shard, epoch)
        _check_int("start_pos", start_pos, 0, _U64_MAX)
        _check_int("max_tokens", max_tokens, 1, self.limits.max_tokens_per_message)
        _check_int("record_bytes", record_bytes, 1, self.limits.max_record_bytes)
        cap = _check_bytes("capability", capability, CAPABILITY_BYTES)
        if out is None:
            out = np.empty((max_tokens, record_bytes), dtype=np.uint8)
        else:
            _check_array("out", out, np.uint8, 2)
            if out.shape != (max_tokens, record_bytes):
                raise ValueError(f"out must have shape {(max_tokens, record_bytes)}, got {out.shape}")
        token_ids = np.empty(max_tokens, dtype=np.uint32)
        crcs = np.empty(max_tokens, dtype=np.uint32)
        start, num_tokens, durable, fingerprints = self._native.read(
            *key, start_pos, token_ids, crcs, out, cap, _check_timeout(timeout_s)
        )
        return ReadResult(
            start_pos=int(start),
            token_ids=token_ids[:num_tokens],
            crcs=crcs[:num_tokens],
            records=out[:num_tokens],
            durable_tokens=int(durable),
            layout_fingerprint=bytes(fingerprints[:FINGERPRINT_BYTES]),
            model_fingerprint=bytes(fingerprints[FINGERPRINT_BYTES:]),
        )

    def self_test(
        self,
        *,
        message_bytes: int = 8 << 20,
        count: int = 16,
        window: int = 4,
        expected_gb_per_s: float = 1.0,
        timeout_s: float = 30.0,
    ) -> SelfTest:
        """Start-up self-test: which transports UCX picked, and the bandwidth of ``count``
        appends of ``message_bytes`` (``window`` of them in flight) to a scratch checkpoint on
        the server (released after). Warns (RuntimeWarning) when the bandwidth is below
        ``expected_gb_per_s``."""
        _check_int("message_bytes", message_bytes, 1, self.limits.max_payload_bytes)
        _check_int("count", count, 1, 1 << 20)
        _check_int("window", window, 1, 1 << 10)
        if isinstance(expected_gb_per_s, bool) or not isinstance(expected_gb_per_s, (int, float)):
            raise TypeError(f"expected_gb_per_s must be a number, got {type(expected_gb_per_s).__name__}")
        transports = tuple(self.transports())
        shard = int.from_bytes(os.urandom(4), "little")  # scratch key: no clash with others
        bytes_per_s = self._native.measure_bandwidth(
            message_bytes, count, window, shard, _check_timeout(timeout_s)
        )
        result = SelfTest(transports=transports, gb_per_s=bytes_per_s / 1e9)
        if result.gb_per_s < expected_gb_per_s:
            warnings.warn(
                f"transport self-test: {result.gb_per_s:.2f} GB/s over "
                f"{', '.join(t + '/' + d if d else t for t, d in transports)}, expected at "
                f"least {expected_gb_per_s:.2f} GB/s",
                RuntimeWarning,
                stacklevel=2,
            )
        return result

    def transports(self) -> list[tuple[str, str]]:
        """The (transport, device) pairs UCX chose for this connection, e.g. ("tcp", "lo")."""
        return [(str(t), str(d)) for t, d in self._native.transports()]

    def stats(self) -> dict[str, int]:
        """Counters: operations started and failed, bytes sent (acknowledged) and read."""
        return dict(self._native.stats())

    def close(self) -> None:
        """Closes the connection; operations in flight fail with PeerGone. Idempotent."""
        self._native.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
