"""``KVLayout.vllm_cpu`` against what vLLM's own CPU cache-write kernel wrote: gathered records,
and a scatter of them into an empty cache, for scattered slots and for runs (the native path
transposes runs of a block tile by tile)."""

from __future__ import annotations

import pytest
import torch
from vllm import _custom_ops as vllm_ops
from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

from lumen_core.layouts import KVLayout
from lumen_core.ops import gather_tokens, scatter_tokens


def _write_with_vllm(
    cache: torch.Tensor, key: torch.Tensor, value: torch.Tensor, slot_ids: torch.Tensor, isa: str
):
    """What CPUAttentionBackendImpl.do_kv_cache_update does with one layer's cache."""
    num_blocks, num_kv_heads, block_size, _ = cache.shape
    key_cache, value_cache = cache.view(num_blocks, num_kv_heads, block_size * 2, -1).chunk(2, dim=2)
    vllm_ops.cpu_attn_reshape_and_cache(
        key, value, key_cache, value_cache, slot_ids, isa, k_scale=1.0, v_scale=1.0, kv_cache_dtype="auto"
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_kv_heads, head_dim", [(1, 32), (2, 64), (3, 80)])
@pytest.mark.parametrize("num_layers", [1, 3])
@pytest.mark.parametrize("slots", ["scattered", "runs"])
def test_records_are_the_kv_vllm_wrote(
    dtype: torch.dtype, num_kv_heads: int, head_dim: int, num_layers: int, slots: str
):
    torch.manual_seed(0)
    num_blocks, block_size, num_tokens = 5, 32, 71
    isa = _get_attn_isa(dtype, block_size, head_dim, "auto")
    if isa == "amx":
        pytest.skip("this CPU has AMX: vLLM prepacks bf16 blocks, which vllm_cpu refuses (tested below)")
    storage = torch.zeros(num_layers, num_blocks, num_kv_heads, block_size, 2 * head_dim, dtype=dtype)
    caches = list(storage.unbind(0))  # one storage, like vLLM's CPU worker
    if slots == "scattered":
        slot_ids = torch.randperm(num_blocks * block_size)[:num_tokens]
    else:  # the end of block 0, all of block 1, the start of block 2
        slot_ids = torch.arange(20, 20 + num_tokens)
    keys = torch.randn(num_layers, num_tokens, num_kv_heads, head_dim).to(dtype)
    values = torch.randn(num_layers, num_tokens, num_kv_heads, head_dim).to(dtype)
    for layer in range(num_layers):
        _write_with_vllm(caches[layer], keys[layer], values[layer], slot_ids, isa)

    records = gather_tokens(KVLayout.vllm_cpu(caches, isa=isa), slot_ids)
    restored = torch.zeros_like(storage)
    scatter_tokens(KVLayout.vllm_cpu(list(restored.unbind(0)), isa=isa), slot_ids, records)

    # The record of vllm_flash for the same K/V: per layer K [H, D] then V [H, D].
    expected = torch.cat(
        [
            torch.cat([keys[layer], values[layer]], dim=1).reshape(num_tokens, -1)
            for layer in range(num_layers)
        ],
        dim=1,
    )
    assert torch.equal(records, expected.view(torch.uint8).reshape(num_tokens, -1))
    assert torch.equal(restored.view(torch.uint8), storage.view(torch.uint8))  # vLLM's bytes, nothing else
