"""Cluster secret, call authentication and per-request capabilities (DESIGN.md section 3.3).

- The cluster secret has no default: ``write_secret_file`` writes 32 random bytes to a new
  0600 file, ``read_secret_file`` refuses a file others can access or a secret under 16 bytes.
- Every gRPC call carries ``lumen-auth-v1: <unix time>.<nonce hex>.<mac hex>`` with
  ``mac = HMAC-SHA256(secret, "lumen-gateway-v1|" method "|" time "|" nonce)``. The gateway
  accepts a timestamp within ``max_skew_s`` of its clock and each nonce once, so a captured
  header cannot be replayed and a peer without the secret cannot call at all. The message
  bodies are neither encrypted nor MAC'd (no TLS): the cluster network must keep them private.
- ``issue_capability`` reproduces the transport's capability bytes in pure Python:
  ``HMAC-SHA256(secret, "lumen-cap-v1" || request_id u64 LE || shard u32 LE || epoch u32 LE)``.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import struct
import threading
import time

from lumen_core.secret import (
    MIN_SECRET_BYTES,
    SECRET_FILE_BYTES,
    check_secret,
    read_secret_file,
    write_secret_file,
)

__all__ = [
    "AUTH_METADATA_KEY",
    "MIN_SECRET_BYTES",
    "SECRET_FILE_BYTES",
    "CallVerifier",
    "check_secret",
    "issue_capability",
    "read_secret_file",
    "sign_call",
    "write_secret_file",
]

AUTH_METADATA_KEY = "lumen-auth-v1"
_CAPABILITY_LABEL = b"lumen-cap-v1"
_CALL_LABEL = b"lumen-gateway-v1|"
_NONCE_BYTES = 16
_U64_MAX = 2**64 - 1
_U32_MAX = 2**32 - 1


def _check_int(name: str, value: object, high: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if not 0 <= value <= high:
        raise ValueError(f"{name} must be in [0, {high}], got {value}")
    return value


def issue_capability(secret: bytes, request_id: int, shard: int, epoch: int) -> bytes:
    """The 32-byte capability that lets a peer open, append to, read and release exactly the
    checkpoint (request_id, shard) at this epoch; byte-identical to the native transport's."""
    key = check_secret(secret)
    message = _CAPABILITY_LABEL + struct.pack(
        "<QII",
        _check_int("request_id", request_id, _U64_MAX),
        _check_int("shard", shard, _U32_MAX),
        _check_int("epoch", epoch, _U32_MAX),
    )
    return hmac.new(key, message, hashlib.sha256).digest()


def _call_mac(secret: bytes, method: str, timestamp: str, nonce: str) -> str:
    message = _CALL_LABEL + method.encode() + b"|" + timestamp.encode() + b"|" + nonce.encode()
    return hmac.new(secret, message, hashlib.sha256).hexdigest()


def sign_call(secret: bytes, method: str, *, now_s: float | None = None) -> str:
    """The ``lumen-auth-v1`` metadata value for one call of ``method`` (the full gRPC method
    name, e.g. "/lumen.gateway.v1.Gateway/Heartbeat")."""
    key = check_secret(secret)
    timestamp = f"{time.time() if now_s is None else now_s:.6f}"
    nonce = secrets.token_hex(_NONCE_BYTES)
    return f"{timestamp}.{nonce}.{_call_mac(key, method, timestamp, nonce)}"


class CallVerifier:
    """Checks ``lumen-auth-v1`` values: valid MAC, timestamp within ``max_skew_s``, nonce
    unseen. Thread-safe; remembers nonces for ``2 * max_skew_s`` (older ones fail the clock)."""

    def __init__(self, secret: bytes, *, max_skew_s: float = 30.0) -> None:
        self._secret = check_secret(secret)
        if isinstance(max_skew_s, bool) or not isinstance(max_skew_s, (int, float)) or not max_skew_s > 0:
            raise ValueError(f"max_skew_s must be a number > 0, got {max_skew_s!r}")
        self.max_skew_s = float(max_skew_s)
        self._seen: dict[str, float] = {}
        self._lock = threading.Lock()
        self.num_refused = 0

    @property
    def num_nonces(self) -> int:
        """Nonces remembered now (bounded: old ones are pruned)."""
        with self._lock:
            return len(self._seen)

    def verify(self, method: str, value: str | None, *, now_s: float | None = None) -> str | None:
        """None if the call is authentic, else why it is refused."""
        reason = self._check(method, value, time.time() if now_s is None else now_s)
        if reason is not None:
            with self._lock:
                self.num_refused += 1
        return reason

    def _check(self, method: str, value: str | None, now_s: float) -> str | None:
        if not value:
            return f"missing {AUTH_METADATA_KEY} metadata"
        parts = value.split(".")
        if len(parts) != 4:  # the timestamp has one dot itself
            return f"malformed {AUTH_METADATA_KEY} metadata"
        timestamp, nonce, mac = f"{parts[0]}.{parts[1]}", parts[2], parts[3]
        expected = _call_mac(self._secret, method, timestamp, nonce)
        if not hmac.compare_digest(expected, mac):
            return "bad MAC: the caller does not hold the cluster secret"
        try:
            sent_s = float(timestamp)
        except ValueError:
            return "malformed timestamp"
        if abs(now_s - sent_s) > self.max_skew_s:
            return f"timestamp {sent_s:.3f} is more than {self.max_skew_s} s from now ({now_s:.3f})"
        with self._lock:
            if nonce in self._seen:
                return "nonce replayed"
            self._seen[nonce] = sent_s
            if len(self._seen) > 4096:
                horizon = now_s - 2 * self.max_skew_s
                self._seen = {n: t for n, t in self._seen.items() if t >= horizon}
        return None
