"""Authenticated connections to holders kept open and reused, one per address.

Connecting costs a UCX connection and the secret handshake (tens of milliseconds, more on a
loaded host); a restore lookup or read over an open connection costs one round trip. Callers
that read from many holders over time (the connectors' restore paths) go through a pool.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from typing import TypeVar

from lumen_core._validate import check_int
from lumen_core.auth import WorkerIdentity, check_secret
from lumen_core.transport._checks import check_timeout
from lumen_core.transport.client import Client
from lumen_core.transport.errors import PeerGone

__all__ = ["ClientPool"]

T = TypeVar("T")
Address = tuple[str, int]


class ClientPool:
    """Connections to holders keyed by ``(host, port)``, opened on first use and reused until
    they fail. At most ``max_connections`` stay open, the least recently used closed first:
    request parameters name the addresses, so their number is not the pool's to trust.

    Connections prove ``identity`` (when given and it holds a credential) as they open, and
    with ``encrypt`` carry their records in AES-256-GCM (``Client``).

    Not thread-safe: one pool per thread that uses it.
    """

    def __init__(
        self,
        secret: bytes,
        *,
        tls: str = "",
        connect_timeout_s: float = 2.0,
        max_connections: int = 64,
        identity: WorkerIdentity | None = None,
        encrypt: bool = False,
    ) -> None:
        self._secret = check_secret(secret)
        self._identity = identity
        self._encrypt = encrypt
        self._tls = tls
        self._connect_timeout_s = check_timeout(connect_timeout_s, "connect_timeout_s")
        self._max = check_int("max_connections", max_connections, 1, 1 << 16)
        self._clients: OrderedDict[Address, Client] = OrderedDict()

    def __len__(self) -> int:
        return len(self._clients)

    def _client(self, address: Address) -> Client:
        client = self._clients.get(address)
        if client is not None and client.connected:
            self._clients.move_to_end(address)
            return client
        self._drop(address)
        client = Client(
            address[0],
            address[1],
            self._secret,
            tls=self._tls,
            connect_timeout_s=self._connect_timeout_s,
            identity=self._identity,
            encrypt=self._encrypt,
        )
        self._clients[address] = client
        while len(self._clients) > self._max:
            _, oldest = self._clients.popitem(last=False)
            oldest.close()
        return client

    def _drop(self, address: Address) -> None:
        client = self._clients.pop(address, None)
        if client is not None:
            client.close()

    def call(self, address: Address, operation: Callable[[Client], T]) -> T:
        """``operation(client)`` over the pooled connection to ``address``.

        A connection the holder closed since its last use (``PeerGone``: a restarted holder)
        is replaced once and ``operation`` run again, so it must be safe to repeat (reads and
        restores are). Raises the ``TransportError`` of a connect that fails or of the call;
        a connection that failed is closed and dropped, one that was refused is kept.
        """
        client = self._client(address)
        try:
            return operation(client)
        except PeerGone:
            self._drop(address)
            client = self._client(address)
            return operation(client)
        finally:
            if not client.connected:
                self._drop(address)

    def close(self) -> None:
        """Closes every connection; the pool can be used again afterwards."""
        while self._clients:
            _, client = self._clients.popitem()
            client.close()
