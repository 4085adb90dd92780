"""Token-record gather/scatter bandwidth against same-run baselines (issue 2).

Shapes: 32 and 80 layers of vLLM flash caches (8 KV heads, head_dim 128, bf16, block_size 16).
Batches: ``decode`` (1 new token of each of 256 requests, scattered slots) and ``restore``
(4096 consecutive tokens of one request). For each: native gather and scatter, a contiguous
copy of the same payload with the same thread count (the memcpy ceiling), the best torch idiom
(``torch.index_select(..., out=)`` / ``index_copy_`` over flattened rows per plane) and the naive
idiom (per-layer advanced indexing, then ``torch.stack``). GB/s counts payload bytes (the
records' size); each figure is the best of ``--reps`` runs after a warm-up. Correctness is
checked once before timing.

    python bench/gather_bw.py [--json PATH] [--device cpu|cuda] [--quick]

Under pytest-benchmark (``make bench``) the ``test_*`` functions time a small shape.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch

from lumen_core import _native
from lumen_core.layouts import KVLayout
from lumen_core.ops import checksum, gather_tokens, scatter_tokens

NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE, DTYPE = 8, 128, 16, torch.bfloat16
SHAPES = {"32L": 32, "80L": 80}
DECODE_TOKENS, RESTORE_TOKENS = 256, 4096


@dataclass(frozen=True)
class Row:
    shape: str
    batch: str
    op: str
    threads: int
    gb_per_s: float
    ratio_vs_memcpy: float | None
    ratio_vs_torch_best: float | None
    ratio_vs_torch_naive: float | None


class Cache:
    """A vLLM flash cache of random bytes and its layout."""

    def __init__(self, num_layers: int, num_blocks: int, device: str):
        gen = torch.Generator().manual_seed(0)
        self.caches = []
        for _ in range(num_layers):
            raw = torch.empty((2, num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM * 2), dtype=torch.uint8, device=device)
            raw.copy_(torch.randint(0, 256, (1,), dtype=torch.uint8, generator=gen).expand_as(raw))
            self.caches.append(raw.view(DTYPE))
        self.layout = KVLayout.vllm_flash(self.caches)
        # Flattened rows per plane: [num_slots, H * D] (what the torch idioms index).
        self.plane_rows = [view.reshape(view.shape[0] * view.shape[1], -1) for view in self.layout.views]


def slot_batch(batch: str, num_blocks: int, seed: int = 1) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    if batch == "restore":
        start = 16 * BLOCK_SIZE
        return torch.arange(start, start + RESTORE_TOKENS, dtype=torch.int64)
    blocks = torch.randperm(num_blocks, generator=gen)[:DECODE_TOKENS]
    offsets = torch.randint(0, BLOCK_SIZE, (DECODE_TOKENS,), generator=gen)
    return blocks * BLOCK_SIZE + offsets


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def seconds(fn: Callable[[], object], device: str, reps: int) -> float:
    fn()  # warm-up (page faults, pool threads, allocator)
    sync(device)
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - start)
    return min(times)  # best of reps: the machine is shared, noise only ever slows a run


def bench_cpu(shape: str, num_layers: int, threads_list: list[int], reps: int, quick: bool) -> list[Row]:
    num_blocks = 320 if num_layers > 40 else 512
    if quick:
        num_blocks = 300
    cache = Cache(num_layers, num_blocks, "cpu")
    layout, rows = cache.layout, []
    native = _native.require_cpu()
    for batch in ("decode", "restore"):
        ids = slot_batch(batch, num_blocks)
        n = ids.numel()
        payload = n * layout.record_bytes
        records = torch.empty(n, layout.record_bytes, dtype=torch.uint8)
        scratch = torch.empty_like(records)
        # Correctness once, before any timing.
        gather_tokens(layout, ids, records)
        for rows_of_plane, info in zip(cache.plane_rows, layout.planes):
            got = records[:, info.record_offset : info.record_offset + info.row_bytes]
            assert torch.equal(got, rows_of_plane.index_select(0, ids).view(torch.uint8)), "gather is wrong"
        per_plane = scratch.view(layout.num_planes, n, -1).view(DTYPE)

        def torch_best_gather() -> None:
            for p, rows_of_plane in enumerate(cache.plane_rows):
                torch.index_select(rows_of_plane, 0, ids, out=per_plane[p])

        def torch_best_scatter() -> None:
            for p, rows_of_plane in enumerate(cache.plane_rows):
                rows_of_plane.index_copy_(0, ids, per_plane[p])

        blocks, offsets = ids // BLOCK_SIZE, ids % BLOCK_SIZE

        def torch_naive_gather() -> None:
            torch.stack([c[:, blocks, offsets] for c in cache.caches])

        def torch_naive_scatter() -> None:
            for c, part in zip(cache.caches, naive_records):
                c[:, blocks, offsets] = part

        naive_records = torch.stack([c[:, blocks, offsets] for c in cache.caches])
        torch_threads = torch.get_num_threads()
        for threads in threads_list:
            torch.set_num_threads(threads)
            memcpy_s = seconds(lambda: native.copy_bytes(records.data_ptr(), scratch.data_ptr(), payload, threads), "cpu", reps)
            baselines = {
                "gather": (torch_best_gather, torch_naive_gather),
                "scatter": (torch_best_scatter, torch_naive_scatter),
            }
            ours = {
                "gather": lambda: gather_tokens(layout, ids, records, num_threads=threads),
                "scatter": lambda: scatter_tokens(layout, ids, records, num_threads=threads),
            }
            for op, fn in ours.items():
                ours_s = seconds(fn, "cpu", reps)
                best_s = seconds(baselines[op][0], "cpu", reps)
                naive_s = seconds(baselines[op][1], "cpu", max(1, reps // 3))
                rows.append(Row(shape, batch, op, threads, payload / ours_s / 1e9, memcpy_s / ours_s,
                                best_s / ours_s, naive_s / ours_s))
            rows.append(Row(shape, batch, "memcpy", threads, payload / memcpy_s / 1e9, 1.0, None, None))
        torch.set_num_threads(torch_threads)
        if batch == "restore":
            expected = checksum(records[:64], num_threads=1)
            assert torch.equal(checksum(records[:64], num_threads=2), expected)
            memcpy_1 = seconds(lambda: native.copy_bytes(records.data_ptr(), scratch.data_ptr(), payload, 1), "cpu", reps)
            crc_s = seconds(lambda: checksum(records, num_threads=1), "cpu", reps)
            rows.append(Row(shape, batch, "crc32c", 1, payload / crc_s / 1e9, memcpy_1 / crc_s, None, None))
    return rows


def crc32c_hot_row(reps: int) -> Row:
    """crc32c over a cache-resident buffer: the instruction loop's own speed on one core."""
    data = torch.randint(0, 256, (64, 4096), dtype=torch.uint8)
    rounds = 200
    per_call = seconds(lambda: [checksum(data, num_threads=1) for _ in range(rounds)], "cpu", reps) / rounds
    return Row("256KiB", "hot", "crc32c", 1, data.numel() / per_call / 1e9, None, None, None)


