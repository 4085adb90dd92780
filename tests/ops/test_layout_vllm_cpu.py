"""``KVLayout.vllm_cpu`` without vLLM: records and fingerprint equal ``vllm_flash``'s, round
trips, refusals. tests/vllm/test_layout.py checks it against vLLM's own cache-write kernel."""

from __future__ import annotations

import pytest
import torch

from lumen_core.layouts import KVLayout
from lumen_core.ops import gather_tokens, scatter_tokens


def test_records_and_fingerprint_equal_vllm_flash():
    torch.manual_seed(1)
    num_layers, num_blocks, num_kv_heads, block_size, head_dim = 2, 4, 2, 32, 64
    caches = list(torch.randn(num_layers, num_blocks, num_kv_heads, block_size, 2 * head_dim).unbind(0))
    flash = torch.zeros(num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim)
    for layer, cache in enumerate(caches):  # K is [D, block_size] per (block, head), then V
        k_half, v_half = cache.view(num_blocks, num_kv_heads, 2, block_size * head_dim).unbind(2)
        k = k_half.view(num_blocks, num_kv_heads, head_dim, block_size).transpose(2, 3)
        flash[layer, 0] = k.transpose(1, 2)
        flash[layer, 1] = v_half.view(num_blocks, num_kv_heads, block_size, head_dim).transpose(1, 2)
    cpu = KVLayout.vllm_cpu(caches, isa="vec")
    reference = KVLayout.vllm_flash(list(flash.unbind(0)))
    slot_ids = torch.tensor([0, 31, 32, 100, 127])
    assert torch.equal(gather_tokens(cpu, slot_ids), gather_tokens(reference, slot_ids))
    assert cpu.fingerprint() == reference.fingerprint()
    assert cpu.record_bytes == reference.record_bytes
    assert cpu.kind == "vllm_cpu"


def test_scatter_round_trips_into_other_slots():
    torch.manual_seed(2)
    caches = list(torch.randn(2, 3, 2, 32, 64).unbind(0))
    layout = KVLayout.vllm_cpu(caches, isa="vec")
    records = gather_tokens(layout, torch.arange(40))
    target = [torch.zeros_like(c) for c in caches]
    target_layout = KVLayout.vllm_cpu(target, isa="vec")
    scatter_tokens(target_layout, torch.arange(50, 90), records)
    assert torch.equal(gather_tokens(target_layout, torch.arange(50, 90)), records)


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
