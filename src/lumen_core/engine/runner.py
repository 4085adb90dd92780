"""The only part of the engine that touches tensors: batch assembly, paged attention, logits."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch.nn import functional as F

from lumen_core.engine.cache import PagedKVCache
from lumen_core.engine.model import Llama


@dataclass(frozen=True)
class Chunk:
    """New tokens of one request in a step.

    ``token_ids`` sit at positions ``start_position ...`` and are written into ``slot_ids``;
    attention reads the first ``start_position + len(token_ids)`` tokens through the pages
    ``block_ids``. Logits are returned for the last ``num_logits`` tokens (0 for a prefill
    chunk that does not end the prompt, 1 to sample, ``k + 1`` to verify ``k`` drafts).
    """

    token_ids: Sequence[int]
    start_position: int
    slot_ids: Sequence[int]
    block_ids: Sequence[int]
    num_logits: int


class PagedAttention:
    """Attention over the paged cache for a batch of chunks (the CPU path).

    For each layer: write the new K and V into their slots, then per chunk gather the
    context through its block table and run scaled-dot-product attention with the
    bottom-right causal mask (query ``i`` of a chunk starting at position ``s`` sees keys
    ``0 .. s + i``), which is what a multi-token append (a prefill chunk or ``k + 1`` verify
    tokens) needs. Each request's attention is computed on its own, so its result does not
    depend on what else is in the batch.
    """

    def __init__(self, cache: PagedKVCache, chunks: Sequence[Chunk], device: torch.device) -> None:
        self.cache = cache
        self.slot_ids = torch.tensor(
            [s for c in chunks for s in c.slot_ids], dtype=torch.long, device=device
        )
        self.spans: list[tuple[int, int, int, torch.Tensor, torch.Tensor | None]] = []
        start = 0
        for c in chunks:
            n = len(c.token_ids)
            context = c.start_position + n
            block_ids = torch.tensor(c.block_ids, dtype=torch.long, device=device)
            mask = None
            if n > 1:
                mask = torch.ones(n, context, dtype=torch.bool, device=device).tril(
                    diagonal=c.start_position
                )
            self.spans.append((start, n, context, block_ids, mask))
            start += n

    def __call__(
        self, layer_id: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor:
        self.cache.write(layer_id, self.slot_ids, k, v)
        group = q.shape[1] // k.shape[1]
        out = torch.empty_like(q)
        for start, n, context, block_ids, mask in self.spans:
            k_ctx, v_ctx = self.cache.read(layer_id, block_ids, context)
            qs = q[start : start + n].transpose(0, 1)
            ks = k_ctx.repeat_interleave(group, dim=1).transpose(0, 1)
            vs = v_ctx.repeat_interleave(group, dim=1).transpose(0, 1)
            attn = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask)
            out[start : start + n] = attn.transpose(0, 1)
        return out


class ModelRunner:
    """Runs the model on a batch of chunks against a paged KV cache."""

    def __init__(self, model: Llama, cache: PagedKVCache) -> None:
        self.model = model
        self.cache = cache
        self.device = model.device

    def execute(self, chunks: Sequence[Chunk]) -> list[torch.Tensor]:
        """Logits ``[c.num_logits, vocab_size]`` (model dtype) for each chunk, in order.

        Mutates the cache: the K and V of every chunk token are written to its slot.
        """
        if not chunks:
            return []
        input_ids = torch.tensor(
            [t for c in chunks for t in c.token_ids], dtype=torch.long, device=self.device
        )
        positions = torch.cat(
            [torch.arange(c.start_position, c.start_position + len(c.token_ids)) for c in chunks]
        ).to(self.device)
        rows: list[int] = []
        end = 0
        for c in chunks:
            end += len(c.token_ids)
            rows.extend(range(end - c.num_logits, end))
        attention = PagedAttention(self.cache, chunks, self.device)
        logits = self.model(
            input_ids, positions, attention, torch.tensor(rows, dtype=torch.long, device=self.device)
        )
        return list(logits.split([c.num_logits for c in chunks]))
