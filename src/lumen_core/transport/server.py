"""The receiving end of the transport: a listener whose authenticated clients' checkpoints go
into a record sink (lumen/transport/server.h, lumen/transport/sink.h)."""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

from lumen_core import _native
from lumen_core._validate import U64_MAX, check_bytes, check_int
from lumen_core.auth import ISSUER_KEY_BYTES, check_secret
from lumen_core.transport._checks import check_timeout
from lumen_core.transport.wire import WireLimits


@runtime_checkable
class RecordSink(Protocol):
    """Where a ``Server`` keeps what it receives: an object whose ``_native`` is a native
    store implementing ``lumen::transport::RecordSink`` (ordering, placing and keeping
    records). ``lumen_core.stream.HolderStore`` is one; the transport knows no more of it."""

    _native: Any


class Server:
    """A listener keeping appended checkpoints in ``store`` (a ``RecordSink``, e.g. a
    ``lumen_core.stream.HolderStore``, whose budget then bounds what clients can make it hold).

    Runs its own UCX progress thread; ``stats()`` returns the counters of every refusal.
    ``tls`` sets UCX_TLS for this server only ("" leaves UCX's choice). A connection that has
    not proven the secret within ``handshake_timeout_s`` of being accepted is dropped, whatever
    it sent (plain TCP included); past ``max_unauthenticated`` such connections, new ones are
    closed at once (counted as ``connections_refused``). So is a connection with an
    append whose payload has not all arrived within ``receive_timeout_s`` (its writer stalled):
    the receive fails and the store gets its memory back.

    Every open, read and release must carry a capability that ``issuer_public_key`` verifies
    (``lumen_core.auth.CapabilityIssuer``) and that names this holder (``holder_id``), the
    checkpoint, its epoch and the right to do it, unexpired; an append must repeat the
    capability its connection's open verified. Without a key (``trust_issuer`` sets one later)
    every capability is refused.

    Raises TypeError/ValueError for bad arguments and RuntimeError when UCX cannot listen.
    """

    def __init__(
        self,
        secret: bytes,
        *,
        store: RecordSink,
        holder_id: int = 0,
        issuer_public_key: bytes | None = None,
        address: str = "127.0.0.1",
        port: int = 0,
        tls: str = "",
        limits: WireLimits = WireLimits(),
        verify_records: bool = True,
        handshake_timeout_s: float = 10.0,
        max_unauthenticated: int = 64,
        receive_timeout_s: float = 30.0,
    ) -> None:
        key = check_secret(secret)
        if not isinstance(address, str):
            raise TypeError(f"address must be a str, got {type(address).__name__}")
        check_int("port", port, 0, 65535)
        if not isinstance(tls, str):
            raise TypeError(f"tls must be a str, got {type(tls).__name__}")
        if not isinstance(limits, WireLimits):
            raise TypeError(f"limits must be a WireLimits, got {type(limits).__name__}")
        native = _native.require_ucx()
        # The holder's store is the one native sink; its binding builds the server over it.
        if not isinstance(store, RecordSink) or not isinstance(store._native, native.HolderStore):
            raise TypeError(f"store must be a HolderStore or another RecordSink, got {type(store).__name__}")
        if issuer_public_key is not None:
            issuer_public_key = check_bytes("issuer_public_key", issuer_public_key, ISSUER_KEY_BYTES)
        options = native.ServerOptions(
            secret=key,
            holder_id=check_int("holder_id", holder_id, 0, U64_MAX),
            issuer_public_key=issuer_public_key,
            address=address,
            port=port,
            tls=tls,
            verify_records=bool(verify_records),
            handshake_timeout_s=check_timeout(handshake_timeout_s, "handshake_timeout_s"),
            max_unauthenticated=check_int("max_unauthenticated", max_unauthenticated, 1, 1 << 16),
            receive_timeout_s=check_timeout(receive_timeout_s, "receive_timeout_s"),
            **limits._kwargs(),
        )
        self._native = native.serve_holder_store(store._native, options)
        self.address = address
        self.store = store

    @property
    def port(self) -> int:
        """The port listened on (the one the OS chose when constructed with port 0)."""
        return int(self._native.port)

    def trust_issuer(self, public_key: bytes) -> None:
        """Verify capabilities with ``public_key`` from now on (replacing any key given before:
        capabilities of the old issuer are refused from then on)."""
        self._native.trust_issuer(check_bytes("public_key", public_key, ISSUER_KEY_BYTES))

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