def bench_cuda(shape: str, num_layers: int, reps: int) -> list[Row]:
    num_blocks = 512
    cache = Cache(num_layers, num_blocks, "cuda")
    layout, rows = cache.layout, []
    for batch in ("decode", "restore"):
        ids = slot_batch(batch, num_blocks).cuda()
        n = ids.numel()
        payload = n * layout.record_bytes
        device_records = torch.empty(n, layout.record_bytes, dtype=torch.uint8, device="cuda")
        device_scratch = torch.empty_like(device_records)
        host_records = torch.empty(n, layout.record_bytes, dtype=torch.uint8).pin_memory()
        reference = gather_tokens(layout, ids)
        for mode, out in (("mapped", host_records), ("staged", host_records), ("device", device_records)):
            gather_tokens(layout, ids, out, mode=mode)
            sync("cuda")
            assert torch.equal(out.cuda(), reference), f"cuda gather ({mode}) is wrong"
        d2d_s = seconds(lambda: device_scratch.copy_(device_records), "cuda", reps)
        d2h_s = seconds(lambda: host_records.copy_(device_records, non_blocking=True), "cuda", reps)
        h2d_s = seconds(lambda: device_records.copy_(host_records, non_blocking=True), "cuda", reps)
        per_plane = device_scratch.view(layout.num_planes, n, -1).view(DTYPE)
        blocks, offsets = ids // BLOCK_SIZE, ids % BLOCK_SIZE

        def torch_best_gather() -> None:
            for p, rows_of_plane in enumerate(cache.plane_rows):
                torch.index_select(rows_of_plane, 0, ids, out=per_plane[p])

        def torch_naive_gather() -> None:
            torch.stack([c[:, blocks, offsets] for c in cache.caches])

        best_s = seconds(torch_best_gather, "cuda", reps)
        naive_s = seconds(torch_naive_gather, "cuda", reps)
        for op, mode, out, ceiling_s in (
            ("gather_device", "device", device_records, d2d_s),
            ("gather_mapped", "mapped", host_records, d2h_s),
            ("gather_staged", "staged", host_records, d2h_s),
            ("scatter_device", "device", device_records, d2d_s),
            ("scatter_mapped", "mapped", host_records, h2d_s),
            ("scatter_staged", "staged", host_records, h2d_s),
        ):
            move = gather_tokens if op.startswith("gather") else scatter_tokens
            s = seconds(lambda: move(layout, ids, out, mode=mode), "cuda", reps)
            is_gather = op.startswith("gather")
            rows.append(Row(shape, batch, op, 0, payload / s / 1e9, ceiling_s / s,
                            best_s / s if is_gather else None, naive_s / s if is_gather else None))
        for op, s in (("copy_d2d", d2d_s), ("copy_d2h", d2h_s), ("copy_h2d", h2d_s)):
            rows.append(Row(shape, batch, op, 0, payload / s / 1e9, 1.0, None, None))
    return rows


