"""The cluster secret, the keys derived from it or issued beside it, and every MAC scheme
(docs/streaming.md; docs/security.md has the threat model).

- The cluster secret has no default: ``write_secret_file`` writes 32 random bytes to a new
  0600 file; ``read_secret_file`` opens it once (no symbolic link), then checks on what it
  opened that the caller owns it, that only the owner can access it, and that its directory
  cannot be written by others (unless sticky), and reads it from that same descriptor.
- Capabilities are not keyed by the secret: a ``CapabilityIssuer`` (the gateway, or a
  gateway-less vLLM server) signs them with an Ed25519 key no worker holds, through the
  native transport's one implementation (``csrc/transport/capability.cpp``); holders verify
  them with its public key. Key files: ``write_issuer_key_file`` / ``read_issuer_key_file``
  (the private key, a 0600 file like the secret's) and ``write_issuer_public_key_file`` /
  ``read_issuer_public_key_file`` (hex, for holders).
- Gateway calls: every gRPC call carries ``lumen-call-v3: <instance>.<principal>.<time
  us>.<nonce>.<mac>`` with ``mac = HMAC-SHA256(key, "lumen-gateway-v3|" instance "|"
  principal "|" method "|" time "|" nonce "|" body)``, ``body`` the serialized request.
  ``principal`` names the key: ``cluster`` (the cluster secret: registrations and the client
  API) or ``worker-<id>-<epoch>`` (the call key the gateway issued that worker incarnation
  at registration, sent wrapped by ``wrap_call_key`` under a pad that takes the cluster secret
  and the registration's X25519 exchange to compute: its every later call). ``instance``
  is the gateway's random id: a
  restarted gateway refuses what was signed for the one before. ``CallVerifier`` accepts a
  timestamp within ``max_skew_s`` of its clock and each nonce once. Each reply message is
  ``seal_reply``'s 32-byte MAC under the same key, bound to the call's value and the
  message's index in the reply, followed by the serialized reply (``open_reply`` checks
  it). Bodies are MAC'd, not encrypted (no TLS): the cluster network must keep them private.
- Assist datagrams: ``DatagramSeal`` prefixes JSON with
  ``HMAC-SHA256(secret, "lumen-assist-v2|" || payload)``; the payload names its sender and a
  counter, and a datagram whose counter is not above the last one opened from that sender is
  dropped (a replay).

The labels below are wire bytes: peers of another build must compute the same MACs.
Standard library only but for the issuer, which needs the UCX module when it signs (importing
this module never does), so the transport, the stream and the gateway all import it.
"""

from __future__ import annotations

import errno
import hashlib
import hmac
import json
import os
import secrets
import stat
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from enum import IntFlag
from pathlib import Path
from typing import Any, TypeVar

from lumen_core import _native
from lumen_core._validate import U32_MAX, U64_MAX, check_bytes, check_int, check_number

__all__ = [
    "CALL_METADATA_KEY",
    "CAPABILITY_BYTES",
    "CLUSTER_PRINCIPAL",
    "DEFAULT_CAPABILITY_TTL_S",
    "EXCHANGE_KEY_BYTES",
    "INSTANCE_METADATA_KEY",
    "ISSUER_KEY_BYTES",
    "MIN_SECRET_BYTES",
    "REPLY_MAC_BYTES",
    "SECRET_FILE_BYTES",
    "CallRefused",
    "CallVerifier",
    "CapabilityFields",
    "CapabilityIssuer",
    "CredentialTable",
    "DatagramSeal",
    "ReplyForged",
    "Rights",
    "WorkerIdentity",
    "check_exchange_key",
    "check_secret",
    "generate_exchange_key",
    "new_instance_id",
    "open_reply",
    "parse_worker_principal",
    "read_issuer_key_file",
    "read_issuer_public_key_file",
    "read_secret_file",
    "seal_reply",
    "sign_call",
    "unwrap_call_key",
    "verify_capability",
    "worker_principal",
    "wrap_call_key",
    "write_issuer_key_file",
    "write_issuer_public_key_file",
    "write_secret_file",
]

# One label per scheme, so that a MAC of one scheme is never valid in another.
_CALL_LABEL = b"lumen-gateway-v3|"
_REPLY_LABEL = b"lumen-reply-v3|"
_SEAL_LABEL = b"lumen-assist-v2|"
_CALL_KEY_LABEL = b"lumen-call-key-v2|"

