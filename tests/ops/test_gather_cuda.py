"""CUDA gather/scatter (run by scripts/gpu_check.sh on a GPU machine): every layout and record
placement bit-exact against the reference, round trips through host memory, validation."""

import time

import pytest
import torch

from lumen_core import _native, reference
from lumen_core.ops import gather_tokens, scatter_tokens
from lumen_core.testing import LAYOUT_KINDS, make_paged_cache, random_tensor

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not _native.HAS_CUDA, reason="needs a CUDA device and the CUDA module"),
]

MODES = ["device", "mapped", "staged"]
DTYPES = [torch.float32, torch.bfloat16, torch.float8_e4m3fn, torch.int8]


def planes_bytes(layout):
    return [view.contiguous().view(torch.uint8).cpu() for view in layout.views]


def host_records(shape, mode, seed=0):
    records = random_tensor(shape, torch.uint8, generator=torch.Generator().manual_seed(seed))
    return records.cuda() if mode == "device" else records.pin_memory()


@pytest.mark.parametrize("kind", LAYOUT_KINDS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("mode", MODES)
def test_gather_matches_reference(kind, dtype, mode):
    layout = make_paged_cache(kind, num_layers=2, num_blocks=20, block_size=16, dtype=dtype, device="cuda")
    ids = torch.randperm(layout.num_slots, generator=torch.Generator().manual_seed(1))[:257]
    records = gather_tokens(layout, ids, mode=mode)
    torch.cuda.synchronize()
    assert records.device.type == ("cuda" if mode == "device" else "cpu")
    assert torch.equal(records.cpu(), reference.gather_tokens(layout, ids))


@pytest.mark.parametrize("kind", LAYOUT_KINDS)
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("block_size", [1, 16])
def test_scatter_writes_exactly_the_named_slots(kind, mode, block_size):
    layout = make_paged_cache(
        kind, num_layers=3, num_blocks=320 // block_size, block_size=block_size, device="cuda"
    )
    twin = make_paged_cache(
        kind, num_layers=3, num_blocks=320 // block_size, block_size=block_size, device="cuda"
    )
    ids = (
        torch.randperm(layout.num_slots, generator=torch.Generator().manual_seed(2))[:17]
        .to(torch.int32)
        .cuda()
    )
    records = host_records((17, layout.record_bytes), mode, seed=3)
    scatter_tokens(layout, ids, records, mode=mode)
    torch.cuda.synchronize()
    reference.scatter_tokens(twin, ids.cpu(), records.cpu())
    assert all(torch.equal(a, b) for a, b in zip(planes_bytes(layout), planes_bytes(twin)))


@pytest.mark.parametrize("num_tokens", [0, 1, 3, 17, 257])
def test_round_trip_through_pinned_host(num_tokens):
    source = make_paged_cache("vllm_flash_hnd", num_layers=2, num_blocks=20, block_size=16, device="cuda")
    target = make_paged_cache("vllm_flash", num_layers=2, num_blocks=20, block_size=16, device="cuda", seed=5)
    ids = torch.arange(num_tokens, dtype=torch.int64)
    records = gather_tokens(
        source, ids, torch.empty(num_tokens, source.record_bytes, dtype=torch.uint8).pin_memory()
    )
    torch.cuda.synchronize()
    scatter_tokens(target, ids, records)
    back = gather_tokens(target, ids)
    torch.cuda.synchronize()
    assert torch.equal(back.cpu(), records)


def test_side_stream():
    layout = make_paged_cache("vllm_flashinfer", num_layers=2, num_blocks=4, block_size=16, device="cuda")
    stream = torch.cuda.Stream()
    ids = torch.tensor([3, 9, 60])
    records = gather_tokens(layout, ids, mode="mapped", stream=stream)
    stream.synchronize()
    assert torch.equal(records, reference.gather_tokens(layout, ids))


def test_mapped_needs_pinned_out():
    layout = make_paged_cache("vllm_flash", num_layers=1, num_blocks=2, block_size=16, device="cuda")
    out = torch.empty(1, layout.record_bytes, dtype=torch.uint8)
    with pytest.raises(ValueError, match="`out` must be pinned CPU memory for mode 'mapped'"):
        gather_tokens(layout, torch.tensor([0]), out, mode="mapped")


def test_device_mode_needs_device_records():
    layout = make_paged_cache("vllm_flash", num_layers=1, num_blocks=2, block_size=16, device="cuda")
    records = torch.empty(1, layout.record_bytes, dtype=torch.uint8).pin_memory()
    with pytest.raises(ValueError, match="`records` must be on cuda:0, got cpu"):
        scatter_tokens(layout, torch.tensor([0]), records, mode="device")


def test_unknown_mode():
    layout = make_paged_cache("vllm_flash", num_layers=1, num_blocks=2, block_size=16, device="cuda")
    with pytest.raises(
        ValueError, match=r"`mode` must be one of \('device', 'mapped', 'staged'\), got 'zero_copy'"
    ):
        gather_tokens(layout, torch.tensor([0]), mode="zero_copy")


def test_out_of_range_ids_on_device_raise():
    layout = make_paged_cache("vllm_flash", num_layers=1, num_blocks=2, block_size=16, device="cuda")
    with pytest.raises(IndexError, match=r"`slot_ids` must lie in \[0, 32\), got 32"):
        gather_tokens(layout, torch.tensor([1, 32], device="cuda"))


@pytest.mark.parametrize("mode", MODES)
def test_unchecked_device_ids_never_leave_the_cache(mode):
    # check_slots=False: no host-side check; a bad id's record is zeros, its row untouched.
    layout = make_paged_cache("vllm_flash_hnd", num_layers=2, num_blocks=2, block_size=16, device="cuda")
    twin = make_paged_cache("vllm_flash_hnd", num_layers=2, num_blocks=2, block_size=16, device="cuda")
    ids = torch.tensor([1, 32, 5, 1 << 40], device="cuda")
    out = host_records((4, layout.record_bytes), mode, seed=4)
    gather_tokens(layout, ids, out, mode=mode, check_slots=False)
    torch.cuda.synchronize()
    expected = torch.zeros(4, layout.record_bytes, dtype=torch.uint8)
    expected[[0, 2]] = reference.gather_tokens(layout, torch.tensor([1, 5]))
    assert torch.equal(out.cpu(), expected)
    scatter_tokens(layout, ids, out, mode=mode, check_slots=False)
    torch.cuda.synchronize()
    reference.scatter_tokens(twin, torch.tensor([1, 5]), expected[[0, 2]])
    assert all(torch.equal(a, b) for a, b in zip(planes_bytes(layout), planes_bytes(twin)))


@pytest.mark.parametrize("op", ["gather", "scatter"])
def test_cpu_ids_do_not_wait_for_queued_work(op):
    layout = make_paged_cache("vllm_flash", num_layers=2, num_blocks=20, block_size=16, device="cuda")
    ids = torch.arange(40, 57, dtype=torch.int32)
    records = host_records((17, layout.record_bytes), "device", seed=6)
    expected = reference.gather_tokens(layout, ids) if op == "gather" else records.cpu()
    torch.cuda.synchronize()
    stream = torch.cuda.current_stream()
    torch.cuda._sleep(1_000_000_000)  # about half a second of GPU time
    started = time.perf_counter()
    if op == "gather":
        records = gather_tokens(layout, ids)
    else:
        scatter_tokens(layout, ids, records)
    assert time.perf_counter() - started < 0.2 and not stream.query()  # queued, not waited for
    torch.cuda.synchronize()
    assert torch.equal(records.cpu() if op == "gather" else reference.gather_tokens(layout, ids), expected)


def test_stream_type():
    layout = make_paged_cache("vllm_flash", num_layers=1, num_blocks=2, block_size=16, device="cuda")
    with pytest.raises(TypeError, match="`stream` must be a torch.cuda.Stream or None, got int"):
        gather_tokens(layout, torch.tensor([0]), stream=0)
