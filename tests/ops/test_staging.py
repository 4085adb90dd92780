"""StagingPool: page alignment, bounded acquire with timeouts, release checks, threads."""

import threading
import time

import pytest
import torch

from lumen_core import _native
from lumen_core.staging import StagingPool

PAGE = 4096


def test_buffers_are_page_aligned_and_distinct():
    pool = StagingPool(3, 5000, pinned=False)
    bufs = [pool.acquire() for _ in range(3)]
    assert all(b.data_ptr() % PAGE == 0 and b.numel() == 5000 and b.dtype == torch.uint8 for b in bufs)
    assert len({b.data_ptr() for b in bufs}) == 3
    for i, b in enumerate(bufs):
        b.fill_(i)
    assert [int(b[-1]) for b in bufs] == [0, 1, 2]  # no overlap
    assert pool.num_free == 0 and not pool.pinned


def test_bounded_acquire_times_out_then_succeeds_after_release():
    pool = StagingPool(1, 64, pinned=False)
    held = pool.acquire()
    start = time.monotonic()
    assert pool.acquire(timeout_s=0.05) is None
    assert time.monotonic() - start >= 0.04
    assert pool.acquire(timeout_s=0) is None
    pool.release(held)
    assert pool.acquire(timeout_s=0) is not None


def test_waiting_acquire_wakes_on_release_from_another_thread():
    pool = StagingPool(1, 64, pinned=False)
    held = pool.acquire()
    got = []
    waiter = threading.Thread(target=lambda: got.append(pool.acquire(timeout_s=5)))
    waiter.start()
    time.sleep(0.05)
    assert not got
    pool.release(held)
    waiter.join(timeout=5)
    assert got and got[0] is not None and got[0].data_ptr() == held.data_ptr()


def test_borrow_releases_even_on_error():
    pool = StagingPool(1, 64, pinned=False)
    with pytest.raises(RuntimeError, match="inside"), pool.borrow() as buf:
        assert pool.num_free == 0 and buf.numel() == 64
        raise RuntimeError("inside")
    assert pool.num_free == 1


def test_borrow_times_out():
    pool = StagingPool(1, 64, pinned=False)
    with (
        pool.borrow(),
        pytest.raises(TimeoutError, match="no staging buffer became free within 0.01 s"),
        pool.borrow(timeout_s=0.01),
    ):
        pass


def test_buffer_outlives_pool_object():
    pool = StagingPool(2, 128, pinned=False)
    buf = pool.acquire()
    del pool
    buf.fill_(7)
    assert int(buf.sum()) == 7 * 128


def test_sizes_validated():
    with pytest.raises(ValueError, match="`num_buffers` must be >= 1, got 0"):
        StagingPool(0, 10, pinned=False)
    with pytest.raises(TypeError, match="`buffer_bytes` must be an int, got float"):
        StagingPool(1, 10.0, pinned=False)


@pytest.mark.parametrize("num_buffers, buffer_bytes", [(2, 2**62), (1, 2**63 - 1), (2**40, 2**40)])
def test_sizes_whose_product_overflows_are_value_errors(num_buffers, buffer_bytes):
    with pytest.raises(ValueError, match="`num_buffers` x `buffer_bytes` must be at most"):
        StagingPool(num_buffers, buffer_bytes, pinned=False)


def test_timeout_validated():
    pool = StagingPool(1, 8, pinned=False)
    with pytest.raises(ValueError, match="`timeout_s` must be >= 0 or None, got -1"):
        pool.acquire(timeout_s=-1)
    with pytest.raises(ValueError, match="`timeout_s` must be >= 0 or None, got nan"):
        pool.acquire(timeout_s=float("nan"))
    with pytest.raises(TypeError, match="`timeout_s` must be a number or None, got str"):
        pool.acquire(timeout_s="1")


@pytest.mark.parametrize("timeout_s", [float("inf"), 1e300, 9.3e9])
def test_an_unbounded_timeout_waits_for_a_release(timeout_s):
    pool = StagingPool(1, 8, pinned=False)
    held = pool.acquire(0)
    got = []
    waiter = threading.Thread(target=lambda: got.append(pool.acquire(timeout_s)))
    waiter.start()
    waiter.join(0.2)
    assert waiter.is_alive() and not got  # still waiting, not given up at once
    pool.release(held)
    waiter.join(5)
    assert not waiter.is_alive() and got[0] is not None and got[0].data_ptr() == held.data_ptr()


def test_release_validated():
    pool = StagingPool(2, 8, pinned=False)
    buf = pool.acquire()
    with pytest.raises(TypeError, match="`buf` must be a torch.Tensor, got bytearray"):
        pool.release(bytearray(8))
    with pytest.raises(ValueError, match="`buf` must be a buffer of this pool"):
        pool.release(torch.zeros(8, dtype=torch.uint8))
    pool.release(buf)
    with pytest.raises(ValueError, match="`buf` must be held, got buffer 0 which is already free"):
        pool.release(buf)


@pytest.mark.skipif(_native.HAS_CUDA, reason="checks the behaviour without a CUDA device")
def test_pinned_needs_cuda():
    with pytest.raises(ValueError, match="`pinned` must be False or None without a CUDA device, got True"):
        StagingPool(1, 8, pinned=True)
    assert not StagingPool(1, 8).pinned


@pytest.mark.cuda
@pytest.mark.skipif(not _native.HAS_CUDA, reason="needs a CUDA device")
def test_pinned_buffers_take_mapped_gathers():
    from lumen_core.ops import gather_tokens
    from lumen_core.testing import make_paged_cache

    layout = make_paged_cache("vllm_flash", num_layers=2, num_blocks=4, block_size=16, device="cuda")
    pool = StagingPool(2, 3 * layout.record_bytes)
    assert pool.pinned
    buf = pool.acquire()
    records = buf.view(3, layout.record_bytes)
    assert records.is_pinned()
    gather_tokens(layout, torch.tensor([1, 2, 3]), records, mode="mapped")
    torch.cuda.synchronize()
    assert torch.equal(records, gather_tokens(layout, torch.tensor([1, 2, 3])).cpu())
    pool.release(buf)
    pool.close()