CALL_METADATA_KEY = "lumen-call-v3"
REPLY_MAC_BYTES = 32  # before each reply message of a signed call
# Trailing metadata of a call refused for naming another gateway instance: the current one.
INSTANCE_METADATA_KEY = "lumen-gateway-instance"
CLUSTER_PRINCIPAL = "cluster"
MIN_SECRET_BYTES = 16
SECRET_FILE_BYTES = 32
_MAX_SECRET_FILE_BYTES = 1 << 20
_MAC_BYTES = 32
_NONCE_BYTES = 16
_INSTANCE_BYTES = 16
_CALL_KEY_BYTES = 32
_MAX_REMEMBERED_NONCES = 4096
CAPABILITY_BYTES = 128  # kCapabilityBytes in lumen/transport/capability.h
ISSUER_KEY_BYTES = 32  # an Ed25519 private key (seed) or public key
CREDENTIAL_BYTES = 128  # kCredentialBytes in lumen/transport/capability.h
EXCHANGE_KEY_BYTES = 32  # an X25519 private or public key (kExchangeKeyBytes, lumen/transport/wire.h)
# Long enough for any request the tests and the demo run; a longer one is renewed by opening
# its checkpoint again at the same epoch with a fresh capability.
DEFAULT_CAPABILITY_TTL_S = 3600.0
_EPOCHS_KEPT = 2  # a superseded incarnation still authenticates, so it learns that it is fenced


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
            f"`path` must be in a directory owned by this user ({os.geteuid()}) or root, got owner "
            f"{info.st_uid}"
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
    bearer: int | None  # the one worker whose connections may use it; None: any


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
        return cls(bytes(_native.require_ucx().generate_ed25519_key()), ttl_s=ttl_s)

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
        bearer: int | None = None,
        now_s: float | None = None,
    ) -> bytes:
        """The CAPABILITY_BYTES-byte capability; ``now_s`` (unix time, default the clock) plus
        ``ttl_s`` is its expiry. With ``bearer`` (a worker id) only connections that prove
        that worker's credential may use it (``WorkerIdentity``); without, any connection
        that proves the cluster secret. Raises TypeError/ValueError for ids outside u64/u32
        or bad ``rights``."""
        issued_s = time.time() if now_s is None else check_number("now_s", now_s)
        return bytes(
            self._native.issue(
                request_id=check_int("request_id", request_id, 0, U64_MAX),
                shard=check_int("shard", shard, 0, U32_MAX),
                epoch=check_int("epoch", epoch, 0, U32_MAX),
                holder_id=check_int("holder_id", holder_id, 0, U64_MAX),
                rights=int(_check_rights(rights)),
                expires_at_ms=max(0, min(U64_MAX, int((issued_s + self.ttl_s) * 1000))),
                bearer=None if bearer is None else check_int("bearer", bearer, 0, U64_MAX),
            )
        )

    def issue_credential(self, worker_id: int, epoch: int, public_key: bytes) -> bytes:
        """The CREDENTIAL_BYTES-byte credential saying that ``public_key`` (Ed25519) speaks for
        worker ``worker_id``, issued at its registration ``epoch``. Raises TypeError/ValueError
        for ids outside u64/u32 or a key that is not 32 bytes."""
        return bytes(
            self._native.issue_credential(
                worker_id=check_int("worker_id", worker_id, 0, U64_MAX),
                epoch=check_int("epoch", epoch, 0, U32_MAX),
                public_key=check_bytes("public_key", public_key, ISSUER_KEY_BYTES),
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


@dataclass(frozen=True)
class CredentialFields:
    """What a verified worker credential names."""

    worker_id: int
    epoch: int
    public_key: bytes


def verify_credential(public_key: bytes, credential: bytes) -> CredentialFields:
    """What ``credential`` names, if the issuer key ``public_key`` verifies its signature.
    Raises ValueError for one not signed by that key, tampered with, or not
    CREDENTIAL_BYTES long."""
    fields = _native.require_ucx().verify_credential(
        check_bytes("public_key", public_key, ISSUER_KEY_BYTES),
        check_bytes("credential", credential, CREDENTIAL_BYTES),
    )
    return CredentialFields(**fields)


_Identity = TypeVar("_Identity", bound="WorkerIdentity")  # the class (or subclass) constructed


class WorkerIdentity:
    """A worker's Ed25519 key pair, drawn once per process, and the credential the issuer
    signed for it at the worker's latest registration.

    The private key never leaves the process: the public key goes to the gateway in
    ``Register``, the credential comes back, and every connection to a holder opened after
    that proves it (``transport.Client(identity=...)``), which capabilities bound to this
    worker require. ``credential`` is replaced at each registration; connections already
    open keep the identity they proved.
    """

    def __init__(self, private_key: bytes | None = None) -> None:
        ucx = _native.require_ucx()
        key = bytes(ucx.generate_ed25519_key()) if private_key is None else private_key
        self._private_key = check_bytes("private_key", key, ISSUER_KEY_BYTES)
        self.public_key = bytes(ucx.ed25519_public_key(self._private_key))
        self._credential: bytes | None = None

    @classmethod
    def from_key_file(cls: type[_Identity], path: str | os.PathLike[str], **options: Any) -> _Identity:
        """The identity whose private key ``path`` holds (checked as ``read_secret_file``
        checks a secret): how the processes of one vLLM server and its agent share one.
        ``options`` go to the constructor (of a subclass)."""
        return cls(check_bytes("identity key", read_secret_file(path), ISSUER_KEY_BYTES), **options)

    @classmethod
    def create_key_file(cls: type[_Identity], path: str | os.PathLike[str], **options: Any) -> _Identity:
        """A fresh identity, its private key written to ``path`` (0600, must not exist)."""
        return cls(_create_key_file(path), **options)

    @property
    def credential(self) -> bytes | None:
        """The credential of the latest registration, None before the first."""
        return self._credential

    def accept(self, credential: bytes, issuer_public_key: bytes, worker_id: int) -> None:
        """Takes the credential a registration returned, once ``issuer_public_key`` verifies
        it and it names this key and ``worker_id``; ValueError otherwise."""
        fields = verify_credential(issuer_public_key, credential)
        if fields.public_key != self.public_key or fields.worker_id != worker_id:
            raise ValueError(
                f"the credential names worker {fields.worker_id} and another key; this is worker {worker_id}"
            )
        self._credential = bytes(credential)

    def native_kwargs(self) -> dict[str, bytes]:
        """What a native ``Client`` takes: nothing before the first credential."""
        if self._credential is None:
            return {}
        return {"credential": self._credential, "identity_key": self._private_key}

    def __repr__(self) -> str:  # never the private key
        held = self._credential is not None
        return f"WorkerIdentity(public_key={self.public_key.hex()[:16]}..., credential={held})"


def _create_key_file(path: str | os.PathLike[str]) -> bytes:
    """A fresh Ed25519 private key written to ``path`` (0600, must not exist: FileExistsError
    rather than overwrite a key in use)."""
    key = bytes(_native.require_ucx().generate_ed25519_key())
    fd = os.open(os.fspath(path), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as handle:
        handle.write(key)
    return key


def write_issuer_key_file(path: str | os.PathLike[str]) -> bytes:
    """Create ``path`` (0600, must not exist) holding a fresh issuer private key; return it.
    Raises FileExistsError rather than overwrite a key in use."""
    return _create_key_file(path)


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
def new_instance_id() -> str:
    """A gateway instance's random id (hex): what its call MACs are bound to."""
    return secrets.token_hex(_INSTANCE_BYTES)


def worker_principal(worker_id: int, epoch: int) -> str:
    """The principal of the call key issued to worker incarnation (``worker_id``, ``epoch``).
    Raises TypeError/ValueError for an id outside [0, 2**31) or an epoch outside u32."""
    worker_id = check_int("worker_id", worker_id, 0, 2**31 - 1)
    return f"worker-{worker_id}-{check_int('epoch', epoch, 0, U32_MAX)}"


def parse_worker_principal(principal: str) -> tuple[int, int] | None:
    """(worker id, epoch) of a worker principal; None for any other string."""
    prefix, _, rest = principal.partition("-")
    worker, _, epoch = rest.partition("-")
    if prefix != "worker" or not worker.isdigit() or not epoch.isdigit():
        return None
    if f"worker-{int(worker)}-{int(epoch)}" != principal or int(epoch) > U32_MAX:
        return None  # one spelling per principal: no leading zeros
    return int(worker), int(epoch)


def _call_mac(
    key: bytes, instance_id: str, principal: str, method: str, timestamp: str, nonce: str, body: bytes
) -> str:
    # No field can hold "|" (hex, digits, principals, gRPC method paths), and the body comes
    # last: the message parses one way only.
    head = f"{instance_id}|{principal}|{method}|{timestamp}|{nonce}".encode()
    return hmac.new(key, _CALL_LABEL + head + b"|" + body, hashlib.sha256).hexdigest()


def sign_call(
    key: bytes,
    *,
    instance_id: str,
    principal: str,
    method: str,
    body: bytes,
    now_s: float | None = None,
) -> str:
    """The ``lumen-call-v3`` metadata value for one call of ``method`` (the full gRPC method
    name, e.g. "/lumen.gateway.v1.Gateway/Heartbeat") with serialized request ``body``, to
    gateway ``instance_id``, under ``key`` (the cluster secret for ``CLUSTER_PRINCIPAL``, a
    worker's call key for its ``worker_principal``). Raises TypeError for a key or body that
    is not bytes, ValueError for a key under 16 bytes or an id or principal with a "." or "|"."""
    key = check_secret(key)
    body = check_bytes("body", body)
    for name, value in (("instance_id", instance_id), ("principal", principal), ("method", method)):
        if not isinstance(value, str):
            raise TypeError(f"`{name}` must be a str, got {type(value).__name__}")
        if not value or "|" in value or ("." in value and name != "method"):
            raise ValueError(f"`{name}` must be non-empty without '.' or '|', got {value!r}")
    timestamp = str(int((time.time() if now_s is None else now_s) * 1e6))
    nonce = secrets.token_hex(_NONCE_BYTES)
    mac = _call_mac(key, instance_id, principal, method, timestamp, nonce, body)
    return f"{instance_id}.{principal}.{timestamp}.{nonce}.{mac}"


def _reply_mac(key: bytes, call_value: str, index: int, body: bytes) -> bytes:
    # The call's value names instance, principal and nonce, and its MAC covers method and
    # request: a reply sealed for one call is valid for no other (nonces are used once).
    head = f"{call_value}|{index}|".encode()
    return hmac.new(key, _REPLY_LABEL + head + body, hashlib.sha256).digest()


def seal_reply(key: bytes, call_value: str, index: int, body: bytes) -> bytes:
    """Reply message ``index`` (0 for a unary reply, its position in a stream) of the call
    signed ``call_value``, serialized as ``body``, as it travels: its MAC under the call's
    key, then ``body``. The gateway seals every reply of a call it verified."""
    return _reply_mac(key, call_value, index, body) + body


class ReplyForged(Exception):
    """A reply message whose MAC does not verify: not what the gateway sent for this call."""


def open_reply(key: bytes, call_value: str, index: int, data: bytes) -> bytes:
    """The serialized reply in ``data`` (what ``seal_reply`` made for this call and index);
    raises ReplyForged if its MAC does not verify under ``key``."""
    if len(data) < REPLY_MAC_BYTES:
        raise ReplyForged(f"reply {index} has {len(data)} bytes, under its {REPLY_MAC_BYTES}-byte MAC")
    mac, body = data[:REPLY_MAC_BYTES], data[REPLY_MAC_BYTES:]
    if not hmac.compare_digest(_reply_mac(key, call_value, index, body), mac):
        raise ReplyForged(f"reply {index}'s MAC does not verify: altered on the way or not the gateway's")
    return body


class CallRefused(Exception):
    """A call that does not authenticate; ``stale_instance`` when it was signed for another
    gateway instance (the caller learns the current one and, as a worker, registers again)."""

    def __init__(self, reason: str, *, stale_instance: bool = False) -> None:
        super().__init__(reason)
        self.reason = reason
        self.stale_instance = stale_instance


class CallVerifier:
    """Checks ``lumen-call-v3`` values for gateway ``instance_id``: this instance, a known
    principal, a valid MAC over the header and the body, a timestamp within ``max_skew_s``,
    an unseen nonce. Thread-safe; remembers nonces for ``2 * max_skew_s`` (older ones fail
    the clock). Raises TypeError/ValueError unless ``max_skew_s`` is a number > 0."""

    def __init__(self, instance_id: str, *, max_skew_s: float = 30.0) -> None:
        if not isinstance(instance_id, str) or not instance_id:
            raise ValueError(f"`instance_id` must be a non-empty str, got {instance_id!r}")
        self.instance_id = instance_id
        self.max_skew_s = check_number("max_skew_s", max_skew_s, positive=True)
        self._seen: dict[str, float] = {}
        self._lock = threading.Lock()
        self.num_refused = 0

    @property
    def num_nonces(self) -> int:
        """Nonces remembered now (bounded: old ones are pruned)."""
        with self._lock:
            return len(self._seen)

    def verify(
        self,
        method: str,
        value: str | None,
        body: bytes,
        key_of: Callable[[str], bytes | None],
        *,
        now_s: float | None = None,
    ) -> str:
        """The principal of an authentic call; raises CallRefused (counted in
        ``num_refused``) otherwise. ``key_of(principal)`` is the key that principal holds,
        or None for one this gateway does not know."""
        try:
            return self._check(method, value, body, key_of, time.time() if now_s is None else now_s)
        except CallRefused:
            with self._lock:
                self.num_refused += 1
            raise

    def _check(
        self, method: str, value: str | None, body: bytes, key_of: Callable[[str], bytes | None], now_s: float
    ) -> str:
        if not value:
            raise CallRefused(f"missing {CALL_METADATA_KEY} metadata")
        parts = value.split(".")
        if len(parts) != 5:
            raise CallRefused(f"malformed {CALL_METADATA_KEY} metadata")
        instance_id, principal, timestamp, nonce, mac = parts
        if instance_id != self.instance_id:
            raise CallRefused(
                f"signed for gateway instance {instance_id[:32]!r}, this is {self.instance_id}",
                stale_instance=True,
            )
        key = key_of(principal)
        if key is None:
            raise CallRefused(f"unknown principal {principal[:40]!r} at this gateway instance")
        if not hmac.compare_digest(
            _call_mac(key, instance_id, principal, method, timestamp, nonce, body), mac
        ):
            raise CallRefused(f"bad MAC: the caller does not hold the key of {principal}")
        if not timestamp.isdigit():
            raise CallRefused("malformed timestamp")
        sent_s = int(timestamp) / 1e6
        if abs(now_s - sent_s) > self.max_skew_s:
            raise CallRefused(
                f"timestamp {sent_s:.3f} is more than {self.max_skew_s} s from now ({now_s:.3f})"
            )
        with self._lock:
            if nonce in self._seen:
                raise CallRefused("nonce replayed")
            self._seen[nonce] = sent_s
            if len(self._seen) > _MAX_REMEMBERED_NONCES:
                horizon = now_s - 2 * self.max_skew_s
                self._seen = {n: t for n, t in self._seen.items() if t >= horizon}
        return principal


def generate_exchange_key() -> tuple[bytes, bytes]:
    """A fresh X25519 key pair (private, public), EXCHANGE_KEY_BYTES each, for one registration's
    key exchange. Raises RuntimeError without the UCX module (the one home of the code)."""
    private_key, public_key = _native.require_ucx().generate_exchange_key()
    return bytes(private_key), bytes(public_key)


def check_exchange_key(name: str, public_key: bytes) -> bytes:
    """``public_key`` if it is an X25519 public key a key exchange can use; TypeError/ValueError
    otherwise (not EXCHANGE_KEY_BYTES bytes, or a low-order point, whose shared secret with any
    key is zero). RuntimeError without the UCX module."""
    public_key = check_bytes(name, public_key, EXCHANGE_KEY_BYTES)
    try:
        _native.require_ucx().exchange_shared_secret(generate_exchange_key()[0], public_key)
    except RuntimeError:
        raise ValueError(f"`{name}` must be a usable X25519 public key, got a low-order point") from None
    return public_key


def _call_key_pad(
    secret: bytes,
    salt: bytes,
    instance_id: str,
    principal: str,
    *,
    private_key: bytes,
    peer_public_key: bytes,
    worker_public_key: bytes,
    gateway_public_key: bytes,
) -> bytes:
    try:
        shared = bytes(
            _native.require_ucx().exchange_shared_secret(
                check_bytes("private_key", private_key, EXCHANGE_KEY_BYTES),
                check_bytes("peer_public_key", peer_public_key, EXCHANGE_KEY_BYTES),
            )
        )
    except RuntimeError as exc:  # a low-order point: no shared secret
        raise ValueError(f"the peer's exchange key must be a usable X25519 key: {exc}") from None
    message = _CALL_KEY_LABEL + f"{instance_id}|{principal}|".encode() + salt
    message += shared + worker_public_key + gateway_public_key
    return hmac.new(secret, message, hashlib.sha256).digest()


def wrap_call_key(
    secret: bytes, key: bytes, *, instance_id: str, principal: str, worker_exchange_key: bytes
) -> tuple[bytes, bytes, bytes]:
    """(salt, wrapped key, the gateway's exchange public key) for sending a 32-byte call key to
    the worker that registered with X25519 public key ``worker_exchange_key``: the key XOR
    ``HMAC-SHA256(secret, "lumen-call-key-v2|" instance "|" principal "|" salt || X25519 shared
    secret || worker key || gateway key)``, with a fresh 16-byte salt and a fresh gateway key
    pair (a pseudorandom one-time pad). Computing the pad takes the cluster secret *and* one of
    the two private keys, so a worker that reads the reply on the network, though it holds the
    secret, does not learn the key. Raises as ``check_secret``, TypeError/ValueError for a key
    that is not 32 bytes or an exchange key that is not a usable X25519 public key."""
    key = check_bytes("key", key, _CALL_KEY_BYTES)
    worker_exchange_key = check_bytes("worker_exchange_key", worker_exchange_key, EXCHANGE_KEY_BYTES)
    private_key, public_key = generate_exchange_key()
    salt = secrets.token_bytes(_NONCE_BYTES)
    pad = _call_key_pad(
        check_secret(secret),
        salt,
        instance_id,
        principal,
        private_key=private_key,
        peer_public_key=worker_exchange_key,
        worker_public_key=worker_exchange_key,
        gateway_public_key=public_key,
    )
    return salt, bytes(a ^ b for a, b in zip(key, pad, strict=True)), public_key


def unwrap_call_key(
    secret: bytes,
    wrapped: bytes,
    salt: bytes,
    *,
    instance_id: str,
    principal: str,
    exchange_key: tuple[bytes, bytes],
    gateway_exchange_key: bytes,
) -> bytes:
    """The call key ``wrap_call_key`` wrapped for the worker whose key pair (private, public) is
    ``exchange_key``. Raises as ``check_secret``, TypeError/ValueError for a wrapped key that
    is not 32 bytes, a salt that is not 16 or an exchange key that is not 32 or not usable (a
    tampered reply just gives a key whose calls are refused)."""
    wrapped = check_bytes("wrapped", wrapped, _CALL_KEY_BYTES)
    private_key, public_key = exchange_key
    pad = _call_key_pad(
        check_secret(secret),
        check_bytes("salt", salt, _NONCE_BYTES),
        instance_id,
        principal,
        private_key=private_key,
        peer_public_key=check_bytes("gateway_exchange_key", gateway_exchange_key, EXCHANGE_KEY_BYTES),
        worker_public_key=check_bytes("exchange_key[1]", public_key, EXCHANGE_KEY_BYTES),
        gateway_public_key=gateway_exchange_key,
    )
    return bytes(a ^ b for a, b in zip(wrapped, pad, strict=True))


class CredentialTable:
    """The call keys a gateway instance issued: 32 random bytes per worker incarnation, the
    newest ``_EPOCHS_KEPT`` incarnations of each worker id (a superseded one still
    authenticates and is told it is fenced; older ones are refused). Thread-safe; held in
    memory only, so a restarted gateway knows none (its workers register again)."""

    def __init__(self) -> None:
        self._keys: dict[int, dict[int, bytes]] = {}
        self._lock = threading.Lock()

    def issue(self, worker_id: int, epoch: int) -> bytes:
        """A new key for (``worker_id``, ``epoch``), replacing any it had. Raises as
        ``worker_principal``."""
        worker_principal(worker_id, epoch)
        key = secrets.token_bytes(_CALL_KEY_BYTES)
        with self._lock:
            epochs = self._keys.setdefault(worker_id, {})
            epochs[epoch] = key
            for old in sorted(epochs)[:-_EPOCHS_KEPT]:
                del epochs[old]
        return key

    def key_of(self, principal: str) -> bytes | None:
        """The key of a worker principal, None if it names no incarnation kept here."""
        parsed = parse_worker_principal(principal)
        if parsed is None:
            return None
        with self._lock:
            return self._keys.get(parsed[0], {}).get(parsed[1])


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
