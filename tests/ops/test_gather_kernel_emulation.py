"""The CUDA kernel's per-lane code, run on the CPU (gather.cu: emulate_move_tokens_on_host),
against the reference: its index math, grid-stride loop and access-width choice are tested on
machines without a GPU. Runs whenever the CUDA module was built (it needs no device)."""

import pytest
import torch

from lumen_core import _native, reference
from lumen_core.testing import LAYOUT_KINDS, make_paged_cache, random_tensor

pytestmark = pytest.mark.skipif(_native.C_cuda is None, reason="the CUDA module was not built")
DTYPES = [torch.float32, torch.bfloat16, torch.float8_e4m3fn]


def emulate(layout, ids, records, direction, num_blocks=0):
    cuda = _native.C_cuda
    ids = ids.to(torch.int64).contiguous()
    cuda.emulate_move_tokens_on_host(
        records.data_ptr(),
        layout.descriptors().data_ptr(),
        layout.num_planes,
        layout.record_bytes,
        ids.data_ptr(),
        ids.numel(),
        getattr(cuda.MoveDirection, direction),
        num_blocks,
    )


def planes_bytes(layout):
    return [view.contiguous().view(torch.uint8).clone() for view in layout.views]


def misaligned_records(n, record_bytes, offset):
    """[n, record_bytes] uint8 starting `offset` bytes past a 64-byte boundary."""
    base = torch.zeros(n * record_bytes + 128, dtype=torch.uint8)
    shift = (-base.data_ptr()) % 64 + offset
    return base[shift : shift + n * record_bytes].view(n, record_bytes)


@pytest.mark.parametrize("kind", LAYOUT_KINDS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_blocks", [0, 1, 3])
def test_gather_matches_reference(kind, dtype, num_blocks):
    layout = make_paged_cache(
        kind, num_layers=2, num_blocks=8, block_size=16, num_kv_heads=2, head_dim=64, dtype=dtype
    )
    ids = torch.randperm(layout.num_slots, generator=torch.Generator().manual_seed(1))[:17]
    records = torch.zeros(17, layout.record_bytes, dtype=torch.uint8)
    emulate(layout, ids, records, "gather", num_blocks)
    assert torch.equal(records, reference.gather_tokens(layout, ids))


@pytest.mark.parametrize("offset", [1, 4, 8])
def test_narrow_accesses_when_records_are_misaligned(offset):
    layout = make_paged_cache("vllm_flash_hnd", num_layers=2, num_blocks=4, block_size=16, head_dim=64)
    ids = torch.tensor([0, 5, 63, 17])
    records = misaligned_records(4, layout.record_bytes, offset)
    emulate(layout, ids, records, "gather")
    assert torch.equal(records, reference.gather_tokens(layout, ids))


@pytest.mark.parametrize("kind", LAYOUT_KINDS)
def test_scatter_writes_exactly_the_named_slots(kind):
    layout = make_paged_cache(kind, num_layers=2, num_blocks=8, block_size=16, head_dim=64)
    twin = make_paged_cache(kind, num_layers=2, num_blocks=8, block_size=16, head_dim=64)
    ids = torch.randperm(layout.num_slots, generator=torch.Generator().manual_seed(2))[:33]
    records = random_tensor(
        (33, layout.record_bytes), torch.uint8, generator=torch.Generator().manual_seed(3)
    )
    emulate(layout, ids, records, "scatter", num_blocks=2)
    reference.scatter_tokens(twin, ids, records)
    assert all(torch.equal(a, b) for a, b in zip(planes_bytes(layout), planes_bytes(twin)))


def test_out_of_range_slots_never_reach_the_cache():
    # Callers refuse such ids unless check_slots=False; the kernel must not go through them.
    layout = make_paged_cache("vllm_flash", num_layers=1, num_blocks=2, block_size=16, head_dim=64)
    before = planes_bytes(layout)
    records = torch.full((2, layout.record_bytes), 7, dtype=torch.uint8)
    emulate(layout, torch.tensor([32, -1]), records, "scatter")
    assert all(torch.equal(a, b) for a, b in zip(planes_bytes(layout), before))
    emulate(layout, torch.tensor([32, 3]), records, "gather")
    assert bool((records[0] == 0).all())  # a bad id's record reads as zeros
    assert torch.equal(records[1], reference.gather_tokens(layout, torch.tensor([3]))[0])
