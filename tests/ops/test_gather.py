"""gather_tokens / scatter_tokens on the CPU: bit-exact against the reference for every layout
and dtype, round trips, the shared index math, and one test per validation branch."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lumen_core import _native, reference
from lumen_core.layouts import KVLayout
from lumen_core.ops import gather_tokens, scatter_tokens
from lumen_core.testing import LAYOUT_KINDS, make_paged_cache, random_tensor

C = _native.require_cpu()
DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float8_e4m3fn, torch.int8]


def planes_bytes(layout: KVLayout) -> list[torch.Tensor]:
    """Every byte of every plane (to check that nothing else was touched)."""
    return [view.contiguous().view(torch.uint8).clone() for view in layout.views]


def distinct_slots(layout: KVLayout, n: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randperm(layout.num_slots, generator=gen)[:n].to(dtype)


@pytest.mark.parametrize("kind", LAYOUT_KINDS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_every_layout_and_dtype_matches_reference(kind, dtype):
    layout = make_paged_cache(kind, num_layers=2, num_blocks=6, block_size=16, dtype=dtype)
    ids = distinct_slots(layout, 17, torch.int64, seed=1)
    records = gather_tokens(layout, ids)
    assert records.dtype == torch.uint8 and records.shape == (17, layout.record_bytes)
    assert torch.equal(records, reference.gather_tokens(layout, ids))
    twin = make_paged_cache(kind, num_layers=2, num_blocks=6, block_size=16, dtype=dtype)
    new = random_tensor((17, layout.record_bytes), torch.uint8, generator=torch.Generator().manual_seed(2))
    scatter_tokens(layout, ids, new)
    reference.scatter_tokens(twin, ids, new)
    assert all(torch.equal(a, b) for a, b in zip(planes_bytes(layout), planes_bytes(twin)))


@pytest.mark.parametrize("num_tokens", [1, 3, 17, 257])
@pytest.mark.parametrize("block_size", [1, 16])
@pytest.mark.parametrize("num_layers", [1, 4])
@pytest.mark.parametrize("id_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("kind", ["vllm_flash", "vllm_flash_hnd"])
def test_sizes_round_trip(num_tokens, block_size, num_layers, id_dtype, kind):
    num_blocks = (300 + block_size - 1) // block_size
    layout = make_paged_cache(kind, num_layers=num_layers, num_blocks=num_blocks, block_size=block_size)
    ids = distinct_slots(layout, num_tokens, id_dtype, seed=num_tokens)
    records = gather_tokens(layout, ids, num_threads=2)
    assert torch.equal(records, reference.gather_tokens(layout, ids))
    target = make_paged_cache(
        kind, num_layers=num_layers, num_blocks=num_blocks, block_size=block_size, seed=9
    )
    scatter_tokens(target, ids, records, num_threads=2)
    assert torch.equal(gather_tokens(target, ids, num_threads=1), records)


def test_consecutive_restore_into_other_block_size():
    source = make_paged_cache("vllm_flash", num_layers=3, num_blocks=20, block_size=16)
    target = make_paged_cache("sglang", num_layers=3, num_blocks=20, block_size=16, seed=3)
    assert source.fingerprint() == target.fingerprint()
    ids = torch.arange(32, 32 + 257)
    records = gather_tokens(source, ids)
    target_ids = torch.arange(10, 10 + 257, dtype=torch.int32)
    scatter_tokens(target, target_ids, records)
    assert torch.equal(gather_tokens(target, target_ids), records)


def test_strided_engine_tensors():
    # Caches that are views into larger buffers: heads and half of each head sliced out of a
    # wider allocation (rows of strided pieces) and every other block of a pool.
    gen = torch.Generator().manual_seed(4)
    wide = [random_tensor((2, 12, 16, 6, 32), torch.float16, generator=gen) for _ in range(2)]
    layout = KVLayout.vllm_flash([w[:, ::2, :, 1:5, :16] for w in wide])
    assert layout.planes[0].num_pieces == 4 and layout.num_blocks == 6
    ids = torch.tensor([0, 95, 17, 40, 3])
    assert torch.equal(gather_tokens(layout, ids), reference.gather_tokens(layout, ids))
    before = [w.clone() for w in wide]
    records = random_tensor((5, layout.record_bytes), torch.uint8, generator=gen)
    scatter_tokens(layout, ids, records)
    assert torch.equal(gather_tokens(layout, ids), records)
    for w, b in zip(wide, before):  # the unused heads and blocks are untouched
        assert torch.equal(w[:, 1::2].view(torch.uint8), b[:, 1::2].view(torch.uint8))
        assert torch.equal(w[..., 0, :].view(torch.uint8), b[..., 0, :].view(torch.uint8))
        assert torch.equal(w[..., 5, :].view(torch.uint8), b[..., 5, :].view(torch.uint8))
        assert torch.equal(
            w[..., 16:].contiguous().view(torch.uint8), b[..., 16:].contiguous().view(torch.uint8)
        )


def test_repeated_ids_gather_repeats_rows():
    layout = make_paged_cache("mla", num_layers=2, num_blocks=4, block_size=16)
    ids = torch.tensor([5, 5, 9, 5])
    records = gather_tokens(layout, ids)
    assert torch.equal(records[0], records[1]) and torch.equal(records[0], records[3])
    assert torch.equal(records, reference.gather_tokens(layout, ids))


def test_empty_batch_is_a_no_op():
    layout = make_paged_cache("vllm_flash", num_layers=2, num_blocks=4, block_size=16)
    before = planes_bytes(layout)
    empty = torch.empty(0, dtype=torch.int64)
    records = gather_tokens(layout, empty)
    assert records.shape == (0, layout.record_bytes)
    scatter_tokens(layout, empty, records)
    assert all(torch.equal(a, b) for a, b in zip(planes_bytes(layout), before))


def test_out_is_written_in_place():
    layout = make_paged_cache("vllm_flashinfer", num_layers=2, num_blocks=4, block_size=16)
    ids = torch.tensor([1, 2, 60])
    out = torch.zeros(3, layout.record_bytes, dtype=torch.uint8)
    assert gather_tokens(layout, ids, out) is out
    assert torch.equal(out, reference.gather_tokens(layout, ids))


@pytest.mark.parametrize("kind", ["vllm_flash", "vllm_flash_hnd", "sglang", "vllm_flash_fp8_scales"])
def test_index_math_matches_torch_addresses(kind):
    # slot_index.h (the header the CUDA kernels use) against torch's own element addresses.
    layout = make_paged_cache(kind, num_layers=2, num_blocks=5, block_size=4)
    slots = [0, 1, 7, layout.num_slots - 1]
    desc = layout.descriptors()
    offsets = C.slot_piece_offsets(desc.data_ptr(), layout.num_planes, layout.record_bytes, slots)
    for t, slot in enumerate(slots):
        for i, (view, plane) in enumerate(zip(layout.views, layout.planes)):
            row = view[slot // layout.block_size, slot % layout.block_size]
            pieces_per_merged = row.shape[0] // plane.num_pieces
            expected = [
                row[p * pieces_per_merged].data_ptr() - view.data_ptr() for p in range(plane.num_pieces)
            ]
            assert offsets[t][i] == expected


def test_native_rechecks_slot_range():
    layout = make_paged_cache("vllm_flash", num_layers=1, num_blocks=2, block_size=16)
    with pytest.raises(IndexError, match="slot 32 outside"):
        C.slot_piece_offsets(layout.descriptors().data_ptr(), layout.num_planes, layout.record_bytes, [32])


def test_native_rechecks_descriptors():
    layout = make_paged_cache("vllm_flash", num_layers=1, num_blocks=2, block_size=16)
    with pytest.raises(ValueError, match="malformed descriptor of plane 1"):
        C.slot_piece_offsets(layout.descriptors().data_ptr(), layout.num_planes, layout.record_bytes - 1, [0])


@settings(max_examples=25, deadline=None)
@given(
    kind=st.sampled_from(LAYOUT_KINDS),
    block_size=st.sampled_from([1, 2, 16]),
    data=st.data(),
)
def test_scatter_writes_exactly_the_named_slots(kind, block_size, data):
    num_blocks = 40 // block_size
    layout = make_paged_cache(kind, num_layers=2, num_blocks=num_blocks, block_size=block_size)
    twin = make_paged_cache(kind, num_layers=2, num_blocks=num_blocks, block_size=block_size)
    ids = data.draw(st.lists(st.integers(0, layout.num_slots - 1), unique=True, max_size=layout.num_slots))
    slot_ids = torch.tensor(ids, dtype=torch.int64)
    seed = data.draw(st.integers(0, 2**31))
    records = random_tensor(
        (len(ids), layout.record_bytes), torch.uint8, generator=torch.Generator().manual_seed(seed)
    )
    scatter_tokens(layout, slot_ids, records)
    reference.scatter_tokens(twin, slot_ids, records)
    assert all(torch.equal(a, b) for a, b in zip(planes_bytes(layout), planes_bytes(twin)))
    assert torch.equal(gather_tokens(layout, slot_ids), records)


# ---- validation: one test per branch ----------------------------------------------------------


@pytest.fixture(scope="module")
def layout():
    return make_paged_cache("vllm_flash", num_layers=2, num_blocks=4, block_size=16)


def test_layout_type(layout):
    with pytest.raises(TypeError, match="`layout` must be a KVLayout, got list"):
        gather_tokens([layout], torch.tensor([0]))


def test_slot_ids_type(layout):
    with pytest.raises(TypeError, match="`slot_ids` must be a torch.Tensor, got list"):
        gather_tokens(layout, [0, 1])


def test_slot_ids_dtype(layout):
    with pytest.raises(
        ValueError, match="`slot_ids` must have dtype torch.int32 or torch.int64, got torch.float32"
    ):
        gather_tokens(layout, torch.tensor([0.0]))


def test_slot_ids_rank(layout):
    with pytest.raises(ValueError, match=r"`slot_ids` must be 1-D, got shape \(1, 2\)"):
        gather_tokens(layout, torch.tensor([[0, 1]]))


def test_slot_ids_device(layout):
    with pytest.raises(ValueError, match="`slot_ids` must be on the CPU, got meta"):
        gather_tokens(layout, torch.zeros(2, dtype=torch.int64, device="meta"))


@pytest.mark.parametrize("bad", [-1, 64])
def test_slot_ids_range(layout, bad):
    with pytest.raises(IndexError, match=rf"`slot_ids` must lie in \[0, 64\), got {bad}"):
        gather_tokens(layout, torch.tensor([0, bad]))
    with pytest.raises(IndexError, match=rf"`slot_ids` must lie in \[0, 64\), got {bad}"):
        scatter_tokens(layout, torch.tensor([bad]), torch.zeros(1, layout.record_bytes, dtype=torch.uint8))


def test_scatter_refuses_repeated_ids(layout):
    records = torch.zeros(3, layout.record_bytes, dtype=torch.uint8)
    with pytest.raises(ValueError, match="`slot_ids` must not repeat in a scatter, got 1 repeated ids"):
        scatter_tokens(layout, torch.tensor([4, 7, 4]), records)


def test_check_slots_type(layout):
    with pytest.raises(TypeError, match="`check_slots` must be a bool, got int"):
        gather_tokens(layout, torch.tensor([0]), check_slots=0)


def test_ids_on_the_cpu_are_checked_even_unasked(layout):
    # Only device ids may skip the check (it would cost a device sync); CPU ids cost nothing.
    with pytest.raises(IndexError, match=r"`slot_ids` must lie in \[0, 64\), got 64"):
        gather_tokens(layout, torch.tensor([0, 64]), check_slots=False)
    with pytest.raises(ValueError, match="`slot_ids` must not repeat in a scatter, got 1 repeated ids"):
        scatter_tokens(
            layout,
            torch.tensor([4, 4]),
            torch.zeros(2, layout.record_bytes, dtype=torch.uint8),
            check_slots=False,
        )


def test_out_type(layout):
    with pytest.raises(TypeError, match="`out` must be a torch.Tensor, got ndarray"):
        gather_tokens(layout, torch.tensor([0]), torch.zeros(1, 1).numpy())


def test_out_dtype(layout):
    with pytest.raises(ValueError, match="`out` must have dtype torch.uint8, got torch.int16"):
        gather_tokens(layout, torch.tensor([0]), torch.zeros(1, layout.record_bytes // 2, dtype=torch.int16))


def test_out_shape(layout):
    with pytest.raises(
        ValueError, match=r"`out` must have shape \(n, record_bytes\) = \(2, 128\), got \(2, 127\)"
    ):
        gather_tokens(layout, torch.tensor([0, 1]), torch.zeros(2, 127, dtype=torch.uint8))


def test_out_contiguous(layout):
    out = torch.zeros(layout.record_bytes, 2, dtype=torch.uint8).t()
    with pytest.raises(ValueError, match="`out` must be C-contiguous"):
        gather_tokens(layout, torch.tensor([0, 1]), out)


def test_out_device(layout):
    out = torch.zeros(1, layout.record_bytes, dtype=torch.uint8, device="meta")
    with pytest.raises(ValueError, match="`out` must be on cpu, got meta"):
        gather_tokens(layout, torch.tensor([0]), out)


def test_records_type(layout):
    with pytest.raises(TypeError, match="`records` must be a torch.Tensor, got bytes"):
        scatter_tokens(layout, torch.tensor([0]), b"\0" * layout.record_bytes)


def test_records_shape(layout):
    with pytest.raises(
        ValueError, match=r"`records` must have shape \(n, record_bytes\) = \(1, 128\), got \(2, 128\)"
    ):
        scatter_tokens(layout, torch.tensor([0]), torch.zeros(2, layout.record_bytes, dtype=torch.uint8))


def test_records_rank(layout):
    with pytest.raises(ValueError, match=r"`records` must be 2-D \[n, record_bytes\]"):
        scatter_tokens(layout, torch.tensor([0]), torch.zeros(layout.record_bytes, dtype=torch.uint8))


def test_mode_on_cpu_layout(layout):
    with pytest.raises(ValueError, match="`mode` must be None for a CPU layout, got 'staged'"):
        gather_tokens(layout, torch.tensor([0]), mode="staged")


def test_stream_on_cpu_layout(layout):
    with pytest.raises(ValueError, match="`stream` must be None for a CPU layout, got object"):
        gather_tokens(layout, torch.tensor([0]), stream=object())


def test_num_threads(layout):
    with pytest.raises(ValueError, match="`num_threads` must be >= 1, got -2"):
        scatter_tokens(
            layout, torch.tensor([0]), torch.zeros(1, layout.record_bytes, dtype=torch.uint8), num_threads=-2
        )