def format_table(rows: list[Row]) -> str:
    def ratio(value: float | None) -> str:
        return "-" if value is None else f"{value:.2f}x"

    lines = [f"{'shape':7} {'batch':8} {'op':15} {'thr':>3} {'GB/s':>7} {'vs memcpy':>9} {'vs torch':>9} {'vs naive':>9}"]
    for r in rows:
        lines.append(f"{r.shape:7} {r.batch:8} {r.op:15} {r.threads:>3} {r.gb_per_s:7.2f} "
                     f"{ratio(r.ratio_vs_memcpy):>9} {ratio(r.ratio_vs_torch_best):>9} {ratio(r.ratio_vs_torch_naive):>9}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", help="write the rows as JSON to this path")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--threads", type=int, nargs="+", help="CPU thread counts (default: 1 and all cores)")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--quick", action="store_true", help="the 32-layer shape only, fewer blocks")
    args = parser.parse_args(argv)
    shapes = {"32L": 32} if args.quick else SHAPES
    rows: list[Row] = []
    if args.device == "cuda":
        _native.require_cuda()
        for shape, num_layers in shapes.items():
            rows += bench_cuda(shape, num_layers, args.reps)
    else:
        cores = os.cpu_count() or 1
        threads = args.threads or sorted({1, cores})
        for shape, num_layers in shapes.items():
            rows += bench_cpu(shape, num_layers, threads, args.reps, args.quick)
        rows.append(crc32c_hot_row(args.reps))
    print(format_table(rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump([asdict(r) for r in rows], f, indent=1)
    return 0


# ---- pytest-benchmark (make bench): a small shape, correctness asserted first ---------------

def _small() -> tuple[KVLayout, torch.Tensor, torch.Tensor]:
    cache = Cache(4, 300, "cpu")
    ids = slot_batch("restore", 300)
    return cache.layout, ids, gather_tokens(cache.layout, ids)


def test_gather_restore(benchmark):  # type: ignore[no-untyped-def]
    layout, ids, expected = _small()
    out = torch.empty_like(expected)
    benchmark(gather_tokens, layout, ids, out)
    assert torch.equal(out, expected)


def test_scatter_restore(benchmark):  # type: ignore[no-untyped-def]
    layout, ids, records = _small()
    benchmark(scatter_tokens, layout, ids, records)
    assert torch.equal(gather_tokens(layout, ids), records)


def test_memcpy_restore_baseline(benchmark):  # type: ignore[no-untyped-def]
    # The same payload as the restore tests as one contiguous copy: their ceiling, same run.
    _, _, records = _small()
    out = torch.empty_like(records)
    threads = os.cpu_count() or 1
    benchmark(_native.require_cpu().copy_bytes, out.data_ptr(), records.data_ptr(), records.numel(), threads)
    assert torch.equal(out, records)


def test_checksum_one_core(benchmark):  # type: ignore[no-untyped-def]
    records = torch.randint(0, 256, (64, 4096), dtype=torch.uint8)
    crcs = benchmark(checksum, records, num_threads=1)
    assert crcs.shape == (64,)


if __name__ == "__main__":
    sys.exit(main())
