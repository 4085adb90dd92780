"""``StreamingConnector``: the reference engine's ``KVConnector``, a thin adapter over the
engine-neutral ``lumen_core.connector.ConnectorCore`` (streaming while the engine decodes, the
verified restore, load-error blocks, re-streaming a restored prefix).

Two ways to drive it. Standalone (tests, benchmarks, a single survivor): every request streams
to one ``holders`` list with capabilities of epoch 0 from ``capability_for`` (an issuer the
caller holds) and restores from one ``restore_from`` source. Driven by a gateway (``lumen
worker``): each request streams as its ``StreamGrant`` says (holders, request epoch, the
gateway's capability on each holder) and a resumed request restores from
its ``RestoreSource`` (this process's ``store``, or another holder over the transport at the
request's new epoch). A request with a grant or a source uses it; the others use the defaults.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

from lumen_core.auth import WorkerIdentity, check_secret
from lumen_core.connector import ConnectorCore, RestoreSource, StepTokens, StreamGrant
from lumen_core.connector.requests import check_capability
from lumen_core.engine.connector import KVConnector, SavedTokens
from lumen_core.engine.request import Request
from lumen_core.layouts import KVLayout
from lumen_core.stream._common import check_str, request_key
from lumen_core.stream.holder import HolderStore, RestoreResult
from lumen_core.stream.streamer import Address, CheckpointStreamer, _check_address

__all__ = ["StreamingConnector"]


class StreamingConnector(KVConnector):
    """Streams every accepted token of the engine to its holders and restores resumed
    requests (see module doc).

    Defaults for requests without a grant or a source: ``holders`` (empty: nothing is
    streamed, a restore-only survivor) with the capabilities ``capability_for(key, holder)``
    (of shard 0 at epoch 0 on the holder at that (address, port); the connector holds no
    issuer key, so whoever does supplies them), and ``restore_from`` (a
    ``HolderStore`` in this process, or the (address, port) of a holder; None: nothing is
    restored). ``store`` is this process's ``HolderStore``, which sources without an address
    restore from. Request ids (str) are keyed on the wire by ``key_for`` (default
    ``request_key``; a gateway's decimal ids use ``int``). A restore that stops early (corrupt
    record, other token ids, another model, an unreachable holder) reports the pages from
    there on as load errors, so the engine re-prefills them. ``tls``, ``connect_timeout_s``,
    ``streamer_options``, ``identity`` (the worker its connections prove), ``encrypt``
    (records in AES-256-GCM on those connections) and ``release_finished`` (False: a
    gateway releases finished requests' checkpoints) go to the core;
    ``restores`` keeps each restore's result.

    The engine plans restores synchronously: a lookup over the transport is waited for (at
    most ``2 * connect_timeout_s``; unanswered by then, the request is re-prefilled).

    Raises ValueError when ``holders`` or an address to restore from is given without
    ``capability_for``, TypeError for a ``capability_for`` that is not callable.
    """

    def __init__(
        self,
        secret: bytes,
        model_fingerprint: str,
        *,
        holders: Sequence[Address] = (),
        restore_from: HolderStore | Address | None = None,
        capability_for: Callable[[int, Address], bytes] | None = None,
        store: HolderStore | None = None,
        key_for: Callable[[str], int] = request_key,
        tls: str = "",
        connect_timeout_s: float = 2.0,
        streamer_options: dict[str, Any] | None = None,
        identity: WorkerIdentity | None = None,
        encrypt: bool = False,
        release_finished: bool = True,
    ) -> None:
        secret = check_secret(secret)
        self.holders = tuple(_check_address("holders[i]", h) for h in holders)
        # Defaults of requests without a source: this process's store, or a holder's address.
        self._default_source: RestoreSource | None = None
        self._default_address: Address | None = None
        if isinstance(restore_from, HolderStore):
            if store is not None and store is not restore_from:
                raise ValueError("`restore_from` must be `store` when both are HolderStores")
            store = restore_from
            self._default_source = RestoreSource(0, None, b"")
        elif isinstance(restore_from, tuple):
            self._default_address = _check_address("restore_from", restore_from)
        elif restore_from is not None:
            raise TypeError(
                "`restore_from` must be a HolderStore or an (address, port) tuple, got "
                f"{type(restore_from).__name__}"
            )
        if not callable(key_for):
            raise TypeError(f"`key_for` must be callable, got {type(key_for).__name__}")
        self.key_for = key_for
        if capability_for is None and (self.holders or self._default_address is not None):
            raise ValueError("`capability_for` must be given with `holders` or an address to restore from")
        if capability_for is not None and not callable(capability_for):
            raise TypeError(f"`capability_for` must be callable, got {type(capability_for).__name__}")
        self._capability_for = capability_for
        self.core = ConnectorCore(
            secret,
            model_fingerprint,
            store=store,
            tls=tls,
            connect_timeout_s=connect_timeout_s,
            streamer_options=streamer_options,
            identity=identity,
            encrypt=encrypt,
            release_finished=release_finished,
        )
        self._grants: dict[str, StreamGrant] = {}
        self._sources: dict[str, RestoreSource] = {}
        self._load_errors: set[int] = set()

    def register_kv_caches(self, layout: KVLayout) -> None:
        super().register_kv_caches(layout)
        self.core.register(layout)

    @property
    def streamer(self) -> CheckpointStreamer | None:
        """The core's streamer (None until the first request streams)."""
        return self.core.streamer

    @property
    def restores(self) -> dict[str, RestoreResult]:
        """The last restore result of each of the latest requests restored here."""
        return self.core.restores

    # ---- per-request grants and sources -----------------------------------------------------
    def grant(self, request_id: str, grant: StreamGrant) -> None:
        """Stream ``request_id`` as ``grant`` says (before its first step)."""
        check_str("request_id", request_id)
        if not isinstance(grant, StreamGrant):
            raise TypeError(f"`grant` must be a StreamGrant, got {type(grant).__name__}")
        self._grants[request_id] = grant

    def renew(self, request_id: str, grant: StreamGrant) -> bool:
        """Renew ``request_id``'s capabilities: ``grant`` names the same epoch and holders as
        its grant (in any order) with fresh capabilities, which replace the grant's and go to
        the streamer's replicas if it streams already. False (nothing changed) for a request
        granted nothing here, or at another epoch or to other holders (stale)."""
        check_str("request_id", request_id)
        if not isinstance(grant, StreamGrant):
            raise TypeError(f"`grant` must be a StreamGrant, got {type(grant).__name__}")
        current = self._grants.get(request_id)
        if current is None or current.epoch != grant.epoch or set(current.holders) != set(grant.holders):
            return False
        fresh = dict(zip(grant.holders, grant.capabilities))
        capabilities = tuple(fresh[holder] for holder in current.holders)
        self._grants[request_id] = replace(current, capabilities=capabilities)
        self.core.renew(request_id, capabilities)
        return True

    def set_restore_source(self, request_id: str, source: RestoreSource) -> None:
        """Restore ``request_id`` from ``source`` when it is admitted (a resumed request)."""
        check_str("request_id", request_id)
        if not isinstance(source, RestoreSource):
            raise TypeError(f"`source` must be a RestoreSource, got {type(source).__name__}")
        if source.address is None and self.core.store is None:
            raise ValueError("`source` must name an address: this connector has no store")
        self._sources[request_id] = source

    def _source(self, request_id: str) -> RestoreSource | None:
        source = self._sources.get(request_id)
        if source is not None or self._default_address is None:
            return source or self._default_source
        key = self.key_for(request_id)
        return RestoreSource(0, self._default_address, self._default_capability(key, self._default_address))

    def _default_capability(self, key: int, holder: Address) -> bytes:
        """``capability_for``'s capability of ``key`` on ``holder``."""
        assert self._capability_for is not None  # the constructor requires it for these
        return check_capability("capability_for(key, holder)", self._capability_for(key, holder))

    # ---- restore ----------------------------------------------------------------------------
    def get_num_new_matched_tokens(self, request: Request) -> int:
        source = self._source(request.request_id)
        if source is None:
            return 0
        key = self.key_for(request.request_id)
        durable = self.core.plan_restore(
            request.request_id, key, source, wait_s=2 * self.core.connect_timeout_s
        )
        return min(durable or 0, len(request.token_ids))

    def start_load_kv(self, request: Request, slot_ids: Sequence[int]) -> None:
        request_id = request.request_id
        source = self._source(request_id)
        assert source is not None  # only called after a match
        self._sources.pop(request_id, None)
        self._begin(request_id)  # so the verified prefix is streamed again at the new epoch
        outcome = self.core.restore(
            request_id, self.key_for(request_id), source, slot_ids, request.token_ids[: len(slot_ids)]
        )
        self._load_errors |= outcome.failed_block_ids

    def get_block_ids_with_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors

    # ---- streaming --------------------------------------------------------------------------
    def _begin(self, request_id: str) -> None:
        """Start streaming ``request_id`` as its grant says, else to the default holders."""
        if self.core.is_streaming(request_id):
            return
        key = self.key_for(request_id)
        grant = self._grants.get(request_id)
        if grant is None:
            capabilities = tuple(self._default_capability(key, holder) for holder in self.holders)
            grant = StreamGrant(0, self.holders, capabilities)
        self.core.begin(request_id, key, grant)

    def holders_of(self, request_id: str) -> tuple[Address, ...]:
        """The holders ``request_id`` streams to: its grant's, else the defaults."""
        grant = self._grants.get(request_id)
        return tuple(grant.holders) if grant is not None else self.holders

    def save_kv(self, saves: Sequence[SavedTokens]) -> None:
        steps = []
        for s in saves:
            # Streaming starts at position 0: a request whose prefix was neither streamed nor
            # restored here stays un-checkpointed.
            if s.slot_ids and s.start_position == 0:
                self._begin(s.request_id)
            steps.append(StepTokens(s.request_id, s.start_position, s.slot_ids, s.token_ids))
        self.core.save_step(steps)

    def resend_last(self, saves: Sequence[SavedTokens]) -> int:
        """Each request's last saved token again, so the streamer catches up steps it dropped
        (``ConnectorCore.resend_last``); returns the number of requests handed over."""
        return self.core.resend_last(
            [StepTokens(s.request_id, s.start_position, s.slot_ids, s.token_ids) for s in saves]
        )

    def durable_tokens(self) -> dict[str, int]:
        """Durable length (best live replica) of each request streaming from here."""
        return self.core.durable_tokens()

    def wait_for_save(self, request_id: str) -> None:
        self.core.wait_for_save(request_id)

    def request_finished(self, request_id: str) -> None:
        self._grants.pop(request_id, None)
        self._sources.pop(request_id, None)
        if not self.core.finish(request_id):
            raise TimeoutError(
                f"saves of request {request_id!r} still pending: its checkpoint is not released"
            )

    def close(self) -> None:
        self.core.close()
