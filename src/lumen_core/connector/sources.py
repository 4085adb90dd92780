"""Reading a resumed request's checkpoint from its ``RestoreSource``: the durable length (a
one-record read) and the verified restore into slots, from this process's ``HolderStore`` or
from a holder over a pooled connection."""

from __future__ import annotations

import logging

import torch

from lumen_core.auth import WorkerIdentity
from lumen_core.connector.requests import RestoreSource
from lumen_core.layouts import KVLayout
from lumen_core.stream.holder import HolderStore, RestoreResult, RestoreStatus, remote_restore
from lumen_core.transport import Client, ClientPool, Rejected, TransportError

__all__ = ["SourceReader"]

logger = logging.getLogger(__name__)


class SourceReader:
    """Reads checkpoints of shard ``shard`` from restore sources: ``store`` for sources
    without an address, else the holder named, over connections kept open (``tls``,
    ``connect_timeout_s``, which also bounds each durable-length lookup). A source that cannot serve the
    checkpoint (absent, refused, unreachable, gone mid-read) reads as nothing durable, so the
    caller recomputes: a bad source never fails a request.

    Not thread-safe: one reader per thread that reads.
    """

    def __init__(
        self,
        secret: bytes,
        *,
        store: HolderStore | None = None,
        shard: int = 0,
        tls: str = "",
        connect_timeout_s: float = 2.0,
        identity: WorkerIdentity | None = None,
        encrypt: bool = False,
    ) -> None:
        if store is not None and not isinstance(store, HolderStore):
            raise TypeError(f"`store` must be a HolderStore, got {type(store).__name__}")
        self.store = store
        self.shard = shard
        self.timeout_s = connect_timeout_s
        self._pool = ClientPool(
            secret, tls=tls, connect_timeout_s=connect_timeout_s, identity=identity, encrypt=encrypt
        )

    def _local(self) -> HolderStore:
        if self.store is None:
            raise ValueError("`source.address` must name a holder: this connector has no store")
        return self.store

    def durable_tokens(self, key: int, source: RestoreSource, record_bytes: int) -> int:
        """The durable length of request ``key``'s checkpoint at ``source`` (0: nothing there
        or not reachable). ``record_bytes``: the token record size the read asks for."""
        if source.address is None:
            return self._local().durable_tokens(key, shard=self.shard)

        def lookup(client: Client) -> int:
            result = client.read(
                key, self.shard, source.epoch, 0, 1, record_bytes, source.capability, timeout_s=self.timeout_s
            )
            return int(result.durable_tokens)

        try:
            return self._pool.call(source.address, lookup)
        except Rejected:  # no checkpoint of this request at this epoch, or a capability refused
            return 0
        except TransportError as error:
            logger.warning("lumen: lookup at %s failed (%s): recomputing", source.address, error)
            return 0

    def restore(
        self,
        key: int,
        source: RestoreSource,
        layout: KVLayout,
        slot_ids: list[int],
        token_ids: list[int],
        model_fingerprint: str,
    ) -> RestoreResult:
        """Writes the verified prefix of request ``key``'s checkpoint at ``source`` into
        ``slot_ids`` of ``layout`` (one slot per position from 0; ``token_ids`` the request's
        known tokens). Fingerprints, token ids and crc32c are checked before a record is
        written: no slot past the verified prefix is touched."""
        slots = torch.tensor(slot_ids, dtype=torch.int64)
        if source.address is None:
            return self._local().restore(
                key, layout, slots, token_ids=token_ids, model_fingerprint=model_fingerprint, shard=self.shard
            )

        def read(client: Client) -> RestoreResult:
            return remote_restore(
                client, key, layout, slots, token_ids=token_ids, model_fingerprint=model_fingerprint,
                capability=source.capability, shard=self.shard, epoch=source.epoch,
            )  # fmt: skip

        try:
            return self._pool.call(source.address, read)
        except TransportError as error:  # unreachable, or the holder died mid-read: recompute
            logger.warning("lumen: restore from %s failed (%s): recomputing", source.address, error)
            return RestoreResult(RestoreStatus.MISSING, 0, len(slot_ids), 0)

    def close(self) -> None:
        self._pool.close()
