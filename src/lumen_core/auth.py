"""The cluster secret, every HMAC scheme keyed by it, and the issuer of data-plane capabilities
(DESIGN.md section 3.3, docs/security.md).

- The cluster secret has no default: ``write_secret_file`` writes 32 random bytes to a new
  0600 file, ``read_secret_file`` refuses a file others can access or a secret under 16 bytes.
- Capabilities are not keyed by the secret: a ``CapabilityIssuer`` (the gateway, or a
  gateway-less vLLM server) signs them with an Ed25519 key no worker holds, through the
  native transport's one implementation (``csrc/transport/capability.cpp``); holders verify
  them with its public key. Key files: ``write_issuer_key_file`` / ``read_issuer_key_file``
  (the private key, a 0600 file like the secret's) and ``write_issuer_public_key_file`` /
  ``read_issuer_public_key_file`` (hex, for holders).
- Gateway calls: every gRPC call carries ``lumen-auth-v1: <unix time>.<nonce hex>.<mac hex>``
  with ``mac = HMAC-SHA256(secret, "lumen-gateway-v1|" method "|" time "|" nonce)``. The
  gateway accepts a timestamp within ``max_skew_s`` of its clock and each nonce once, so a
  captured header cannot be replayed and a peer without the secret cannot call at all. The
  message bodies are neither encrypted nor MAC'd (no TLS): the cluster network must keep
  them private.
- Assist datagrams: ``seal`` prefixes a JSON payload with
  ``HMAC-SHA256(secret, "lumen-assist-v1|" || payload)``; ``unseal`` drops one that fails.

The labels below are wire bytes: peers of another build must compute the same MACs.
Standard library only but for the issuer, which needs the UCX module when it signs (importing
this module never does), so the transport, the stream and the gateway all import it.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import secrets
import stat
import threading
import time
from dataclasses import dataclass
from enum import IntFlag
from pathlib import Path
from typing import Any

from lumen_core import _native
from lumen_core._validate import U32_MAX, U64_MAX, check_bytes, check_int, check_number

__all__ = [
    "AUTH_METADATA_KEY",
    "CAPABILITY_BYTES",
    "DEFAULT_CAPABILITY_TTL_S",
    "ISSUER_KEY_BYTES",
    "MIN_SECRET_BYTES",
    "SECRET_FILE_BYTES",
    "CallVerifier",
    "CapabilityFields",
    "CapabilityIssuer",
    "Rights",
    "check_secret",
    "read_issuer_key_file",
    "read_issuer_public_key_file",
    "read_secret_file",
    "seal",
    "sign_call",
    "unseal",
    "verify_capability",
    "write_issuer_key_file",
    "write_issuer_public_key_file",
    "write_secret_file",
]

# One label per scheme, so that a MAC of one scheme is never valid in another.
_CALL_LABEL = b"lumen-gateway-v1|"
_SEAL_LABEL = b"lumen-assist-v1|"

AUTH_METADATA_KEY = "lumen-auth-v1"
MIN_SECRET_BYTES = 16
SECRET_FILE_BYTES = 32
_MAX_SECRET_FILE_BYTES = 1 << 20
_MAC_BYTES = 32
_NONCE_BYTES = 16
_MAX_REMEMBERED_NONCES = 4096
CAPABILITY_BYTES = 128  # kCapabilityBytes in lumen/transport/capability.h
ISSUER_KEY_BYTES = 32  # an Ed25519 private key (seed) or public key
# Long enough for any request the tests and the demo run; a longer one is renewed by opening
# its checkpoint again at the same epoch with a fresh capability.
DEFAULT_CAPABILITY_TTL_S = 3600.0


# ---- the cluster secret ---------------------------------------------------------------------
def check_secret(secret: object) -> bytes:
    """The secret as bytes. Raises ValueError for None (no default) or under 16 bytes,
    TypeError for anything but bytes."""
    if secret is None:
        raise ValueError("`secret` must be given, got None: there is no default cluster secret")
    key = check_bytes("secret", secret)
    if len(key) < MIN_SECRET_BYTES:
        raise ValueError(f"`secret` must be at least {MIN_SECRET_BYTES} bytes, got {len(key)}")
    return key


def write_secret_file(path: str | os.PathLike[str], *, num_bytes: int = SECRET_FILE_BYTES) -> bytes:
    """Create ``path`` (0600, must not exist) holding ``num_bytes`` random bytes; return them.
    Raises FileExistsError rather than overwrite a secret other processes may be using,
    TypeError/ValueError for ``num_bytes`` not an int in [16, 2**20]."""
    num_bytes = check_int("num_bytes", num_bytes, MIN_SECRET_BYTES, _MAX_SECRET_FILE_BYTES)
    secret = secrets.token_bytes(num_bytes)
    fd = os.open(os.fspath(path), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as handle:
        handle.write(secret)
    return secret


def read_secret_file(path: str | os.PathLike[str]) -> bytes:
    """The cluster secret stored in ``path``. Raises FileNotFoundError, PermissionError for a
    file its group or others can access, ValueError for a secret under 16 bytes."""
    file = Path(path)
    mode = file.stat().st_mode
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise PermissionError(f"`path` must be accessible by its owner only (0600), got {oct(mode & 0o777)}")
    return check_secret(file.read_bytes())


# ---- capabilities ---------------------------------------------------------------------------
class Rights(IntFlag):
    """What a capability lets its bearer do (kRightWrite / kRightRead in the native header)."""

    WRITE = 1  # open, append, release; opening at a newer epoch fences the older writer
    READ = 2  # read; reading at a newer epoch fences the older writer too


@dataclass(frozen=True)
class CapabilityFields:
    """What a verified capability names; ``expires_at_ms`` is unix time in ms."""

    request_id: int
    shard: int
    epoch: int
    holder_id: int
    rights: Rights
    expires_at_ms: int


def _check_rights(rights: object) -> Rights:
    if isinstance(rights, bool) or not isinstance(rights, int):
        raise TypeError(f"`rights` must be a Rights, got {type(rights).__name__}")
    if not 0 < rights <= Rights.WRITE | Rights.READ:
        raise ValueError(
            f"`rights` must be a non-empty combination of Rights.WRITE and Rights.READ, got {rights}"
        )
    return Rights(rights)


class CapabilityIssuer:
    """Signs capabilities with an Ed25519 private key: each lets its bearer do ``rights`` on
    exactly one checkpoint (request_id, shard) at one epoch, on one holder (``holder_id``),
    until it expires ``ttl_s`` after it is issued (on this process's wall clock: holders
    read theirs, so clocks must agree to well within ``ttl_s``).

    Raises TypeError/ValueError for a key that is not 32 bytes, RuntimeError when the UCX
    module (the one home of the signing code) is missing.
    """

    def __init__(self, private_key: bytes, *, ttl_s: float = DEFAULT_CAPABILITY_TTL_S) -> None:
        key = check_bytes("private_key", private_key, ISSUER_KEY_BYTES)
        self.ttl_s = check_number("ttl_s", ttl_s, positive=True)
        self._native = _native.require_ucx().CapabilityIssuer(key)

    @classmethod
    def generate(cls, *, ttl_s: float = DEFAULT_CAPABILITY_TTL_S) -> CapabilityIssuer:
        """An issuer with a fresh random key (one gateway run; holders learn its public key)."""
        return cls(bytes(_native.require_ucx().generate_issuer_key()), ttl_s=ttl_s)

    @property
    def public_key(self) -> bytes:
        """The 32-byte Ed25519 public key holders verify with."""
        return bytes(self._native.public_key)

    def issue(
        self,
        request_id: int,
        shard: int,
        epoch: int,
        *,
        holder_id: int,
        rights: Rights = Rights.WRITE | Rights.READ,
        now_s: float | None = None,
    ) -> bytes:
        """The CAPABILITY_BYTES-byte capability; ``now_s`` (unix time, default the clock) plus
        ``ttl_s`` is its expiry. Raises TypeError/ValueError for ids outside u64/u32 or bad
        ``rights``."""
        issued_s = time.time() if now_s is None else check_number("now_s", now_s)
        return bytes(
            self._native.issue(
                request_id=check_int("request_id", request_id, 0, U64_MAX),
                shard=check_int("shard", shard, 0, U32_MAX),
                epoch=check_int("epoch", epoch, 0, U32_MAX),
                holder_id=check_int("holder_id", holder_id, 0, U64_MAX),
                rights=int(_check_rights(rights)),
                expires_at_ms=max(0, min(U64_MAX, int((issued_s + self.ttl_s) * 1000))),
            )
        )


def verify_capability(public_key: bytes, capability: bytes) -> CapabilityFields:
    """What ``capability`` names, if ``public_key`` verifies its signature (what a holder checks
    first; the holder then compares the fields with the request). Raises ValueError for a
    capability not signed by that key, tampered with, or not CAPABILITY_BYTES long."""
    fields = _native.require_ucx().verify_capability(
        check_bytes("public_key", public_key, ISSUER_KEY_BYTES),
        check_bytes("capability", capability, CAPABILITY_BYTES),
    )
    return CapabilityFields(**{**fields, "rights": Rights(fields["rights"])})


def write_issuer_key_file(path: str | os.PathLike[str]) -> bytes:
    """Create ``path`` (0600, must not exist) holding a fresh issuer private key; return it.
    Raises FileExistsError rather than overwrite a key in use."""
    key = bytes(_native.require_ucx().generate_issuer_key())
    fd = os.open(os.fspath(path), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as handle:
        handle.write(key)
    return key


def read_issuer_key_file(path: str | os.PathLike[str]) -> bytes:
    """The issuer private key in ``path``, checked as ``read_secret_file`` checks a secret
    (PermissionError for a file others can access), ValueError unless it is 32 bytes."""
    return check_bytes("issuer key", read_secret_file(path), ISSUER_KEY_BYTES)


def write_issuer_public_key_file(path: str | os.PathLike[str], public_key: bytes) -> None:
    """Write ``public_key`` to ``path`` as one line of hex (public: any mode)."""
    Path(path).write_text(check_bytes("public_key", public_key, ISSUER_KEY_BYTES).hex() + "\n")


def read_issuer_public_key_file(path: str | os.PathLike[str]) -> bytes:
    """The issuer public key written by ``write_issuer_public_key_file``. Raises
    FileNotFoundError, ValueError unless the file holds 64 hex digits."""
    text = Path(path).read_text().strip()
    try:
        key = bytes.fromhex(text)
    except ValueError:
        raise ValueError(
            f"issuer public key file must hold {2 * ISSUER_KEY_BYTES} hex digits, got {text[:80]!r}"
        ) from None
    return check_bytes("issuer public key", key, ISSUER_KEY_BYTES)


# ---- gateway calls --------------------------------------------------------------------------
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
    unseen. Thread-safe; remembers nonces for ``2 * max_skew_s`` (older ones fail the clock).
    Raises as ``check_secret``, TypeError/ValueError unless ``max_skew_s`` is a number > 0."""

    def __init__(self, secret: bytes, *, max_skew_s: float = 30.0) -> None:
        self._secret = check_secret(secret)
        self.max_skew_s = check_number("max_skew_s", max_skew_s, positive=True)
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
            if len(self._seen) > _MAX_REMEMBERED_NONCES:
                horizon = now_s - 2 * self.max_skew_s
                self._seen = {n: t for n, t in self._seen.items() if t >= horizon}
        return None


# ---- assist datagrams -----------------------------------------------------------------------
def seal(secret: bytes, message: dict[str, Any]) -> bytes:
    """``message`` as JSON behind its HMAC-SHA256 under the cluster secret (32 bytes of MAC,
    then the payload). ``secret`` is used as given: callers hold a checked one."""
    payload = json.dumps(message).encode()
    return hmac.new(secret, _SEAL_LABEL + payload, hashlib.sha256).digest() + payload


def unseal(secret: bytes, data: bytes) -> dict[str, Any] | None:
    """The message of a sealed datagram, or None if its MAC or its JSON is wrong, or the
    JSON is not an object."""
    mac, payload = data[:_MAC_BYTES], data[_MAC_BYTES:]
    expected = hmac.new(secret, _SEAL_LABEL + payload, hashlib.sha256).digest()
    if len(mac) != _MAC_BYTES or not hmac.compare_digest(mac, expected):
        return None
    try:
        message = json.loads(payload)
    except ValueError:
        return None
    return message if isinstance(message, dict) else None
