"""KVLayout: planes and record offsets of each engine layout, fingerprints, validation."""

import subprocess
import sys

import pytest
import torch

from lumen_core.layouts import KVLayout
from lumen_core.testing import make_paged_cache


def test_vllm_flash_planes_and_properties():
    caches = [torch.zeros(2, 7, 16, 8, 128, dtype=torch.bfloat16) for _ in range(3)]
    layout = KVLayout.vllm_flash(caches)
    assert (layout.num_planes, layout.record_bytes) == (6, 6 * 2048)
    assert (layout.num_blocks, layout.block_size, layout.num_slots) == (7, 16, 112)
    assert layout.device == torch.device("cpu")
    assert [p.record_offset for p in layout.planes] == [i * 2048 for i in range(6)]
    assert [p.name for p in layout.planes[:2]] == ["layer0.k", "layer0.v"]
    assert all(p.num_pieces == 1 for p in layout.planes)  # NHD rows are contiguous
    desc = layout.descriptors()
    assert desc.shape == (6, 9) and desc.dtype == torch.int64
    assert desc[1, 0] == caches[0][1].data_ptr()


def test_hnd_rows_are_strided_pieces():
    layout = KVLayout.vllm_flash_hnd([torch.zeros(2, 4, 8, 16, 64, dtype=torch.float16)])
    plane = layout.planes[0]
    assert (plane.num_pieces, plane.piece_bytes, plane.piece_stride) == (8, 128, 16 * 128)
    assert layout.block_size == 16


def test_vllm_hnd_physical_order_behind_nhd_shape():
    # vLLM allocates HND and permutes to the NHD logical shape; vllm_flash reads the strides.
    physical = torch.zeros(2, 4, 8, 16, 64, dtype=torch.float16)
    logical = physical.permute(0, 1, 3, 2, 4)
    assert KVLayout.vllm_flash([logical]).planes[0].num_pieces == 8


def test_record_format_is_engine_independent():
    kinds = ["vllm_flash", "vllm_flash_hnd", "vllm_flashinfer", "vllm_flashinfer_hnd", "sglang"]
    prints = {make_paged_cache(k, num_layers=2, num_blocks=3, block_size=16).fingerprint() for k in kinds}
    assert len(prints) == 1
    other_bs = make_paged_cache("vllm_flash", num_layers=2, num_blocks=9, block_size=1)
    assert other_bs.fingerprint() in prints


@pytest.mark.parametrize(
    "change",
    [dict(num_layers=3), dict(num_kv_heads=4), dict(head_dim=16), dict(dtype=torch.float16)],
)
def test_fingerprint_changes_with_record_format(change):
    base = dict(num_layers=2, num_blocks=3, block_size=16, num_kv_heads=2, head_dim=8, dtype=torch.bfloat16)
    a = make_paged_cache("vllm_flash", **base)
    b = make_paged_cache("vllm_flash", **{**base, **change})
    assert a.fingerprint() != b.fingerprint()


def test_fp8_scale_planes():
    layout = make_paged_cache(
        "vllm_flash_fp8_scales", num_layers=2, num_blocks=3, block_size=16, num_kv_heads=4, head_dim=64
    )
    assert [p.name for p in layout.planes[:4]] == ["layer0.k", "layer0.v", "layer0.k_scale", "layer0.v_scale"]
    assert [p.row_bytes for p in layout.planes[:4]] == [256, 256, 16, 16]
    assert layout.record_bytes == 2 * (256 + 256 + 16 + 16)


def test_sglang_and_mla_scales():
    k = [torch.zeros(40, 2, 8, dtype=torch.int8)]
    s = [torch.zeros(40, 2, dtype=torch.float32)]
    layout = KVLayout.sglang(k, k, k_scales=s, v_scales=s)
    assert (layout.num_planes, layout.record_bytes, layout.block_size, layout.num_slots) == (4, 48, 1, 40)
    mla = KVLayout.mla([torch.zeros(5, 16, 576, dtype=torch.bfloat16)], scales=[torch.zeros(5, 16, 1)])
    assert (mla.num_planes, mla.record_bytes) == (2, 1156)


