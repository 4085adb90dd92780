"""Every CPU copy routine (LUMEN_CPU_COPY), not only the one this CPU picks, moves rows of
every size class bit for bit (the read-ahead loop, the 256- and 64-byte loops, the tails and
unaligned ends), and so does the contiguous copy_bytes with it or with memcpy; the transposes
of vLLM CPU's K follow the routine (AVX-512 tiles or the portable loop). The routine is chosen
once per process, so each runs in its own."""

import os
import subprocess
import sys

import pytest
import torch

from lumen_core import _native

# Piece sizes around the loops' bounds (4096 and 1000: read-ahead then tail; 300: 256-byte
# loop only; 100: below streaming; 777: odd, so records and rows end unaligned).
ROUND_TRIP = """
import torch
from lumen_core import _native, reference
from lumen_core.layouts import KVLayout
from lumen_core.ops import gather_tokens, scatter_tokens
from lumen_core.testing import random_tensor

gen = torch.Generator().manual_seed(0)
shapes = [(1, 4096), (3, 1000), (2, 300), (1, 100), (5, 777)]
layout = KVLayout([random_tensor((6, 16, pieces, elems), torch.int8, generator=gen)
                   for pieces, elems in shapes])
twin = KVLayout([view.clone() for view in layout.views])
ids = torch.randperm(layout.num_slots, generator=gen)[:40]
assert torch.equal(gather_tokens(layout, ids, num_threads=2), reference.gather_tokens(layout, ids))
new = random_tensor((40, layout.record_bytes), torch.uint8, generator=gen)
scatter_tokens(layout, ids, new, num_threads=2)
reference.scatter_tokens(twin, ids, new)
assert all(torch.equal(a, b) for a, b in zip(layout.views, twin.views))
# vLLM CPU caches: K moved by the transposes (AVX-512 tiles under avx512, the portable loop
# otherwise) for runs of whole and partial blocks, element by element for scattered slots.
for dtype in (torch.bfloat16, torch.float32):
    caches = [random_tensor((5, 2, 32, 160), dtype, generator=gen) for _ in range(2)]
    cpu_layout = KVLayout.vllm_cpu(caches, isa="vec")
    twin_caches = [cache.clone() for cache in caches]
    ids = torch.cat([torch.arange(7, 100), torch.tensor([3, 150, 0, 101])])
    expected = reference.gather_tokens(cpu_layout, ids)
    assert torch.equal(gather_tokens(cpu_layout, ids, num_threads=2), expected)
    new = random_tensor((ids.numel(), cpu_layout.record_bytes), torch.uint8, generator=gen)
    scatter_tokens(cpu_layout, ids, new, num_threads=2)
    reference.scatter_tokens(KVLayout.vllm_cpu(twin_caches, isa="vec"), ids, new)
    assert all(torch.equal(a.view(torch.uint8), b.view(torch.uint8)) for a, b in zip(caches, twin_caches))
src = random_tensor((3 << 20,), torch.uint8, generator=gen)
dst = torch.zeros_like(src)
cpu = _native.require_cpu()
cpu.copy_bytes(dst.data_ptr() + 5, src.data_ptr() + 3, src.numel() - 11, 2, streaming=True)
assert torch.equal(dst[5:-6], src[3:-8]) and not dst[:5].any() and not dst[-6:].any()
print(cpu.cpu_copy_kind())
"""


def run_with(routine: str) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, LUMEN_CPU_COPY=routine)
    return subprocess.run(
        [sys.executable, "-c", ROUND_TRIP], check=False, env=env, capture_output=True, text=True, timeout=120
    )


@pytest.mark.parametrize("routine", ["avx512", "avx2", "memcpy"])
def test_routine_round_trips_bit_exact(routine):
    result = run_with(routine)
    if "one this CPU supports" in result.stderr:
        pytest.skip(f"this CPU has no {routine}")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == routine


def test_unknown_routine_is_a_clear_error():
    result = run_with("sse9")
    assert result.returncode != 0
    assert "LUMEN_CPU_COPY must be avx512, avx2 or memcpy" in result.stderr
    assert "got sse9" in result.stderr


def test_empty_setting_keeps_the_cpus_pick():
    if os.environ.get("LUMEN_CPU_COPY"):
        pytest.skip("this process runs a forced routine")
    assert run_with("").stdout.strip() == _native.require_cpu().cpu_copy_kind()


@pytest.mark.parametrize("streaming", [False, True])
@pytest.mark.parametrize("num_bytes", [0, 1, 255, 4097, (1 << 20) + 13])
def test_copy_bytes_copies_exactly_the_range(streaming, num_bytes):
    gen = torch.Generator().manual_seed(num_bytes)
    src = torch.randint(0, 256, (num_bytes + 16,), dtype=torch.uint8, generator=gen)
    dst = torch.zeros_like(src)
    cpu = _native.require_cpu()
    cpu.copy_bytes(dst.data_ptr() + 1, src.data_ptr() + 7, num_bytes, 2, streaming=streaming)
    assert torch.equal(dst[1 : 1 + num_bytes], src[7 : 7 + num_bytes])
    assert not dst[:1].any() and not dst[1 + num_bytes :].any()


def test_copy_bytes_rejects_bad_arguments():
    cpu = _native.require_cpu()
    with pytest.raises(ValueError, match="num_bytes must be >= 0"):
        cpu.copy_bytes(1, 1, -1, 1)
    with pytest.raises(ValueError, match="null pointer"):
        cpu.copy_bytes(0, 0, 8, 1)
    with pytest.raises(TypeError):  # streaming is keyword-only
        cpu.copy_bytes(1, 1, 0, 1, True)
