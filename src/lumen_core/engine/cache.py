"""The paged KV cache in vLLM's flash layout: per layer ``[2, num_blocks, block_size, H, D]``."""

from __future__ import annotations

import torch

from lumen_core.engine.config import CacheConfig, ModelConfig
from lumen_core.layouts import KVLayout


class PagedKVCache:
    """K and V pages of every layer; ``kv_caches[l][0]`` is K and ``kv_caches[l][1]`` is V.

    Token slot ``s`` is block ``s // block_size``, offset ``s % block_size`` (vLLM's
    ``slot_mapping``). ``layout()`` describes these tensors to ``gather_tokens`` and
    ``scatter_tokens``, which then move a token's K and V of all layers as one record.
    """

    def __init__(
        self,
        model_config: ModelConfig,
        cache_config: CacheConfig,
        *,
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
    ) -> None:
        self.model_config = model_config
        self.cache_config = cache_config
        shape = (
            2,
            cache_config.num_blocks,
            cache_config.block_size,
            model_config.num_kv_heads,
            model_config.head_dim,
        )
        self.kv_caches = [
            torch.zeros(shape, dtype=dtype, device=device) for _ in range(model_config.num_layers)
        ]

    @property
    def block_size(self) -> int:
        return self.cache_config.block_size

    def write(self, layer_id: int, slot_ids: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store ``k`` and ``v`` ``[T, H, D]`` of layer ``layer_id`` into ``slot_ids`` ``[T]``."""
        kv = self.kv_caches[layer_id]
        flat = kv.view(2, -1, kv.shape[3], kv.shape[4])
        flat[0].index_copy_(0, slot_ids, k)
        flat[1].index_copy_(0, slot_ids, v)

    def read(
        self, layer_id: int, block_ids: torch.Tensor, num_tokens: int | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V ``[num_tokens, H, D]`` of the first ``num_tokens`` tokens (all if None) held
        by the pages ``block_ids`` (a block table row, or several rows flattened), gathered
        into new contiguous tensors."""
        kv = self.kv_caches[layer_id]
        pages = kv.index_select(1, block_ids)
        pages = pages.view(2, -1, kv.shape[3], kv.shape[4])[:, :num_tokens]
        return pages[0], pages[1]

    def layout(self) -> KVLayout:
        """The ``KVLayout`` of these tensors (vLLM flash NHD), for gather/scatter of records."""
        return KVLayout.vllm_flash(self.kv_caches)