def test_generic_planes_keep_the_cache_alive():
    layout = KVLayout([torch.ones(2, 4, 1, 8)], names=["x"])
    assert layout.views[0].sum() == 64 and layout.kind == "generic" and "generic" in repr(layout)


# A cache whose memory the engine frees or reallocates under a layout (vLLM's sleep mode
# frees storage in place): gathering must raise, not read freed memory. In a subprocess: the
# unfixed behaviour is a segfault.
_FREED_CACHE = """
import sys, torch
from lumen_core.layouts import KVLayout
from lumen_core.ops import gather_tokens
caches = [torch.randn(2, 1024, 16, 8, 64) for _ in range(2)]  # 64 MiB each: munmapped when freed
layout = KVLayout.vllm_flash(caches)
for c in caches:
    if sys.argv[1] == "storage":
        c.untyped_storage().resize_(0)
    else:
        c.resize_(2, 4096, 16, 8, 64)
try:
    gather_tokens(layout, torch.arange(0, 16384, 7))
except ValueError as exc:
    print(exc)
"""


@pytest.mark.parametrize("how", ["storage", "tensor"])
def test_a_layout_over_freed_or_reallocated_memory_refuses_to_gather(how):
    out = subprocess.run(
        [sys.executable, "-c", _FREED_CACHE, how], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert "`layout` must view memory that is still allocated" in out.stdout


# ---- validation -------------------------------------------------------------------------------


def test_planes_must_be_a_sequence():
    with pytest.raises(TypeError, match="`planes` must be a non-empty sequence of torch.Tensor, got Tensor"):
        KVLayout(torch.zeros(1, 1, 1, 1))
    with pytest.raises(TypeError, match="`planes` must be a non-empty sequence of torch.Tensor, got list"):
        KVLayout([])


def test_plane_items_must_be_tensors():
    with pytest.raises(TypeError, match=r"`kv_caches\[1\]` must be a torch.Tensor, got int"):
        KVLayout.vllm_flash([torch.zeros(2, 1, 1, 1, 1), 3])


def test_plane_rank():
    with pytest.raises(
        ValueError,
        match=r"`planes\[0\]` must be 4-D \[num_blocks, block_size, num_pieces, piece_elems\], "
        r"got shape \(2, 3\)",
    ):
        KVLayout([torch.zeros(2, 3)])


def test_plane_device():
    with pytest.raises(ValueError, match=r"`planes\[1\]` must be on device cpu, got meta"):
        KVLayout([torch.zeros(1, 1, 1, 4), torch.zeros(1, 1, 1, 4, device="meta")])


def test_layout_device_kind():
    with pytest.raises(ValueError, match="`planes` must be on a CPU or CUDA device, got meta"):
        KVLayout([torch.zeros(1, 1, 1, 4, device="meta")])


def test_plane_empty_dimension():
    with pytest.raises(
        ValueError, match=r"`planes\[0\]` must have no empty dimension, got shape \(0, 1, 1, 4\)"
    ):
        KVLayout([torch.zeros(0, 1, 1, 4)])


def test_planes_share_blocks():
    with pytest.raises(
        ValueError, match=r"`planes\[1\]` must have num_blocks, block_size = 2, 16 like planes\[0\], got 2, 8"
    ):
        KVLayout([torch.zeros(2, 16, 1, 4), torch.zeros(2, 8, 1, 4)])


def test_plane_last_dimension_contiguous():
    with pytest.raises(ValueError, match=r"`planes\[0\]` must have stride 1 in its last dimension"):
        KVLayout([torch.zeros(2, 4, 1, 8)[..., ::2]])


def test_plane_zero_stride():
    with pytest.raises(ValueError, match=r"must not repeat memory \(zero stride in dimension 0\)"):
        KVLayout([torch.zeros(1, 4, 1, 8).expand(3, 4, 1, 8)])


def test_plane_overlapping_pieces():
    base = torch.zeros(64)
    with pytest.raises(
        ValueError, match=r"`planes\[0\]` must not overlap its pieces \(stride 4 < 8 elements"
    ):
        KVLayout([base.as_strided((1, 2, 3, 8), (32, 16, 4, 1))])


def test_single_piece_stride_is_normalised():
    # A size-1 piece dimension may carry any stride; the descriptor must not depend on it.
    layout = KVLayout([torch.zeros(200).as_strided((2, 4, 1, 24), (96, 24, 7, 1))])
    assert (layout.planes[0].num_pieces, layout.planes[0].piece_stride) == (1, 96)


def test_names_length():
    with pytest.raises(ValueError, match=r"`names` must have one name per plane \(1\), got 2"):
        KVLayout([torch.zeros(1, 1, 1, 4)], names=["a", "b"])


def test_vllm_flash_shape():
    with pytest.raises(
        ValueError,
        match=r"`kv_caches\[0\]` must be 5-D \[2, num_blocks, block_size, num_kv_heads, head_dim\], "
        r"got shape \(2, 3, 4\)",
    ):
        KVLayout.vllm_flash([torch.zeros(2, 3, 4)])


def test_vllm_flash_kv_axis():
    with pytest.raises(ValueError, match=r"`kv_caches\[0\]` must have size 2 in dimension 0"):
        KVLayout.vllm_flash([torch.zeros(3, 2, 16, 2, 8)])


def test_flashinfer_kv_axis():
    with pytest.raises(ValueError, match=r"`kv_caches\[0\]` must have size 2 in dimension 1"):
        KVLayout.vllm_flashinfer([torch.zeros(4, 3, 16, 2, 8)])


def test_hnd_shapes():
    with pytest.raises(
        ValueError,
        match=r"`kv_caches\[0\]` must be 5-D \[2, num_blocks, num_kv_heads, block_size, head_dim\]",
    ):
        KVLayout.vllm_flash_hnd([torch.zeros(2, 3)])
    with pytest.raises(
        ValueError,
        match=r"`kv_caches\[0\]` must be 5-D \[num_blocks, 2, num_kv_heads, block_size, head_dim\]",
    ):
        KVLayout.vllm_flashinfer_hnd([torch.zeros(2, 3)])


def test_scales_per_layer():
    caches = [torch.zeros(2, 2, 4, 2, 8, dtype=torch.float8_e4m3fn)] * 2
    with pytest.raises(
        ValueError, match=r"`scales` must have one entry per layer \(2 in `kv_caches`\), got 1"
    ):
        KVLayout.vllm_flash(caches, scales=[torch.zeros(2, 2, 4, 2)])
    with pytest.raises(
        ValueError, match=r"`scales\[0\]` must be 4-D \[2, num_blocks, block_size, scale_elems\]"
    ):
        KVLayout.vllm_flash(caches, scales=[torch.zeros(2, 2, 4)] * 2)
    with pytest.raises(
        ValueError, match=r"`scales\[0\]` must be 4-D \[num_blocks, 2, block_size, scale_elems\]"
    ):
        KVLayout.vllm_flashinfer([torch.zeros(2, 2, 4, 2, 8)], scales=[torch.zeros(2, 4)])


def test_sglang_validation():
    k = [torch.zeros(8, 2, 4)]
    with pytest.raises(
        ValueError, match=r"`v_buffers` must have one entry per layer \(1 in `k_buffers`\), got 2"
    ):
        KVLayout.sglang(k, k * 2)
    with pytest.raises(
        ValueError, match=r"`k_buffers\[0\]` must be 3-D \[num_slots, num_kv_heads, head_dim\]"
    ):
        KVLayout.sglang([torch.zeros(8, 4)], k)
    with pytest.raises(ValueError, match="`k_scales` and `v_scales` must be given together, got only one"):
        KVLayout.sglang(k, k, k_scales=[torch.zeros(8, 2)])
    with pytest.raises(ValueError, match=r"`v_scales\[0\]` must be 2-D \[num_slots, scale_elems\]"):
        KVLayout.sglang(k, k, k_scales=[torch.zeros(8, 2)], v_scales=[torch.zeros(8)])


def test_mla_validation():
    with pytest.raises(
        ValueError, match=r"`caches\[0\]` must be 3-D \[num_blocks, block_size, kv_lora_rank \+ rope_dim\]"
    ):
        KVLayout.mla([torch.zeros(2, 3)])
    with pytest.raises(
        ValueError, match=r"`scales\[0\]` must be 3-D \[num_blocks, block_size, scale_elems\]"
    ):
        KVLayout.mla([torch.zeros(2, 3, 8)], scales=[torch.zeros(2)])
