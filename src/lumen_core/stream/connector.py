"""``StreamingConnector``: the engine's ``KVConnector`` over a ``CheckpointStreamer`` (saves
stream to holders while the engine decodes) and the verified restore (from a ``HolderStore``
in this process, or from a holder over the transport).

Two ways to drive it. Standalone (tests, benchmarks, a single survivor): every request streams
to one ``holders`` list with capabilities of epoch 0 from ``capability_for`` (an issuer the
caller holds) and restores from one ``restore_from`` source. Driven by a gateway (``lumen
worker``): each request streams as its ``StreamGrant`` says (holders, request epoch, the
gateway's capability on each holder) and a resumed request restores from
its ``RestoreSource`` (this process's ``store``, or another holder over the transport at the
request's new epoch). A request with a grant or a source uses it; the others use the defaults.

After a restore the verified prefix is streamed again to the request's holders (at its new
epoch, for a granted request): the streamer must see a request's tokens from position 0, so
the new incarnation's checkpoint is complete and no append of an older epoch is accepted.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from lumen_core._validate import U32_MAX, check_int, check_number
from lumen_core.auth import check_secret
from lumen_core.engine.connector import KVConnector, SavedTokens
from lumen_core.engine.request import Request
from lumen_core.stream._common import check_str, request_key
from lumen_core.stream.holder import (
    HolderStore,
    RestoreResult,
    RestoreStatus,
    remote_restore,
)
from lumen_core.stream.streamer import Address, CheckpointStreamer, _check_address
from lumen_core.transport import (
    CAPABILITY_BYTES,
    Client,
    ClientPool,
    Rejected,
    TransportError,
)

__all__ = ["RestoreSource", "StreamGrant", "StreamingConnector"]


def _check_capability(capability: object) -> bytes:
    if not isinstance(capability, (bytes, bytearray)):
        raise TypeError(f"capability must be bytes, got {type(capability).__name__}")
    if len(capability) != CAPABILITY_BYTES:
        raise ValueError(f"capability must be {CAPABILITY_BYTES} bytes, got {len(capability)}")
    return bytes(capability)


@dataclass(frozen=True)
class StreamGrant:
    """Where one request's checkpoint goes: holder addresses (none: it is not checkpointed)
    and, for each, the capability of shard 0 at ``epoch`` on that holder (a capability names
    the one holder it is valid on)."""

    epoch: int
    holders: tuple[Address, ...]
    capabilities: tuple[bytes, ...]

    def __post_init__(self) -> None:
        check_int("epoch", self.epoch, 0, U32_MAX)
        if not isinstance(self.holders, tuple):
            raise TypeError(f"holders must be a tuple of (address, port), got {type(self.holders).__name__}")
        for holder in self.holders:
            _check_address("holders[i]", holder)
        if not isinstance(self.capabilities, tuple) or len(self.capabilities) != len(self.holders):
            raise ValueError(
                f"capabilities must be a tuple of one capability per holder ({len(self.holders)}), "
                f"got {self.capabilities!r:.80}"
            )
        for capability in self.capabilities:
            _check_capability(capability)


@dataclass(frozen=True)
class RestoreSource:
    """Where a resumed request's prefix comes from: ``address`` None = the connector's own
    ``store``; otherwise the holder at ``address``, read at ``epoch`` with ``capability``."""

    epoch: int
    address: Address | None
    capability: bytes

    def __post_init__(self) -> None:
        check_int("epoch", self.epoch, 0, U32_MAX)
        if self.address is not None:
            _check_address("address", self.address)
            _check_capability(self.capability)


class StreamingConnector(KVConnector):
    """Streams every accepted token of the engine to its holders and restores resumed
    requests (see module doc).

    Defaults for requests without a grant or a source: ``holders`` (empty: nothing is
    streamed, a restore-only survivor) with the capabilities ``capability_for(key, holder)``
    (of shard 0 at epoch 0 on the holder at that (address, port); the connector holds no
    issuer key, so whoever does supplies them), and ``restore_from`` (a
    ``HolderStore`` or a transport ``Client``; None: nothing is restored). ``store`` is this
    process's ``HolderStore``, which sources without an address restore from. Request ids
    (str) are keyed on the wire by ``key_for`` (default ``request_key``; a gateway's decimal
    ids use ``int``). A restore that stops early (corrupt record, other token ids, another
    model, an unreachable holder) reports the pages from there on as load errors, so the
    engine re-prefills them. ``tls`` names the UCX transports of the streamer and of the
    connections to source holders (kept open for reuse), ``connect_timeout_s`` bounds connecting
    to one; the other
    ``streamer_options`` go to ``CheckpointStreamer``; ``restores`` keeps each restore's
    result.
    """

    def __init__(
        self,
        secret: bytes,
        model_fingerprint: str,
        *,
        holders: Sequence[Address] = (),
        restore_from: HolderStore | Client | None = None,
        capability_for: Callable[[int, Address], bytes] | None = None,
        store: HolderStore | None = None,
        key_for: Callable[[str], int] = request_key,
        tls: str = "",
        connect_timeout_s: float = 2.0,
        streamer_options: dict[str, Any] | None = None,
    ) -> None:
        self.secret = check_secret(secret)
        self.model_fingerprint = check_str("model_fingerprint", model_fingerprint)
        self.holders = [_check_address("holders[i]", h) for h in holders]
        if restore_from is not None and not isinstance(restore_from, (HolderStore, Client)):
            raise TypeError(
                f"restore_from must be a HolderStore or a Client, got {type(restore_from).__name__}"
            )
        self.restore_from = restore_from
        if store is not None and not isinstance(store, HolderStore):
            raise TypeError(f"store must be a HolderStore, got {type(store).__name__}")
        self.store = store
        if not callable(key_for):
            raise TypeError(f"key_for must be callable, got {type(key_for).__name__}")
        self.key_for = key_for
        if capability_for is None and (self.holders or isinstance(restore_from, Client)):
            raise ValueError("capability_for must be given with holders or a Client to restore from")
        if capability_for is not None and not callable(capability_for):
            raise TypeError(f"capability_for must be callable, got {type(capability_for).__name__}")
        self._capability_for = capability_for
        if not isinstance(tls, str):
            raise TypeError(f"tls must be a str, got {type(tls).__name__}")
        self.tls = tls
        self.connect_timeout_s = check_number("connect_timeout_s", connect_timeout_s, positive=True)
        self._pool = ClientPool(self.secret, tls=tls, connect_timeout_s=self.connect_timeout_s)
        self.streamer_options = dict(streamer_options or {})
        self.streamer: CheckpointStreamer | None = None
        self.restores: dict[str, RestoreResult] = {}
        self._grants: dict[str, StreamGrant] = {}
        self._sources: dict[str, RestoreSource] = {}
        self._added: set[str] = set()
        self._load_errors: set[int] = set()

    def _streamer(self) -> CheckpointStreamer:
        """The streamer, started with the first request that streams."""
        if self.streamer is None:
            self.streamer = CheckpointStreamer(
                self.layout,
                self.secret,
                model_fingerprint=self.model_fingerprint,
                tls=self.tls,
                **self.streamer_options,
            )
        return self.streamer

    def _default_capability(self, key: int, holder: Address | Client) -> bytes:
        """``capability_for``'s capability of ``key`` on ``holder`` (an address or a Client)."""
        assert self._capability_for is not None  # the constructor requires it for these
        address = (holder.address, holder.port) if isinstance(holder, Client) else holder
        return _check_capability(self._capability_for(key, address))

    # ---- per-request grants and sources -----------------------------------------------------
    def grant(self, request_id: str, grant: StreamGrant) -> None:
        """Stream ``request_id`` as ``grant`` says (before its first step)."""
        check_str("request_id", request_id)
        if not isinstance(grant, StreamGrant):
            raise TypeError(f"grant must be a StreamGrant, got {type(grant).__name__}")
        self._grants[request_id] = grant

    def set_restore_source(self, request_id: str, source: RestoreSource) -> None:
        """Restore ``request_id`` from ``source`` when it is admitted (a resumed request)."""
        check_str("request_id", request_id)
        if not isinstance(source, RestoreSource):
            raise TypeError(f"source must be a RestoreSource, got {type(source).__name__}")
        if source.address is None and self.store is None:
            raise ValueError("source must name an address: this connector has no store")
        self._sources[request_id] = source

    # ---- restore ----------------------------------------------------------------------------
    def _read_durable(self, client: Client, key: int, epoch: int, capability: bytes) -> int:
        try:
            result = client.read(key, 0, epoch, 0, 1, self.layout.record_bytes, capability)
        except Rejected:  # the holder has no checkpoint of this request (or not at this epoch)
            return 0
        return result.durable_tokens

    def _durable(self, request_id: str) -> int:
        key = self.key_for(request_id)
        source = self._sources.get(request_id)
        if source is None:
            if isinstance(self.restore_from, HolderStore):
                return self.restore_from.durable_tokens(key)
            assert isinstance(self.restore_from, Client)
            return self._read_durable(
                self.restore_from, key, 0, self._default_capability(key, self.restore_from)
            )
        if source.address is None:
            assert self.store is not None
            return self.store.durable_tokens(key)
        try:
            return self._pool.call(
                source.address,
                lambda client: self._read_durable(client, key, source.epoch, source.capability),
            )
        except TransportError:  # unreachable, or it went away while answering: re-prefill
            return 0

    def get_num_new_matched_tokens(self, request: Request) -> int:
        if request.request_id not in self._sources and self.restore_from is None:
            return 0
        return min(self._durable(request.request_id), len(request.token_ids))

    def _restore(self, request_id: str, slots: torch.Tensor, tokens: list[int]) -> RestoreResult:
        key = self.key_for(request_id)
        source = self._sources.pop(request_id, None)
        store = self.store if source is not None else self.restore_from
        if source is None or source.address is None:
            if isinstance(store, HolderStore):
                return store.restore(
                    key, self.layout, slots, token_ids=tokens, model_fingerprint=self.model_fingerprint
                )
            assert isinstance(store, Client)
            return remote_restore(
                store, key, self.layout, slots, token_ids=tokens,
                model_fingerprint=self.model_fingerprint, capability=self._default_capability(key, store),
            )  # fmt: skip
        address, capability, epoch = source.address, source.capability, source.epoch
        try:
            return self._pool.call(
                address,
                lambda client: remote_restore(
                    client, key, self.layout, slots, token_ids=tokens,
                    model_fingerprint=self.model_fingerprint, capability=capability, epoch=epoch,
                ),
            )  # fmt: skip
        except TransportError:  # unreachable, or it died mid-read: the whole prefix is re-prefilled
            return RestoreResult(RestoreStatus.MISSING, 0, len(tokens), 0)

    def start_load_kv(self, request: Request, slot_ids: Sequence[int]) -> None:
        slots = torch.tensor(list(slot_ids), dtype=torch.int64)
        tokens = request.token_ids[: len(slots)]
        result = self._restore(request.request_id, slots, tokens)
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

    # ---- streaming --------------------------------------------------------------------------
    def _add(self, request_id: str) -> bool:
        """Start streaming ``request_id`` (its grant, else the default holders); False when
        it is not checkpointed."""
        key = self.key_for(request_id)
        grant = self._grants.get(request_id)
        if grant is None:
            if not self.holders:
                return False
            capabilities = [self._default_capability(key, holder) for holder in self.holders]
            self._streamer().add_request(key, self.holders, capabilities)
        elif not grant.holders:
            return False
        else:
            self._streamer().add_request(
                key, list(grant.holders), list(grant.capabilities), epoch=grant.epoch
            )
        self._added.add(request_id)
        return True

    def save_kv(self, saves: Sequence[SavedTokens]) -> None:
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        tokens: list[int] = []
        for s in saves:
            if not s.slot_ids:
                continue
            # Streaming starts at position 0: a request whose prefix was neither streamed nor
            # restored here stays un-checkpointed.
            if s.request_id not in self._added and (s.start_position != 0 or not self._add(s.request_id)):
                continue
            ids += [self.key_for(s.request_id)] * len(s.slot_ids)
            positions += range(s.start_position, s.start_position + len(s.slot_ids))
            slots += s.slot_ids
            tokens += s.token_ids
        if ids:
            self._streamer().save_step(ids, positions, slots, tokens)

    def durable_tokens(self) -> dict[str, int]:
        """Durable length (best live replica) of each request streaming from here."""
        if self.streamer is None:
            return {}
        durable = self.streamer.stats().durable
        return {r: durable.get(self.key_for(r), 0) for r in self._added}

    def wait_for_save(self, request_id: str) -> None:
        if self.streamer is not None and request_id in self._added:
            self.streamer.wait_for_save(self.key_for(request_id))

    def request_finished(self, request_id: str) -> None:
        self._grants.pop(request_id, None)
        self._sources.pop(request_id, None)
        if self.streamer is not None and request_id in self._added:
            key = self.key_for(request_id)
            self.streamer.wait_for_save(key)
            self.streamer.release(key)
            self._added.discard(request_id)

    def close(self) -> None:
        self._pool.close()
        if self.streamer is not None:
            self.streamer.close()
