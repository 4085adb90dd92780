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

import torch

from lumen_core.engine.request import Request
from lumen_core.layouts import KVLayout
from lumen_core.ops import checksum, gather_tokens, scatter_tokens


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

    _layout: KVLayout | None = None

    def register_kv_caches(self, layout: KVLayout) -> None:
        """Called once with the layout of the engine's KV tensors."""
        self._layout = layout

    @property
    def layout(self) -> KVLayout:
        """The engine's KV layout; RuntimeError before ``register_kv_caches``."""
        if self._layout is None:
            raise RuntimeError("register_kv_caches has not been called")
        return self._layout

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
    ``n`` tokens, their token ids, the CRC-32C of each record (``[n]`` uint32) and the
    fingerprints of the layout and the model they came from."""

    token_ids: tuple[int, ...]
    records: torch.Tensor
    crcs: torch.Tensor
    layout_fingerprint: str
    model_fingerprint: str

    def __post_init__(self) -> None:
        if self.records.dtype != torch.uint8 or self.records.dim() != 2:
            raise ValueError(
                f"`records` must be a 2-d uint8 tensor, got {self.records.dtype} {tuple(self.records.shape)}"
            )
        n = len(self.token_ids)
        if self.records.shape[0] != n or tuple(self.crcs.shape) != (n,):
            raise ValueError(
                f"`records` and `crcs` must have one row per token id ({n}), "
                f"got {self.records.shape[0]} and {tuple(self.crcs.shape)}"
            )


class _Held:
    """The growing checkpoint of one request: chunks of records and crcs, concatenated lazily."""

    def __init__(self, token_ids: list[int], records: torch.Tensor, crcs: torch.Tensor) -> None:
        self.token_ids = token_ids
        self.records = [records]
        self.crcs = [crcs]

    def compact(self) -> tuple[torch.Tensor, torch.Tensor]:
        if len(self.records) > 1:
            self.records = [torch.cat(self.records)]
            self.crcs = [torch.cat(self.crcs)]
        return self.records[0], self.crcs[0]

    def truncate(self, num_tokens: int) -> None:
        records, crcs = self.compact()
        self.records, self.crcs = [records[:num_tokens]], [crcs[:num_tokens]]
        del self.token_ids[num_tokens:]


class HostCheckpointConnector(KVConnector):
    """Keeps each request's checkpoint in this process's memory: ``gather_tokens`` and
    ``checksum`` on save, ``scatter_tokens`` on load, where records whose CRC no longer
    matches are reported as load errors of their blocks (so those tokens are recomputed).

    It is the local holder for tests and single-process demos, and the restore entry point:
    ``put`` a checkpoint received from a holder, then ``Engine.add_request`` with the same
    request id and known outputs re-admits it from that prefix. Saves are synchronous, so
    ``wait_for_save`` has nothing to wait for. ``model_fingerprint`` (``model_fingerprint(model)``)
    names the engine's model; ``put`` refuses a checkpoint of another model or record format.
    """

    def __init__(self, model_fingerprint: str) -> None:
        if not isinstance(model_fingerprint, str) or not model_fingerprint:
            raise TypeError(f"`model_fingerprint` must be a non-empty str, got {model_fingerprint!r}")
        self.model_fingerprint = model_fingerprint
        self._held: dict[str, _Held] = {}
        self._load_errors: set[int] = set()

    def checkpoint(self, request_id: str) -> Checkpoint:
        """The checkpoint held for ``request_id`` (KeyError if none)."""
        held = self._held[request_id]
        records, crcs = held.compact()
        return Checkpoint(
            tuple(held.token_ids),
            records,
            crcs,
            self.layout.fingerprint(),
            self.model_fingerprint,
        )

    def put(self, request_id: str, checkpoint: Checkpoint) -> None:
        """Hold ``checkpoint`` for ``request_id`` (replacing any), to be loaded on admission.

        Raises ValueError when it came from another model or record format.
        """
        if checkpoint.layout_fingerprint != self.layout.fingerprint():
            raise ValueError(
                f"`checkpoint` layout must be {self.layout.fingerprint()}, "
                f"got {checkpoint.layout_fingerprint}"
            )
        if checkpoint.model_fingerprint != self.model_fingerprint:
            raise ValueError(
                f"`checkpoint` model must be {self.model_fingerprint}, got {checkpoint.model_fingerprint}"
            )
        self._held[request_id] = _Held(list(checkpoint.token_ids), checkpoint.records, checkpoint.crcs)

    def get_num_new_matched_tokens(self, request: Request) -> int:
        held = self._held.get(request.request_id)
        if held is None:
            return 0
        n = 0
        for a, b in zip(held.token_ids, request.token_ids, strict=False):
            if a != b:
                break
            n += 1
        return n

    def start_load_kv(self, request: Request, slot_ids: Sequence[int]) -> None:
        n = len(slot_ids)
        records, crcs = self._held[request.request_id].compact()
        records, crcs = records[:n].contiguous(), crcs[:n]
        scatter_tokens(self.layout, torch.tensor(slot_ids, dtype=torch.long), records.to(self.layout.device))
        bad = (checksum(records) != crcs).nonzero().flatten().tolist()
        block_size = self.layout.block_size
        self._load_errors.update(slot_ids[i] // block_size for i in bad)

    def get_block_ids_with_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors

    def save_kv(self, saves: Sequence[SavedTokens]) -> None:
        saves = [s for s in saves if s.slot_ids]
        if not saves:
            return
        slot_ids = torch.tensor([x for s in saves for x in s.slot_ids], dtype=torch.long)
        # Host memory: a CUDA layout gathers on the device, then one copy brings them over.
        records = gather_tokens(self.layout, slot_ids).cpu()
        crcs = checksum(records)
        start = 0
        for s in saves:
            n = len(s.slot_ids)
            held = self._held.get(s.request_id)
            if held is None:
                held = _Held([], records[:0], crcs[:0])
                self._held[s.request_id] = held
            if s.start_position > len(held.token_ids):
                raise RuntimeError(
                    f"save of {s.request_id!r} at position {s.start_position} leaves a gap "
                    f"after its {len(held.token_ids)} held tokens"
                )
            if s.start_position < len(held.token_ids):
                # A recompute after preemption or a restore rewrites from an earlier position.
                held.truncate(s.start_position)
            held.records.append(records[start : start + n])
            held.crcs.append(crcs[start : start + n])
            held.token_ids.extend(s.token_ids)
            start += n

    def wait_for_save(self, request_id: str) -> None:
        return None

    def request_finished(self, request_id: str) -> None:
        self._held.pop(request_id, None)
