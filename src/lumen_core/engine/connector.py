"""LUMEN hooks of the engine, shaped like vLLM's KV-connector interface (KVConnectorBase_V1).

The engine calls, in order: ``register_kv_caches`` once; when admitting a request,
``get_num_new_matched_tokens`` (scheduler side) and, for a match, ``start_load_kv`` then
``get_block_ids_with_load_errors`` (tokens in failed blocks are recomputed); after every
step ``save_kv`` with the slots and token ids written for accepted tokens (prefill chunks,
decoded and accepted draft tokens, never rejected drafts); ``wait_for_save`` before a
request's pages are freed or reused; ``request_finished`` when it finishes or is aborted.
A vLLM or SGLang adapter maps these one to one onto its own connector calls.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from lumen_core.engine.request import Request

if TYPE_CHECKING:
    from lumen_core.layouts import KVLayout


@dataclass(frozen=True)
class SavedTokens:
    """Tokens of one request whose K and V a step wrote: positions ``start_position ...``,
    in ``slot_ids``, with ``token_ids``. This is what ``CheckpointStreamer.save_step`` takes."""

    request_id: str
    start_position: int
    slot_ids: tuple[int, ...]
    token_ids: tuple[int, ...]


class KVConnector(ABC):
    """Engine-side hooks for checkpointing and restoring a request's KV (see module doc)."""

    @abstractmethod
    def register_kv_caches(self, layout: KVLayout) -> None:
        """Called once with the layout of the engine's KV tensors."""

    def get_num_new_matched_tokens(self, request: Request) -> int:
        """Leading tokens of ``request`` whose KV this connector can load (default: none)."""
        return 0

    def start_load_kv(self, request: Request, slot_ids: Sequence[int]) -> None:
        """Write the KV of the first ``len(slot_ids)`` tokens of ``request`` into ``slot_ids``.

        Only called after ``get_num_new_matched_tokens`` returned at least that many.
        """
        raise NotImplementedError(f"{type(self).__name__} matched tokens but cannot load them")

    def get_block_ids_with_load_errors(self) -> set[int]:
        """Blocks whose load failed since the last call (their tokens get recomputed)."""
        return set()

    @abstractmethod
    def save_kv(self, saves: Sequence[SavedTokens]) -> None:
        """Checkpoint the tokens a step wrote. Must not block decoding for long."""

    @abstractmethod
    def wait_for_save(self, request_id: str) -> None:
        """Return once no pending save reads the pages of ``request_id``."""

    @abstractmethod
    def request_finished(self, request_id: str) -> None:
        """``request_id`` finished or was aborted: no more saves for it."""


@dataclass(frozen=True)
class Checkpoint:
    """A request's checkpoint: the token records ``[n, record_bytes]`` uint8 of its first
    ``n`` tokens, their token ids, and the fingerprint of the layout they came from."""

    token_ids: tuple[int, ...]
    records: torch.Tensor
    layout_fingerprint: str

    def __post_init__(self) -> None:
        if self.records.dtype != torch.uint8 or self.records.dim() != 2:
            raise ValueError(
                f"`records` must be a 2-d uint8 tensor, got {self.records.dtype} "
                f"{tuple(self.records.shape)}"
            )
        if self.records.shape[0] != len(self.token_ids):
            raise ValueError(
                f"`records` must have one row per token id ({len(self.token_ids)}), "
                f"got {self.records.shape[0]}"
            )


class HostCheckpointConnector(KVConnector):
    """Keeps each request's checkpoint in this process's memory (``gather_tokens`` on save,
    ``scatter_tokens`` on load): the local holder for tests and single-process demos, and
    the restore entry point: ``put`` a checkpoint received from a holder, then
    ``Engine.add_request`` with the same request id re-admits it from that prefix.

    Saves are synchronous, so ``wait_for_save`` has nothing to wait for.
    """

    def __init__(self) -> None:
        self._layout: KVLayout | None = None
        self._token_ids: dict[str, list[int]] = {}
        self._records: dict[str, list[torch.Tensor]] = {}

    @property
    def layout(self) -> KVLayout:
        if self._layout is None:
            raise RuntimeError("register_kv_caches has not been called")
        return self._layout

    def register_kv_caches(self, layout: KVLayout) -> None:
        self._layout = layout

    def checkpoint(self, request_id: str) -> Checkpoint:
        """The checkpoint held for ``request_id`` (KeyError if none)."""
        records = torch.cat(self._records[request_id]) if self._records[request_id] else None
        if records is None:
            records = torch.empty(0, self.layout.record_bytes, dtype=torch.uint8)
        self._records[request_id] = [records]
        return Checkpoint(tuple(self._token_ids[request_id]), records, self.layout.fingerprint())

    def put(self, request_id: str, checkpoint: Checkpoint) -> None:
        """Hold ``checkpoint`` for ``request_id`` (replacing any), to be loaded on admission."""
        if checkpoint.layout_fingerprint != self.layout.fingerprint():
            raise ValueError(
                f"`checkpoint` layout must be {self.layout.fingerprint()}, "
                f"got {checkpoint.layout_fingerprint}"
            )
        self._token_ids[request_id] = list(checkpoint.token_ids)
        self._records[request_id] = [checkpoint.records]

    def get_num_new_matched_tokens(self, request: Request) -> int:
        held = self._token_ids.get(request.request_id, [])
        n = 0
        for a, b in zip(held, request.token_ids, strict=False):
            if a != b:
                break
            n += 1
        return n

    def start_load_kv(self, request: Request, slot_ids: Sequence[int]) -> None:
        from lumen_core.ops import scatter_tokens

        records = self.checkpoint(request.request_id).records[: len(slot_ids)]
        scatter_tokens(self.layout, torch.tensor(slot_ids, dtype=torch.long), records)

    def save_kv(self, saves: Sequence[SavedTokens]) -> None:
        from lumen_core.ops import gather_tokens

        saves = [s for s in saves if s.slot_ids]
        if not saves:
            return
        slot_ids = torch.tensor([x for s in saves for x in s.slot_ids], dtype=torch.long)
        records = gather_tokens(self.layout, slot_ids)
        start = 0
        for s in saves:
            held = self._token_ids.setdefault(s.request_id, [])
            chunks = self._records.setdefault(s.request_id, [])
            if s.start_position > len(held):
                raise RuntimeError(
                    f"save of {s.request_id!r} at position {s.start_position} leaves a gap "
                    f"after its {len(held)} held tokens"
                )
            if s.start_position < len(held):
                # A recompute after preemption (or a restore) rewrites from an earlier position.
                kept = self.checkpoint(s.request_id).records[: s.start_position]
                chunks[:] = [kept]
                del held[s.start_position :]
            n = len(s.slot_ids)
            chunks.append(records[start : start + n])
            held.extend(s.token_ids)
            start += n

    def wait_for_save(self, request_id: str) -> None:
        return None

    def request_finished(self, request_id: str) -> None:
        self._token_ids.pop(request_id, None)
        self._records.pop(request_id, None)
