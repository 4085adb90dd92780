"""Python face of the native UCX transport: moves checkpoint bytes, knows no layout or policy.

A ``Server`` (``server``) listens (on 127.0.0.1 unless given an address) and keeps what
authenticated clients append in a ``RecordSink`` it is given (the holder's store); a ``Client``
(``client``) connects, proves the cluster secret, and opens, appends to, reads and releases
checkpoints keyed by (request_id, shard), each as far as a capability signed by the issuer
(``lumen_core.auth.CapabilityIssuer``) grants on that holder; ``wire`` has the limits both ends
enforce; a ``ClientPool`` (``pool``) keeps connections to many holders open for reuse. The data
path (send, receive, crc check) runs in C++ on a progress thread with no GIL. Failures raise
the typed errors of ``errors``.
"""

from __future__ import annotations

from lumen_core.transport.client import Client, ReadResult, SelfTest
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
from lumen_core.transport.pool import ClientPool
from lumen_core.transport.server import RecordSink, Server
from lumen_core.transport.wire import CAPABILITY_BYTES, FINGERPRINT_BYTES, WireLimits

__all__ = [
    "CAPABILITY_BYTES",
    "FINGERPRINT_BYTES",
    "Aborted",
    "Client",
    "ClientPool",
    "Conflict",
    "Malformed",
    "PeerGone",
    "ReadResult",
    "RecordSink",
    "Rejected",
    "SelfTest",
    "Server",
    "StaleEpoch",
    "Timeout",
    "TransportError",
    "WireLimits",
]
