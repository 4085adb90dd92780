"""The cluster secret and every HMAC scheme keyed by it (DESIGN.md section 3.3).

- The cluster secret has no default: ``write_secret_file`` writes 32 random bytes to a new
  0600 file; ``read_secret_file`` opens it once (no symbolic link), then checks on what it
  opened that the caller owns it, that only the owner can access it, and that its directory
  cannot be written by others (unless sticky), and reads it from that same descriptor.
- Capabilities: ``issue_capability`` reproduces the native transport's capability bytes
  (``csrc/transport/auth.cpp``) in pure Python:
  ``HMAC-SHA256(secret, "lumen-cap-v1" || request_id u64 LE || shard u32 LE || epoch u32 LE)``.
- Gateway calls: every gRPC call carries ``lumen-auth-v1: <unix time>.<nonce hex>.<mac hex>``
  with ``mac = HMAC-SHA256(secret, "lumen-gateway-v1|" method "|" time "|" nonce)``. The
  gateway accepts a timestamp within ``max_skew_s`` of its clock and each nonce once, so a
  captured header cannot be replayed and a peer without the secret cannot call at all. The
  message bodies are neither encrypted nor MAC'd (no TLS): the cluster network must keep
  them private.
- Assist datagrams: ``DatagramSeal`` prefixes JSON with
  ``HMAC-SHA256(secret, "lumen-assist-v2|" || payload)``; the payload names its sender and a
  counter, and a datagram whose counter is not above the last one opened from that sender is
  dropped (a replay).

The labels below are wire bytes: peers of another build must compute the same MACs.
Standard library only, so the transport, the stream and the gateway all import it.
"""

from __future__ import annotations

import errno
import hashlib
import hmac
import json
import os
import secrets
import stat
import struct
import threading
import time
from pathlib import Path
from typing import Any

from lumen_core._validate import U32_MAX, U64_MAX, check_bytes, check_int, check_number

__all__ = [
    "AUTH_METADATA_KEY",
    "MIN_SECRET_BYTES",
    "SECRET_FILE_BYTES",
    "CallVerifier",
    "DatagramSeal",
    "check_secret",
    "issue_capability",
    "read_secret_file",
    "sign_call",
    "write_secret_file",
]

# One label per scheme, so that a MAC of one scheme is never valid in another.
_CAPABILITY_LABEL = b"lumen-cap-v1"  # also kLabel in csrc/transport/auth.cpp
_CALL_LABEL = b"lumen-gateway-v1|"
_SEAL_LABEL = b"lumen-assist-v2|"

