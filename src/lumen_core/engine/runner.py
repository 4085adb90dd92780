"""The only part of the engine that touches tensors: batch assembly, paged attention, logits."""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
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


# flash-attn 2 reads a paged cache only when its pages hold a multiple of 256 tokens, and
# only in half precision; anything else takes the gather + SDPA path, which runs anywhere.
FLASH_BLOCK_SIZE_MULTIPLE = 256
FLASH_DTYPES = (torch.float16, torch.bfloat16)


def find_flash_attn(cache: PagedKVCache) -> Callable[..., torch.Tensor] | None:
    """``flash_attn_with_kvcache`` when it is installed and can read ``cache``, else None."""
    kv = cache.kv_caches[0]
    if kv.device.type != "cuda" or kv.dtype not in FLASH_DTYPES:
        return None
    if cache.block_size % FLASH_BLOCK_SIZE_MULTIPLE != 0:
        return None
    try:
        from flash_attn import flash_attn_with_kvcache
    except ImportError:
        return None
    return flash_attn_with_kvcache


class PagedAttention:
    """Attention over the paged cache for a batch of chunks.

    For each layer: write the new K and V into their slots, then read each request's context
    through its block table. Chunks with the same number of new tokens (all decodes; all
    ``k + 1``-token verifies) run as one batched scaled-dot-product attention over their
    block tables padded to the longest, with the bottom-right causal mask: query ``i`` of a
    chunk starting at position ``s`` sees keys ``0 .. s + i`` (which also hides the padding).
    A request reads only its own pages, so its result does not depend on the rest of the batch.

    With ``flash`` (``flash_attn_with_kvcache``, see ``find_flash_attn``) each group instead
    runs one flash-attention call that reads the pages through the block table in place
    (its ``causal=True`` is bottom-right aligned for ``n`` new tokens against a longer cache).
    """

    def __init__(
        self,
        cache: PagedKVCache,
        chunks: Sequence[Chunk],
        device: torch.device,
        flash: Callable[..., torch.Tensor] | None = None,
    ) -> None:
        self.cache = cache
        self.flash = flash
        self.slot_ids = torch.tensor([s for c in chunks for s in c.slot_ids], dtype=torch.long, device=device)
        starts = list(itertools.accumulate((len(c.token_ids) for c in chunks), initial=0))
        groups: dict[int, list[int]] = {}
        for i, c in enumerate(chunks):
            groups.setdefault(len(c.token_ids), []).append(i)
        # Per group: query rows [G * n], flattened padded block table, mask [G, 1, n, L],
        # and for flash-attn the block table [G, width] and context lengths [G] as int32.
        self.groups: list[tuple[int, torch.Tensor, torch.Tensor, torch.Tensor]] = []
        self.flash_args: list[tuple[torch.Tensor, torch.Tensor]] = []
        for n, members in groups.items():
            width = max(len(chunks[i].block_ids) for i in members)
            table = [list(chunks[i].block_ids) + [0] * (width - len(chunks[i].block_ids)) for i in members]
            rows = torch.tensor(
                [starts[i] + j for i in members for j in range(n)], dtype=torch.long, device=device
            )
            last_key = torch.tensor([chunks[i].start_position for i in members], device=device)
            last_key = last_key[:, None] + torch.arange(n, device=device)[None, :]
            keys = torch.arange(width * cache.block_size, device=device)
            mask = (keys[None, None, :] <= last_key[:, :, None])[:, None]
            pages = torch.tensor(table, dtype=torch.long, device=device).flatten()
            self.groups.append((n, rows, pages, mask))
            if flash is not None:
                seqlens = torch.tensor(
                    [chunks[i].start_position + n for i in members],
                    dtype=torch.int32,
                    device=device,
                )
                self.flash_args.append((pages.view(len(members), width).to(torch.int32), seqlens))

    def __call__(self, layer_id: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        self.cache.write(layer_id, self.slot_ids, k, v)
        out = torch.empty_like(q)
        if self.flash is not None:
            kv = self.cache.kv_caches[layer_id]
            for (n, rows, _, _), (table, seqlens) in zip(self.groups, self.flash_args, strict=True):
                qs = q[rows].view(-1, n, *q.shape[1:])
                attn = self.flash(qs, kv[0], kv[1], cache_seqlens=seqlens, block_table=table, causal=True)
                out[rows] = attn.reshape(-1, *q.shape[1:])
            return out
        for n, rows, pages, mask in self.groups:
            g = mask.shape[0]
            k_ctx, v_ctx = self.cache.read(layer_id, pages, None)
            k_ctx = k_ctx.view(g, -1, *k_ctx.shape[1:]).transpose(1, 2)
            v_ctx = v_ctx.view(g, -1, *v_ctx.shape[1:]).transpose(1, 2)
            qs = q[rows].view(g, n, *q.shape[1:]).transpose(1, 2)
            attn = F.scaled_dot_product_attention(qs, k_ctx, v_ctx, attn_mask=mask, enable_gqa=True)
            out[rows] = attn.transpose(1, 2).reshape(g * n, *q.shape[1:])
        return out


class ModelRunner:
    """Runs the model on a batch of chunks against a paged KV cache (with flash-attn when
    ``find_flash_attn`` finds it usable, else gather + SDPA)."""

    def __init__(self, model: Llama, cache: PagedKVCache) -> None:
        self.model = model
        self.cache = cache
        self.device = model.device
        self.flash = find_flash_attn(cache)

    def execute(self, chunks: Sequence[Chunk]) -> list[torch.Tensor]:
        """Logits ``[c.num_logits, vocab_size]`` (model dtype) for each chunk, in order.

        Mutates the cache: the K and V of every chunk token are written to its slot.
        """
        if not chunks:
            return []
        input_ids = torch.tensor(
            [t for c in chunks for t in c.token_ids], dtype=torch.long, device=self.device
        )
        positions = torch.tensor(
            [p for c in chunks for p in range(c.start_position, c.start_position + len(c.token_ids))],
            dtype=torch.long,
            device=self.device,
        )
        rows: list[int] = []
        end = 0
        for c in chunks:
            end += len(c.token_ids)
            rows.extend(range(end - c.num_logits, end))
        attention = PagedAttention(self.cache, chunks, self.device, self.flash)
        logits = self.model(
            input_ids,
            positions,
            attention,
            torch.tensor(rows, dtype=torch.long, device=self.device),
        )
        return list(logits.split([c.num_logits for c in chunks]))
