"""``StreamingConnector``: the engine's ``KVConnector`` over a ``CheckpointStreamer`` (saves
stream to holders while the engine decodes) and the verified restore (from a ``HolderStore``
in this process, or from a holder over the transport)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from lumen_core.engine.connector import KVConnector, SavedTokens
from lumen_core.engine.request import Request
from lumen_core.layouts import KVLayout
from lumen_core.stream._common import check_str, request_key
from lumen_core.stream.holder import HolderStore, RestoreResult, remote_restore
from lumen_core.stream.streamer import Address, CheckpointStreamer
from lumen_core.transport import Client, Rejected, issue_capability

__all__ = ["StreamingConnector"]


class StreamingConnector(KVConnector):
    """Streams every accepted token of the engine to ``holders`` and restores from
    ``restore_from``.

    Request ids (str) are keyed on the wire by ``request_key``; each request's capability
    comes from ``capability_for(key)`` (default: issued here with ``secret``, as a gateway
    would). With ``holders`` empty nothing is streamed (a restore-only survivor); with
    ``restore_from`` None nothing is restored. A restore that stops early (corrupt record,
    other token ids, another model) reports the pages from there on as load errors, so the
    engine re-prefills them. ``streamer_options`` go to ``CheckpointStreamer``.
    """

    def __init__(
        self,
        secret: bytes,
        model_fingerprint: str,
        *,
        holders: Sequence[Address] = (),
        restore_from: HolderStore | Client | None = None,
        capability_for: Callable[[int], bytes] | None = None,
        streamer_options: dict[str, Any] | None = None,
    ) -> None:
        if not isinstance(secret, (bytes, bytearray)):
            raise TypeError(f"secret must be bytes, got {type(secret).__name__}")
        self.secret = bytes(secret)
        self.model_fingerprint = check_str("model_fingerprint", model_fingerprint)
        self.holders = list(holders)
        if restore_from is not None and not isinstance(restore_from, (HolderStore, Client)):
            raise TypeError(
                f"restore_from must be a HolderStore or a Client, got {type(restore_from).__name__}"
            )
        self.restore_from = restore_from
        self.capability_for = capability_for or (
            lambda key: issue_capability(self.secret, key, 0, 0)
        )
        self.streamer_options = dict(streamer_options or {})
        self.streamer: CheckpointStreamer | None = None
        self.restores: dict[str, RestoreResult] = {}
        self._layout: KVLayout | None = None
        self._added: set[str] = set()
        self._load_errors: set[int] = set()

    @property
    def layout(self) -> KVLayout:
        if self._layout is None:
            raise RuntimeError("register_kv_caches has not been called")
        return self._layout

    def register_kv_caches(self, layout: KVLayout) -> None:
        self._layout = layout
        if self.holders:
            self.streamer = CheckpointStreamer(
                layout, self.secret, model_fingerprint=self.model_fingerprint,
                **self.streamer_options,
            )

    def _durable(self, key: int) -> int:
        if isinstance(self.restore_from, HolderStore):
            return self.restore_from.durable_tokens(key)
        assert isinstance(self.restore_from, Client)
        try:
            result = self.restore_from.read(
                key, 0, 0, 0, 1, self.layout.record_bytes, self.capability_for(key)
            )
        except Rejected:  # the holder has no checkpoint of this request
            return 0
        return result.durable_tokens

    def get_num_new_matched_tokens(self, request: Request) -> int:
        if self.restore_from is None:
            return 0
        return min(self._durable(request_key(request.request_id)), len(request.token_ids))

    def start_load_kv(self, request: Request, slot_ids: Sequence[int]) -> None:
        key = request_key(request.request_id)
        slots = torch.tensor(list(slot_ids), dtype=torch.int64)
        tokens = request.token_ids[: len(slots)]
        if isinstance(self.restore_from, HolderStore):
            result = self.restore_from.restore(
                key, self.layout, slots, token_ids=tokens, model_fingerprint=self.model_fingerprint
            )
        else:
            assert isinstance(self.restore_from, Client)
            result = remote_restore(
                self.restore_from, key, self.layout, slots, token_ids=tokens,
                model_fingerprint=self.model_fingerprint, capability=self.capability_for(key),
            )
        self.restores[request.request_id] = result
        block_size = self.layout.block_size
        self._load_errors.update(int(s) // block_size for s in slot_ids[result.restored_tokens :])

    def get_block_ids_with_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors

    def save_kv(self, saves: Sequence[SavedTokens]) -> None:
        if self.streamer is None:
            return
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        tokens: list[int] = []
        for s in saves:
            if not s.slot_ids:
                continue
            key = request_key(s.request_id)
            if s.request_id not in self._added:
                self.streamer.add_request(key, self.holders, self.capability_for(key))
                self._added.add(s.request_id)
            ids += [key] * len(s.slot_ids)
            positions += range(s.start_position, s.start_position + len(s.slot_ids))
            slots += s.slot_ids
            tokens += s.token_ids
        if ids:
            self.streamer.save_step(ids, positions, slots, tokens)

    def wait_for_save(self, request_id: str) -> None:
        if self.streamer is not None and request_id in self._added:
            self.streamer.wait_for_save(request_key(request_id))

    def request_finished(self, request_id: str) -> None:
        if self.streamer is not None and request_id in self._added:
            self.streamer.release(request_key(request_id))
            self._added.discard(request_id)

    def close(self) -> None:
        if self.streamer is not None:
            self.streamer.close()