AUTH_METADATA_KEY = "lumen-auth-v1"
MIN_SECRET_BYTES = 16
SECRET_FILE_BYTES = 32
_MAX_SECRET_FILE_BYTES = 1 << 20
_MAC_BYTES = 32
_NONCE_BYTES = 16
_MAX_REMEMBERED_NONCES = 4096


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
    """The cluster secret stored in ``path``, read from one descriptor opened without
    following a final symbolic link, after checking on what was opened that the file is a
    regular file owned by the caller with no group or other permission bits, in a directory
    owned by the caller or root that its group and others cannot write to (a sticky one such
    as /tmp excepted: there nobody else can rename or replace the caller's file, and a file
    planted there first fails the owner check). Raises FileNotFoundError, PermissionError
    for a link or a check that fails, ValueError for a secret under 16 bytes."""
    file = Path(path)
    dir_fd = os.open(file.parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        _check_secret_directory(os.fstat(dir_fd))
        try:  # O_NONBLOCK: a FIFO planted in its place must not block the open
            fd = os.open(file.name, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK, dir_fd=dir_fd)
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                raise PermissionError(
                    f"`path` must not be a symbolic link, got {os.fspath(path)!r}"
                ) from None
            raise
    finally:
        os.close(dir_fd)
    with os.fdopen(fd, "rb") as handle:
        _check_secret_inode(os.fstat(handle.fileno()))
        return check_secret(handle.read(_MAX_SECRET_FILE_BYTES + 1))


def _check_secret_directory(info: os.stat_result) -> None:
    if info.st_uid not in (os.geteuid(), 0):
        raise PermissionError(
            f"`path` must be in a directory owned by this user ({os.geteuid()}) or root, got owner {info.st_uid}"
        )
    if info.st_mode & (stat.S_IWGRP | stat.S_IWOTH) and not info.st_mode & stat.S_ISVTX:
        raise PermissionError(
            "`path` must be in a directory its group and others cannot write to (or a sticky one), "
            f"got {oct(stat.S_IMODE(info.st_mode))}"
        )


def _check_secret_inode(info: os.stat_result) -> None:
    if not stat.S_ISREG(info.st_mode):
        raise PermissionError(f"`path` must be a regular file, got mode {oct(info.st_mode)}")
    if info.st_uid != os.geteuid():
        raise PermissionError(f"`path` must be owned by this user ({os.geteuid()}), got owner {info.st_uid}")
    if info.st_mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise PermissionError(
            f"`path` must be accessible by its owner only (0600), got {oct(stat.S_IMODE(info.st_mode))}"
        )


# ---- capabilities ---------------------------------------------------------------------------
def issue_capability(secret: bytes, request_id: int, shard: int, epoch: int) -> bytes:
    """The 32-byte capability that lets a peer open, append to, read and release exactly the
    checkpoint (request_id, shard) at this epoch; byte-identical to the native transport's.
    Raises as ``check_secret``, TypeError/ValueError for an id outside u64/u32."""
    key = check_secret(secret)
    message = _CAPABILITY_LABEL + struct.pack(
        "<QII",
        check_int("request_id", request_id, 0, U64_MAX),
        check_int("shard", shard, 0, U32_MAX),
        check_int("epoch", epoch, 0, U32_MAX),
    )
    return hmac.new(key, message, hashlib.sha256).digest()


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
class DatagramSeal:
    """One assist endpoint's seal and opener. ``seal`` gives a message as JSON behind its
    HMAC-SHA256 under the cluster secret (32 bytes of MAC, then the payload
    ``{"s": sender id, "n": counter, "m": message}``), counting up from 1 under this
    endpoint's random sender id. ``open`` returns the message of a datagram whose MAC and
    JSON are right and whose counter is above the last one opened from its sender; it drops
    and counts the others (``num_refused``: MAC, JSON or shape; ``num_replayed``: an old
    counter). Thread-safe. Raises as ``check_secret``."""

    def __init__(self, secret: bytes) -> None:
        self._secret = check_secret(secret)
        self.sender_id = secrets.token_hex(8)
        self._counter = 0
        self._last: dict[str, int] = {}  # sender -> highest counter opened; MAC'd senders only
        self._lock = threading.Lock()
        self.num_refused = 0
        self.num_replayed = 0

    def seal(self, message: dict[str, Any]) -> bytes:
        with self._lock:
            self._counter += 1
            counter = self._counter
        payload = json.dumps({"s": self.sender_id, "n": counter, "m": message}).encode()
        return hmac.new(self._secret, _SEAL_LABEL + payload, hashlib.sha256).digest() + payload

    def open(self, data: bytes) -> dict[str, Any] | None:
        envelope = self._verified(data)
        with self._lock:
            if envelope is None:
                self.num_refused += 1
                return None
            sender, counter, message = envelope
            if counter <= self._last.get(sender, 0):
                self.num_replayed += 1
                return None
            self._last[sender] = counter
        return message

    def _verified(self, data: bytes) -> tuple[str, int, dict[str, Any]] | None:
        mac, payload = data[:_MAC_BYTES], data[_MAC_BYTES:]
        expected = hmac.new(self._secret, _SEAL_LABEL + payload, hashlib.sha256).digest()
        if len(mac) != _MAC_BYTES or not hmac.compare_digest(mac, expected):
            return None
        try:
            envelope = json.loads(payload)
        except ValueError:
            return None
        if not isinstance(envelope, dict):
            return None
        sender, counter, message = envelope.get("s"), envelope.get("n"), envelope.get("m")
        if not isinstance(sender, str) or type(counter) is not int or not isinstance(message, dict):
            return None
        return sender, counter, message
