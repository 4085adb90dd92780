"""``KVLayout.vllm_cpu`` without vLLM: records and fingerprint equal ``vllm_flash``'s, round
trips, refusals. tests/vllm/test_layout.py checks it against vLLM's own cache-write kernel."""

from __future__ import annotations

import pytest
import torch

from lumen_core.layouts import KVLayout
from lumen_core.ops import gather_tokens, scatter_tokens


def _random_caches(num_layers: int, shape: tuple[int, ...], dtype: torch.dtype) -> list[torch.Tensor]:
    """Random bytes viewed as ``dtype`` (every bit pattern, NaNs included: ops move bytes)."""
    item = torch.empty((), dtype=dtype).element_size()
    raw = torch.randint(0, 256, (num_layers, *shape[:-1], shape[-1] * item), dtype=torch.uint8)
    return list(raw.view(dtype).unbind(0))


# 1-, 2-, 4- and 8-byte elements: each a width of the native copy's small-piece path.
@pytest.mark.parametrize("dtype", [torch.int8, torch.bfloat16, torch.float32, torch.float64])
@pytest.mark.parametrize("block_size", [32, 128])
def test_records_and_fingerprint_equal_vllm_flash(dtype: torch.dtype, block_size: int):
    torch.manual_seed(1)
    num_layers, num_blocks, num_kv_heads, head_dim = 2, 4, 2, 64
    caches = _random_caches(num_layers, (num_blocks, num_kv_heads, block_size, 2 * head_dim), dtype)
    flash = torch.zeros(num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim, dtype=dtype)
    for layer, cache in enumerate(caches):  # K is [D, block_size] per (block, head), then V
        k_half, v_half = cache.view(num_blocks, num_kv_heads, 2, block_size * head_dim).unbind(2)
        k = k_half.view(num_blocks, num_kv_heads, head_dim, block_size).transpose(2, 3)
        flash[layer, 0] = k.transpose(1, 2)
        flash[layer, 1] = v_half.view(num_blocks, num_kv_heads, block_size, head_dim).transpose(1, 2)
    cpu = KVLayout.vllm_cpu(caches, isa="vec")
    reference = KVLayout.vllm_flash(list(flash.unbind(0)))
    slot_ids = torch.tensor([0, 31, 32, 100, 127, 33, 34, 35])
    assert torch.equal(gather_tokens(cpu, slot_ids), gather_tokens(reference, slot_ids))
    assert cpu.fingerprint() == reference.fingerprint()
    assert cpu.record_bytes == reference.record_bytes
    assert cpu.kind == "vllm_cpu"


@pytest.mark.parametrize("dtype", [torch.int8, torch.bfloat16, torch.float32, torch.float64])
def test_scatter_round_trips_into_other_slots(dtype: torch.dtype):
    torch.manual_seed(2)
    caches = _random_caches(2, (3, 2, 32, 64), dtype)
    layout = KVLayout.vllm_cpu(caches, isa="vec")
    records = gather_tokens(layout, torch.arange(40))
    target = [torch.zeros_like(c) for c in caches]
    target_layout = KVLayout.vllm_cpu(target, isa="vec")
    scatter_tokens(target_layout, torch.arange(50, 90), records)
    assert torch.equal(gather_tokens(target_layout, torch.arange(50, 90)), records)
    untouched = torch.cat([torch.arange(0, 50), torch.arange(90, 96)])
    assert not gather_tokens(target_layout, untouched).any()  # only the given slots written


def test_refuses_what_it_cannot_describe():
    cache = torch.zeros(2, 1, 32, 64)
    with pytest.raises(ValueError, match="`isa` must be one of"):
        KVLayout.vllm_cpu([cache], isa="amx")
    with pytest.raises(ValueError, match=r"`kv_caches\[0\]` must be 4-D"):
        KVLayout.vllm_cpu([cache[0]], isa="vec")
    with pytest.raises(ValueError, match="must have an even last dimension"):
        KVLayout.vllm_cpu([torch.zeros(2, 1, 32, 63)], isa="vec")
    with pytest.raises(ValueError, match="must be contiguous"):
        KVLayout.vllm_cpu([torch.zeros(2, 2, 32, 64).transpose(0, 1)], isa="vec")
    with pytest.raises(ValueError, match="must not be an fp8 cache"):
        KVLayout.vllm_cpu([torch.zeros(2, 1, 32, 64, dtype=torch.float8_e4m3fn)], isa="vec")
    with pytest.raises(TypeError, match="`kv_caches` must be a non-empty sequence"):
        KVLayout.vllm_cpu(cache, isa="vec")
