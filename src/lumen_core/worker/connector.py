"""``GatewayConnector``: the engine's KVConnector as a gateway-driven worker needs it.

``stream.StreamingConnector`` streams every request to one holder list with capabilities of
epoch 0; a worker of a live cluster streams each request to the holders the gateway granted
it, with the capability of the request's current epoch, and restores each resumed request
from where the gateway's RESUME directive says (its own ``HolderStore`` for RESTORE, the
source holder over the transport for REMOTE_RESTORE). Request ids are the gateway's u64 ids
(engine ids are their decimal strings), so capabilities issued by the gateway are valid on
the holders as they are.

After a restore the verified prefix is streamed again to the request's holders at its new
epoch (the streamer must see a request's tokens from position 0), so the new incarnation's
checkpoint is complete and no append of the old one is accepted.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from lumen_core.engine.connector import KVConnector, SavedTokens
from lumen_core.engine.request import Request
from lumen_core.layouts import KVLayout
from lumen_core.stream import CheckpointStreamer, HolderStore, RestoreResult, remote_restore
from lumen_core.transport import Client

Address = tuple[str, int]


def parse_address(address: str) -> Address:
    """``"host:port"`` -> ``(host, port)``. ValueError on anything else."""
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit() or not 1 <= int(port) <= 65535:
        raise ValueError(f"address must be 'host:port' with a port in [1, 65535], got {address!r}")
    return host, int(port)


@dataclass(frozen=True)
class StreamGrant:
    """Where one request's checkpoint goes: holder addresses, the capability of shard 0 at
    ``epoch`` (the same on every holder: it binds the request, not the holder)."""

    epoch: int
    holders: tuple[Address, ...]
    capability: bytes


@dataclass(frozen=True)
class RestoreSource:
    """Where a resumed request's prefix comes from: ``address`` None = this worker's store."""

    epoch: int
    address: Address | None
    capability: bytes


class GatewayConnector(KVConnector):
    """Per-request streaming grants and restore sources (see module doc).

    ``grant`` before the request's first step; ``restore_from`` before a resumed request is
    admitted. ``restores`` keeps each restore's result; ``connect_timeout_s`` bounds
    connecting to a remote source holder."""

    def __init__(
        self,
        secret: bytes,
        model_fingerprint: str,
        store: HolderStore,
        *,
        connect_timeout_s: float = 2.0,
        ack_timeout_s: float = 2.0,
    ) -> None:
        if not isinstance(store, HolderStore):
            raise TypeError(f"store must be a HolderStore, got {type(store).__name__}")
        self.secret = bytes(secret)
        self.model_fingerprint = model_fingerprint
        self.store = store
        self.connect_timeout_s = connect_timeout_s
        self.ack_timeout_s = ack_timeout_s
        self.streamer: CheckpointStreamer | None = None
        self.restores: dict[str, RestoreResult] = {}
        self._layout: KVLayout | None = None
        self._grants: dict[str, StreamGrant] = {}
        self._added: set[str] = set()
        self._sources: dict[str, RestoreSource] = {}
        self._load_errors: set[int] = set()

    @property
    def layout(self) -> KVLayout:
        if self._layout is None:
            raise RuntimeError("register_kv_caches has not been called")
        return self._layout

    def register_kv_caches(self, layout: KVLayout) -> None:
        self._layout = layout
        self.streamer = CheckpointStreamer(
            layout,
            self.secret,
            model_fingerprint=self.model_fingerprint,
            ack_timeout_s=self.ack_timeout_s,
            connect_timeout_s=self.connect_timeout_s,
        )

    def grant(self, request_id: str, grant: StreamGrant) -> None:
        """Stream ``request_id`` as ``grant`` says (no holders: it is not checkpointed)."""
        self._grants[request_id] = grant

    def restore_from(self, request_id: str, source: RestoreSource) -> None:
        self._sources[request_id] = source

    # ---- restore -------------------------------------------------------------------------
    def _durable(self, request_id: str, source: RestoreSource) -> int:
        key = int(request_id)
        if source.address is None:
            return self.store.durable_tokens(key)
        return self._with_client(
            source,
            lambda client: client.read(
                key, 0, source.epoch, 0, 1, self.layout.record_bytes, source.capability
            ).durable_tokens,
        )

    def _with_client(self, source: RestoreSource, call: Callable[[Client], int]) -> int:
        """``call`` on a connection to the source holder; 0 when it cannot be reached or
        has no such checkpoint (the request is then re-prefilled)."""
        assert source.address is not None
        try:
            client = Client(
                source.address[0],
                source.address[1],
                self.secret,
                connect_timeout_s=self.connect_timeout_s,
            )
        except Exception:  # noqa: BLE001 - an unreachable holder: re-prefill
            return 0
        try:
            return int(call(client))
        except Exception:  # noqa: BLE001 - missing checkpoint, holder gone: re-prefill
            return 0
        finally:
            client.close()

    def get_num_new_matched_tokens(self, request: Request) -> int:
        source = self._sources.get(request.request_id)
        if source is None:
            return 0
        return min(self._durable(request.request_id, source), len(request.token_ids))

    def start_load_kv(self, request: Request, slot_ids: Sequence[int]) -> None:
        source = self._sources.pop(request.request_id)
        key = int(request.request_id)
        slots = torch.tensor(list(slot_ids), dtype=torch.int64)
        tokens = request.token_ids[: len(slots)]
        if source.address is None:
            result = self.store.restore(
                key, self.layout, slots, token_ids=tokens, model_fingerprint=self.model_fingerprint
            )
        else:
            client = Client(
                source.address[0], source.address[1], self.secret, connect_timeout_s=self.connect_timeout_s
            )
            try:
                result = remote_restore(
                    client,
                    key,
                    self.layout,
                    slots,
                    token_ids=tokens,
                    model_fingerprint=self.model_fingerprint,
                    capability=source.capability,
                    epoch=source.epoch,
                )
            finally:
                client.close()
        self.restores[request.request_id] = result
        restored = result.restored_tokens
        block_size = self.layout.block_size
        self._load_errors.update(int(s) // block_size for s in slot_ids[restored:])
        if restored:
            self.save_kv(
                [SavedTokens(request.request_id, 0, tuple(slot_ids[:restored]), tuple(tokens[:restored]))]
            )

    def get_block_ids_with_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors

    # ---- streaming -----------------------------------------------------------------------
    def save_kv(self, saves: Sequence[SavedTokens]) -> None:
        if self.streamer is None:
            return
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        tokens: list[int] = []
        for s in saves:
            grant = self._grants.get(s.request_id)
            if not s.slot_ids or grant is None or not grant.holders:
                continue
            if s.request_id not in self._added:
                if s.start_position != 0:
                    continue  # a prefix was not streamed: this request stays un-checkpointed
                self.streamer.add_request(
                    int(s.request_id), list(grant.holders), grant.capability, epoch=grant.epoch
                )
                self._added.add(s.request_id)
            ids += [int(s.request_id)] * len(s.slot_ids)
            positions += range(s.start_position, s.start_position + len(s.slot_ids))
            slots += s.slot_ids
            tokens += s.token_ids
        if ids:
            self.streamer.save_step(ids, positions, slots, tokens)

    def durable_tokens(self) -> dict[str, int]:
        """Durable length (best live replica) of each request streamed from here."""
        if self.streamer is None:
            return {}
        return {str(k): v for k, v in self.streamer.stats().durable.items()}

    def wait_for_save(self, request_id: str) -> None:
        if self.streamer is not None and request_id in self._added:
            self.streamer.wait_for_save(int(request_id))

    def request_finished(self, request_id: str) -> None:
        self._grants.pop(request_id, None)
        self._sources.pop(request_id, None)
        if self.streamer is not None and request_id in self._added:
            self.streamer.wait_for_save(int(request_id))
            self.streamer.release(int(request_id))
            self._added.discard(request_id)

    def close(self) -> None:
        if self.streamer is not None:
            self.streamer.close()
