"""The native thread pool: it survives fork() (a child that forked after the parent used the
pool can still run multithreaded ops instead of waiting forever for workers that do not exist
there), and concurrent Python callers share it without hanging or mixing up their jobs."""

import multiprocessing

import pytest
import torch

from lumen_core.ops import checksum, gather_tokens
from lumen_core.testing import make_paged_cache


def _child(queue) -> None:  # type: ignore[no-untyped-def]
    layout = make_paged_cache(
        "vllm_flash", num_layers=4, num_blocks=64, block_size=16, num_kv_heads=8, head_dim=128
    )
    ids = torch.arange(1024)
    records = gather_tokens(layout, ids, num_threads=2)
    queue.put(int(checksum(records, num_threads=2)[0]) >= 0)


@pytest.mark.skipif("fork" not in multiprocessing.get_all_start_methods(), reason="needs fork()")
def test_ops_work_in_a_forked_child():
    layout = make_paged_cache(
        "vllm_flash", num_layers=4, num_blocks=64, block_size=16, num_kv_heads=8, head_dim=128
    )
    gather_tokens(layout, torch.arange(1024), num_threads=2)  # the parent's pool has workers now
    ctx = multiprocessing.get_context("fork")
    queue = ctx.Queue()
    child = ctx.Process(target=_child, args=(queue,))
    child.start()
    child.join(timeout=20)
    if child.is_alive():
        child.kill()
        child.join()
        pytest.fail("the forked child hung in the native thread pool")
    assert child.exitcode == 0 and queue.get(timeout=5) is True


def test_concurrent_callers_share_the_pool():
    # Python threads release the GIL in the ops; the pool serialises their jobs.
    import threading

    from lumen_core import reference

    layout = make_paged_cache(
        "vllm_flash", num_layers=4, num_blocks=64, block_size=16, num_kv_heads=8, head_dim=128
    )
    ids = [
        torch.randperm(layout.num_slots, generator=torch.Generator().manual_seed(s))[:200] for s in range(4)
    ]
    expected = [reference.gather_tokens(layout, i) for i in ids]
    failures: list[int] = []

    def worker(k: int) -> None:
        for _ in range(10):
            records = gather_tokens(layout, ids[k], num_threads=2)
            if not torch.equal(records, expected[k]) or not torch.equal(
                checksum(records, num_threads=2), checksum(expected[k], num_threads=1)
            ):
                failures.append(k)

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not any(t.is_alive() for t in threads), "a caller hung in the pool"
    assert failures == []
