"""``KVLayout.vllm_paged`` against the KV-cache views vLLM makes for its GPU backends: vLLM's own
``compute_layout_strides`` and ``create_kv_cache_views`` for each physical order, K and V
written as the flash backend writes them (``reshape_and_cache_flash`` puts a token's K and V at
``[block, offset]`` of the views ``do_kv_cache_update`` takes; the CUDA kernel itself is not in
this CPU build of vLLM). ``make_paged_cache`` builds the same strides for the `cuda` tests that
run the gather kernels and the streamer on such caches on a GPU (scripts/gpu_check.sh)."""

from __future__ import annotations

import pytest
import torch
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheTensor,
    compute_layout_strides,
    create_kv_cache_views,
)
from vllm.v1.kv_cache_layout import KVCacheLayout

from lumen_core.layouts import KVLayout
from lumen_core.ops import gather_tokens, scatter_tokens
from lumen_core.testing import VLLM_PAGED_ORDERS, make_paged_cache

LAYERS, BLOCKS, BLOCK_SIZE, HEADS, HEAD_SIZE, TOKENS = 3, 6, 16, 2, 64, 40


def vllm_views(kind: str, dtype: torch.dtype) -> list[torch.Tensor]:
    """One zeroed allocation viewed per layer as vLLM's GPU worker views it."""
    spec = FullAttentionSpec(block_size=BLOCK_SIZE, num_kv_heads=HEADS, head_size=HEAD_SIZE, dtype=dtype)
    layout = KVCacheLayout(VLLM_PAGED_ORDERS[kind])
    layer_stride, block_stride, *_ = compute_layout_strides(spec, BLOCKS, LAYERS, layout)
    size = LAYERS * BLOCKS * spec.page_size_bytes
    placement = KVCacheTensor(
        size=size,
        layers=[f"layer{i}" for i in range(LAYERS)],
        layer_stride=layer_stride,
        block_stride=block_stride,
    )
    return create_kv_cache_views(torch.zeros(size, dtype=torch.int8), spec, BLOCKS, layout, placement)


def kv_of(view: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The key and value caches FlashAttentionImpl.do_kv_cache_update writes through."""
    key_cache, value_cache = view.transpose(1, 2).split(HEAD_SIZE, dim=-1)
    return key_cache, value_cache


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("kind", sorted(VLLM_PAGED_ORDERS))
def test_records_are_the_kv_vllms_views_hold(kind: str, dtype: torch.dtype) -> None:
    views = vllm_views(kind, dtype)
    layout = KVLayout.vllm_paged(views)
    twin, flash = (
        make_paged_cache(
            name,
            num_layers=LAYERS,
            num_blocks=BLOCKS,
            block_size=BLOCK_SIZE,
            num_kv_heads=HEADS,
            head_dim=HEAD_SIZE,
            dtype=dtype,
        )
        for name in (kind, "vllm_flash")
    )
    assert [(v.shape, v.stride()) for v in layout.views] == [(v.shape, v.stride()) for v in twin.views]
    assert layout.fingerprint() == flash.fingerprint()

    gen = torch.Generator().manual_seed(0)
    slots = torch.randperm(BLOCKS * BLOCK_SIZE, generator=gen)[:TOKENS]
    blocks, offsets = slots // BLOCK_SIZE, slots % BLOCK_SIZE
    written = []
    for view in views:
        key, value = (torch.randn(TOKENS, HEADS, HEAD_SIZE, generator=gen).to(dtype) for _ in range(2))
        key_cache, value_cache = kv_of(view)
        key_cache[blocks, offsets] = key
        value_cache[blocks, offsets] = value
        written += [key.reshape(TOKENS, -1), value.reshape(TOKENS, -1)]
    records = gather_tokens(layout, slots)
    assert torch.equal(records, torch.cat(written, dim=1).view(torch.uint8))

    fresh = vllm_views(kind, dtype)
    scatter_tokens(KVLayout.vllm_paged(fresh), slots, records)
    for view, other in zip(views, fresh):
        assert torch.equal(view.view(torch.uint8), other.view(torch.uint8))


def test_a_cache_without_k_and_v_of_one_size_is_refused() -> None:
    with pytest.raises(ValueError, match="even size"):
        KVLayout.vllm_paged([torch.zeros(2, 1, 4, 5)])


def test_the_kinds_are_vllms_layouts_of_their_names() -> None:
    """vllm_paged is vLLM's default order (NHD within a block), the others head-major and
    block-outermost."""
    names = {kind: KVCacheLayout(order).name for kind, order in VLLM_PAGED_ORDERS.items()}
    assert names == {"vllm_paged": "LBNHC", "vllm_paged_hnd": "LBHNC", "vllm_paged_blocks_outer": "BLNHC"}
