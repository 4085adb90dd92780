"""The sending end of the transport: one authenticated connection to a ``Server`` that opens,
appends to, reads and releases checkpoints (lumen/transport/client.h)."""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any

import numpy as np

from lumen_core import _native
from lumen_core._validate import U32_MAX, U64_MAX, check_bytes, check_int
from lumen_core.auth import WorkerIdentity, check_secret
from lumen_core.transport._checks import check_array, check_key, check_timeout
from lumen_core.transport.wire import (
    CAPABILITY_BYTES,
    FINGERPRINT_BYTES,
    WireLimits,
    append_payload_bytes,
    read_reply_bytes,
)

# The scratch checkpoint of ``Client.self_test`` (kSelfTestRequest in csrc/transport/client.cpp).
SELF_TEST_REQUEST_ID = U64_MAX


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


class Client:
    """One authenticated connection to a ``Server``.

    Every call takes a deadline (``timeout_s``, finite: in (0, 1e6] s; ``inf`` is a ValueError)
    and raises ``Timeout`` when it passes (an operation whose transfer was still in flight
    drops the connection, so the caller's arrays are never touched after the call returns),
    ``PeerGone`` when the connection fails (the server closed included), and
    ``Rejected``/``Conflict``/``StaleEpoch``/``Malformed``/``Aborted`` when the server refuses.
    Arguments the limits would refuse on the wire are a ValueError before anything is sent:
    ``limits`` are what this end accepts; the server announces its own in the handshake, and
    ``self.limits`` is then the smaller of the two, field by field. With ``identity`` (once
    it holds a credential) the handshake also proves that worker's credential, which
    capabilities bound to the worker require. With ``encrypt`` the records of appends and
    reads travel in AES-256-GCM (keys of this connection's handshake; docs/security.md); a
    holder serves both kinds of connection.
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
        identity: WorkerIdentity | None = None,
        encrypt: bool = False,
    ) -> None:
        key = check_secret(secret)
        if not isinstance(encrypt, bool):
            raise TypeError(f"encrypt must be a bool, got {type(encrypt).__name__}")
        if identity is not None and not isinstance(identity, WorkerIdentity):
            raise TypeError(f"identity must be a WorkerIdentity, got {type(identity).__name__}")
        if not isinstance(address, str):
            raise TypeError(f"address must be a str, got {type(address).__name__}")
        check_int("port", port, 1, 65535)
        if not isinstance(limits, WireLimits):
            raise TypeError(f"limits must be a WireLimits, got {type(limits).__name__}")
        self._native = _native.require_ucx().Client(
            address=address,
            port=port,
            secret=key,
            tls=tls,
            connect_timeout_s=check_timeout(connect_timeout_s, "connect_timeout_s"),
            **limits._kwargs(),
            **(identity.native_kwargs() if identity is not None else {}),
            encrypt=encrypt,
        )
        self.encrypt = encrypt
        # Field by field the smaller of ``limits`` and those the server announced in the
        # handshake: what the calls below check before sending.
        self.limits = WireLimits(*self._native.limits)

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
        ``capability`` (the issuer's, granting write on this checkpoint at ``epoch`` on this
        holder) is what this connection's appends to it must then carry; re-opening at the
        same epoch with a fresh one renews it. With ``reserve_tokens`` the holder also reserves
        that many records for it (placement's expected size) or refuses the open
        (``Rejected``) when its budget cannot make room."""
        key = check_key(request_id, shard, epoch)
        check_int("record_bytes", record_bytes, 1, self.limits.max_record_bytes)
        fingerprints = check_bytes("layout_fingerprint", layout_fingerprint, FINGERPRINT_BYTES) + check_bytes(
            "model_fingerprint", model_fingerprint, FINGERPRINT_BYTES
        )
        cap = check_bytes("capability", capability, CAPABILITY_BYTES)
        return int(
            self._native.open(
                *key,
                record_bytes,
                fingerprints,
                cap,
                check_int("reserve_tokens", reserve_tokens, 0, U64_MAX),
                check_timeout(timeout_s),
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
        key = check_key(request_id, shard, epoch)
        check_int("start_pos", start_pos, 0, U64_MAX)
        records = check_array("records", records, np.uint8, 2)
        num_tokens = records.shape[0]
        if not 1 <= num_tokens <= self.limits.max_tokens_per_message:
            raise ValueError(
                f"records must hold 1 to {self.limits.max_tokens_per_message} tokens, got {num_tokens}"
            )
        record_bytes = records.shape[1]
        if record_bytes < 1:
            raise ValueError("records must have record_bytes >= 1, got 0")
        if record_bytes > self.limits.max_record_bytes:
            raise ValueError(
                f"records must have at most {self.limits.max_record_bytes} bytes a record, got {record_bytes}"
            )
        payload_bytes = append_payload_bytes(num_tokens, record_bytes)
        if payload_bytes > self.limits.max_payload_bytes:
            raise ValueError(
                f"records must fit max_payload_bytes={self.limits.max_payload_bytes}, "
                f"got {payload_bytes} bytes"
            )
        for name, array in (("token_ids", token_ids), ("crcs", crcs)):
            check_array(name, array, np.uint32, 1)
            if array.shape[0] != num_tokens:
                raise ValueError(f"{name} must have {num_tokens} entries, got {array.shape[0]}")
        cap = check_bytes("capability", capability, CAPABILITY_BYTES)
        return int(self._native.start_append(*key, start_pos, token_ids, crcs, records, cap))

    def wait(self, op_id: int, *, timeout_s: float = 10.0) -> int:
        """Waits for a started append; returns the checkpoint's durable length after it."""
        check_int("op_id", op_id, 1, U64_MAX)
        return int(self._native.wait(op_id, check_timeout(timeout_s)))

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
        key = check_key(request_id, shard, epoch)
        cap = check_bytes("capability", capability, CAPABILITY_BYTES)
        self._native.release(*key, cap, check_timeout(timeout_s))

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
        key = check_key(request_id, shard, epoch)
        check_int("start_pos", start_pos, 0, U64_MAX)
        check_int("max_tokens", max_tokens, 1, self.limits.max_tokens_per_message)
        check_int("record_bytes", record_bytes, 1, self.limits.max_record_bytes)
        # The reply to a read of max_tokens must fit what this client accepts in one message.
        if read_reply_bytes(max_tokens, record_bytes) > self.limits.max_payload_bytes:
            fit = max(0, self.limits.max_payload_bytes - read_reply_bytes(0, 0)) // (8 + record_bytes)
            raise ValueError(
                f"max_tokens must be at most {fit} for record_bytes={record_bytes} (the reply must fit "
                f"max_payload_bytes={self.limits.max_payload_bytes}), got {max_tokens}"
            )
        cap = check_bytes("capability", capability, CAPABILITY_BYTES)
        if out is None:
            out = np.empty((max_tokens, record_bytes), dtype=np.uint8)
        else:
            check_array("out", out, np.uint8, 2)
            if out.shape != (max_tokens, record_bytes):
                raise ValueError(f"out must have shape {(max_tokens, record_bytes)}, got {out.shape}")
        token_ids = np.empty(max_tokens, dtype=np.uint32)
        crcs = np.empty(max_tokens, dtype=np.uint32)
        start, num_tokens, durable, fingerprints = self._native.read(
            *key, start_pos, token_ids, crcs, out, cap, check_timeout(timeout_s)
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
        capability: bytes,
        *,
        shard: int,
        message_bytes: int = 8 << 20,
        count: int = 16,
        window: int = 4,
        expected_gb_per_s: float = 1.0,
        timeout_s: float = 30.0,
    ) -> SelfTest:
        """Start-up self-test: which transports UCX picked, and the bandwidth of ``count``
        appends of ``message_bytes`` (``window`` of them in flight) to a scratch checkpoint on
        the server (request SELF_TEST_REQUEST_ID, ``shard``, epoch 0, which ``capability`` must
        grant; released after). Warns (RuntimeWarning) when the bandwidth is below
        ``expected_gb_per_s``."""
        check_int("message_bytes", message_bytes, 1, self.limits.max_payload_bytes)
        check_int("count", count, 1, 1 << 20)
        check_int("window", window, 1, 1 << 10)
        if isinstance(expected_gb_per_s, bool) or not isinstance(expected_gb_per_s, (int, float)):
            raise TypeError(f"expected_gb_per_s must be a number, got {type(expected_gb_per_s).__name__}")
        transports = tuple(self.transports())
        cap = check_bytes("capability", capability, CAPABILITY_BYTES)
        bytes_per_s = self._native.measure_bandwidth(
            message_bytes, count, window, check_int("shard", shard, 0, U32_MAX), cap, check_timeout(timeout_s)
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
