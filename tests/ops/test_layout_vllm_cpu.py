"""``KVLayout.vllm_cpu`` without vLLM: records and fingerprint equal ``vllm_flash``'s, the
native gather/scatter (blocked transposes of K for runs of slots, element by element
otherwise) equal the Python reference bit for bit, round trips, refusals.
tests/vllm/test_layout.py checks it against vLLM's own cache-write kernel; test_copy_routines.py
runs it under the portable transposes too."""

from __future__ import annotations

import pytest
import torch

from lumen_core import reference
from lumen_core.layouts import KVLayout
from lumen_core.ops import gather_tokens, scatter_tokens


def _random_caches(num_layers: int, shape: tuple[int, ...], dtype: torch.dtype) -> list[torch.Tensor]:
    """Random bytes viewed as ``dtype`` (every bit pattern, NaNs included: ops move bytes)."""
    item = torch.empty((), dtype=dtype).element_size()
    raw = torch.randint(0, 256, (num_layers, *shape[:-1], shape[-1] * item), dtype=torch.uint8)
    return list(raw.view(dtype).unbind(0))


def _flash_records(caches: list[torch.Tensor], slot_ids: torch.Tensor) -> torch.Tensor:
    """The records of ``slot_ids`` computed with torch alone: per layer K [H, D] then V [H, D]."""
    rows = []
    for cache in caches:
        num_blocks, num_kv_heads, block_size, two_head_dim = cache.shape
        head_dim = two_head_dim // 2
        k_half, v_half = cache.view(num_blocks, num_kv_heads, 2, block_size * head_dim).unbind(2)
        k = k_half.view(num_blocks, num_kv_heads, head_dim, block_size).permute(0, 3, 1, 2)
        v = v_half.view(num_blocks, num_kv_heads, block_size, head_dim).transpose(1, 2)
        for half in (k, v):
            rows.append(half.reshape(num_blocks * block_size, -1)[slot_ids].contiguous().view(torch.uint8))
    return torch.cat(rows, dim=1)


def _as_bytes(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    return [t.contiguous().view(torch.uint8) for t in tensors]


# 1-, 2-, 4- and 8-byte elements: each a width of the native small-piece and transpose paths.
@pytest.mark.parametrize("dtype", [torch.int8, torch.bfloat16, torch.float16, torch.float32, torch.float64])
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
    # Scattered slots, then whole blocks 1 and 2 (runs the native gather transposes tile by tile).
    slot_ids = torch.cat(
        [torch.tensor([0, 31, 32, 100, 127, 33, 34, 35]), torch.arange(block_size, 3 * block_size)]
    )
    assert torch.equal(gather_tokens(cpu, slot_ids), gather_tokens(reference, slot_ids))
    assert cpu.fingerprint() == reference.fingerprint()
    assert cpu.record_bytes == reference.record_bytes
    assert cpu.kind == "vllm_cpu"


def _slot_sets(block_size: int, num_slots: int, generator: torch.Generator) -> dict[str, torch.Tensor]:
    """Slot sets that reach every branch of the native path: whole blocks, runs that start and
    end inside blocks and cross their boundaries, runs not on a 64-byte line, blocks out of
    order, scattered slots, single slots."""
    bs = block_size
    return {
        "whole_blocks": torch.arange(bs, 4 * bs),
        "partial_blocks": torch.arange(bs // 2 + 1, 3 * bs - 3),
        "off_line_run": torch.arange(5, 5 + 2 * bs),
        "blocks_out_of_order": torch.cat(
            [torch.arange(2 * bs, 3 * bs), torch.arange(0, bs), torch.arange(3 * bs, 4 * bs)]
        ),
        "descending": torch.arange(2 * bs - 1, -1, -1),
        "scattered": torch.randperm(num_slots, generator=generator)[:37],
        "single": torch.tensor([bs + 3]),
    }


@pytest.mark.parametrize("dtype", [torch.int8, torch.bfloat16, torch.float16, torch.float32, torch.float64])
@pytest.mark.parametrize("block_size", [16, 32, 128])
@pytest.mark.parametrize("head_dim", [32, 80])  # 80: tiles of 32 rows and an edge of 16
def test_native_equals_reference(dtype: torch.dtype, block_size: int, head_dim: int):
    gen = torch.Generator().manual_seed(block_size * head_dim)
    caches = _random_caches(2, (5, 2, block_size, 2 * head_dim), dtype)
    layout = KVLayout.vllm_cpu(caches, isa="vec")
    for name, slot_ids in _slot_sets(block_size, layout.num_slots, gen).items():
        for num_threads in (1, 2):
            assert torch.equal(
                gather_tokens(layout, slot_ids, num_threads=num_threads),
                reference.gather_tokens(layout, slot_ids),
            ), name
            records = torch.randint(
                0, 256, (slot_ids.numel(), layout.record_bytes), dtype=torch.uint8, generator=gen
            )
            twin_caches = [cache.clone() for cache in caches]
            scatter_tokens(layout, slot_ids, records, num_threads=num_threads)
            reference.scatter_tokens(KVLayout.vllm_cpu(twin_caches, isa="vec"), slot_ids, records)
            assert all(map(torch.equal, _as_bytes(caches), _as_bytes(twin_caches))), name


def test_gather_repeats_slots():
    caches = _random_caches(1, (3, 2, 32, 64), torch.bfloat16)
    layout = KVLayout.vllm_cpu(caches, isa="vec")
    slot_ids = torch.cat([torch.arange(32, 64), torch.arange(32, 64), torch.tensor([40, 40])])
    assert torch.equal(gather_tokens(layout, slot_ids), _flash_records(caches, slot_ids))


def test_large_restore_batch_streams_the_same_bytes():
    """32 MiB of records: above a quarter of the last-level cache here, so the gather streams."""
    torch.manual_seed(3)
    caches = _random_caches(1, (66, 8, 128, 256), torch.bfloat16)
    layout = KVLayout.vllm_cpu(caches, isa="vec")
    slot_ids = torch.arange(128, 128 + 8192)
    records = gather_tokens(layout, slot_ids, num_threads=2)
    assert torch.equal(records, _flash_records(caches, slot_ids))
    target = [torch.zeros_like(cache) for cache in caches]
    scatter_tokens(KVLayout.vllm_cpu(target, isa="vec"), slot_ids, records, num_threads=2)
    assert torch.equal(target[0][1:65].view(torch.uint8), caches[0][1:65].view(torch.uint8))
    assert not target[0][0].view(torch.uint8).any() and not target[0][65].view(torch.uint8).any()


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


@pytest.mark.parametrize(
    ("dtype", "block_size", "line"),
    [(torch.float32, 128, 16), (torch.bfloat16, 128, 32), (torch.int8, 32, 32), (torch.float64, 128, 8)],
)
def test_line_tokens_counts_the_slots_that_share_a_line_of_k(dtype: torch.dtype, block_size: int, line: int):
    """K transposed per block and head: a line holds ``64 / element bytes`` consecutive slots
    (at most a block's); layouts that keep a token's row apart share none."""
    assert KVLayout.vllm_cpu(_random_caches(1, (2, 2, block_size, 16), dtype), isa="vec").line_tokens == line
    flash = KVLayout.vllm_flash([torch.zeros(2, 2, 16, 2, 32)])
    assert flash.line_tokens == 1
