"""Figures of LumenConnector in vLLM (issue 18). This version measures the copy half:
``vllm_cpu_gather_vs_memcpy`` and ``vllm_cpu_scatter_vs_memcpy``, the native gather/scatter of a
restore batch (``batch``: ``restore``, 4,096 consecutive tokens = whole blocks of 128) on a
``KVLayout.vllm_cpu`` cache (K transposed per block and head), against a contiguous copy of the
same payload in the same run (glibc's memcpy through the native ``copy_bytes``, as
bench/gather_bw.py) with the same thread count. Geometry ``stream_stress``: 8 KV heads x
head_dim 128, bf16 (``--layers``, default 8: 32 KiB per token). Rows carry ``metric`` and
``value``, the copy routine (``copy_kind``: the native transposes of K are AVX-512 tiles under
"avx512", the portable loop otherwise; ``LUMEN_CPU_COPY`` picks one) and the 1-minute load
average when timing began (``load_1m``: on a shared machine, read the ratios, not the GB/s).
Each figure is the best of ``--reps`` rounds, each round timing gather, scatter and memcpy one
after another, so that all three see the same load. Correctness is checked once against
``KVLayout.vllm_flash`` records first.

``batch``: ``decode`` times the save path's gather from a cold cache: 32 requests' newest
token each, alone (a per-token save) or with the rest of its K line (``KVLayout.line_tokens``
tokens, what ``ConnectorCore`` hands over), in microseconds a token, their ratio
(``vllm_cpu_decode_gather_alone_vs_line``) and the line batch against memcpy of its bytes.

    python bench/vllm_stream.py [--json PATH] [--layers N] [--reps N] [--threads N]

The engine figures (inter-token latency with and without the connector, restore vs recompute
TTFT, decode steps during restores) are bench/vllm_engine.py's.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from collections.abc import Callable

import torch

from lumen_core import _native
from lumen_core.layouts import KVLayout
from lumen_core.ops import gather_tokens, scatter_tokens

NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE, DTYPE = 8, 128, 128, torch.bfloat16
RESTORE_TOKENS = 4096
DECODE_REQUESTS = 32
EVICT_BYTES = 256 << 20


def _best_s(fns: list[Callable[[], object]], reps: int) -> list[float]:
    """Best time of each of ``fns`` over ``reps`` rounds that run them in turn (after a warm-up)."""
    for fn in fns:
        fn()
    best = [float("inf")] * len(fns)
    for _ in range(reps):
        for i, fn in enumerate(fns):
            start = time.perf_counter()
            fn()
            best[i] = min(best[i], time.perf_counter() - start)
    return best


def _check(layout: KVLayout, caches: list[torch.Tensor], slot_ids: torch.Tensor) -> None:
    """The vllm_cpu records of a few tokens equal vllm_flash's of the same K/V."""
    probe = slot_ids[:: max(1, len(slot_ids) // 7)]
    flash = []
    for cache in caches:
        num_blocks = cache.shape[0]
        k_half, v_half = cache.view(num_blocks, NUM_KV_HEADS, 2, BLOCK_SIZE * HEAD_DIM).unbind(2)
        k = k_half.view(num_blocks, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE).permute(0, 3, 1, 2)
        v = v_half.view(num_blocks, NUM_KV_HEADS, BLOCK_SIZE, HEAD_DIM).transpose(1, 2)
        flash.append(torch.stack([k, v]))
    expected = gather_tokens(KVLayout.vllm_flash(flash), probe)
    if not torch.equal(gather_tokens(layout, probe), expected):
        raise AssertionError("vllm_cpu records differ from vllm_flash's")


def measure(num_layers: int, reps: int, threads: int) -> list[dict[str, object]]:
    num_blocks = RESTORE_TOKENS // BLOCK_SIZE + 2
    shape = (num_blocks, NUM_KV_HEADS, BLOCK_SIZE, 2 * HEAD_DIM)
    caches = [torch.randn(shape).to(DTYPE) for _ in range(num_layers)]
    layout = KVLayout.vllm_cpu(caches, isa="vec")
    slot_ids = torch.arange(BLOCK_SIZE, BLOCK_SIZE + RESTORE_TOKENS)  # whole blocks 1..32
    _check(layout, caches, slot_ids)
    records = torch.empty(RESTORE_TOKENS, layout.record_bytes, dtype=torch.uint8)
    source = torch.randint(0, 255, records.shape, dtype=torch.uint8)
    payload = records.numel()
    native = _native.require_cpu()
    load_1m = os.getloadavg()[0]
    gather_s, scatter_s, memcpy_s = _best_s(
        [
            lambda: gather_tokens(layout, slot_ids, out=records, num_threads=threads),
            lambda: scatter_tokens(layout, slot_ids, source, num_threads=threads),
            lambda: native.copy_bytes(records.data_ptr(), source.data_ptr(), payload, threads),
        ],
        reps,
    )
    geometry = f"stream_stress {num_layers}L x {NUM_KV_HEADS} heads x {HEAD_DIM} bf16"
    common = {
        "batch": "restore",
        "tokens": RESTORE_TOKENS,
        "geometry": geometry,
        "threads": threads,
        "copy_kind": native.cpu_copy_kind(),
        "load_1m": round(load_1m, 2),
    }
    return [
        {"metric": "vllm_cpu_gather_vs_memcpy", "value": memcpy_s / gather_s, **common},
        {"metric": "vllm_cpu_scatter_vs_memcpy", "value": memcpy_s / scatter_s, **common},
        {"metric": "vllm_cpu_gather_gb_per_s", "value": payload / gather_s / 1e9, **common},
        {"metric": "vllm_cpu_scatter_gb_per_s", "value": payload / scatter_s / 1e9, **common},
        {"metric": "memcpy_gb_per_s", "value": payload / memcpy_s / 1e9, **common},
    ]


def measure_decode(num_layers: int, reps: int, threads: int) -> list[dict[str, object]]:
    """The save path's gather (``batch``: ``decode``): ``DECODE_REQUESTS`` requests, each in a
    block of its own, their newest token alone (what a per-token save gathers each step) or
    their newest whole line of K (``KVLayout.line_tokens`` tokens: what ``ConnectorCore``
    gathers), from a cold cache as after a forward. Rows: microseconds a token for each, their
    ratio, and memcpy of the line batch's bytes (cold too) as the baseline."""
    caches = [torch.randn(DECODE_REQUESTS + 1, NUM_KV_HEADS, BLOCK_SIZE, 2 * HEAD_DIM).to(DTYPE)
              for _ in range(num_layers)]  # fmt: skip
    layout = KVLayout.vllm_cpu(caches, isa="vec")
    line = layout.line_tokens
    blocks = torch.arange(1, DECODE_REQUESTS + 1) * BLOCK_SIZE
    alone = blocks + line - 1  # the token that ends each request's first line
    whole = (blocks[:, None] + torch.arange(line)).flatten()
    _check(layout, caches, whole)
    records = torch.empty(len(whole), layout.record_bytes, dtype=torch.uint8)
    source = torch.randint(0, 255, records.shape, dtype=torch.uint8)
    payload = records.numel()
    evict = torch.zeros(EVICT_BYTES, dtype=torch.uint8)  # past the last-level cache
    native = _native.require_cpu()
    load_1m = os.getloadavg()[0]
    runs: dict[str, list[float]] = {"alone": [], "line": [], "memcpy": []}
    for _ in range(reps + 1):  # the first round warms up
        for name, fn in (
            ("alone", lambda: gather_tokens(layout, alone, out=records[: len(alone)], num_threads=threads)),
            ("line", lambda: gather_tokens(layout, whole, out=records, num_threads=threads)),
            ("memcpy", lambda: native.copy_bytes(records.data_ptr(), source.data_ptr(), payload, threads)),
        ):  # fmt: skip
            evict.add_(1)  # every op reads and writes cold lines
            start = time.perf_counter()
            fn()
            runs[name].append(time.perf_counter() - start)
    best = {name: min(times[1:]) for name, times in runs.items()}
    alone_us, line_us = 1e6 * best["alone"] / len(alone), 1e6 * best["line"] / len(whole)
    common = {
        "batch": "decode",
        "tokens": len(whole),
        "line_tokens": line,
        "geometry": f"stream_stress {num_layers}L x {NUM_KV_HEADS} heads x {HEAD_DIM} bf16",
        "threads": threads,
        "copy_kind": native.cpu_copy_kind(),
        "load_1m": round(load_1m, 2),
    }
    return [
        {"metric": "vllm_cpu_decode_gather_us_per_token_alone", "value": alone_us, **common},
        {"metric": "vllm_cpu_decode_gather_us_per_token_line", "value": line_us, **common},
        {"metric": "vllm_cpu_decode_gather_alone_vs_line", "value": alone_us / line_us, **common},
        {"metric": "vllm_cpu_decode_gather_line_vs_memcpy", "value": best["memcpy"] / best["line"], **common},
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", help="write the rows here")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1, help="copy threads of every op and the baseline")
    args = parser.parse_args()
    rows = [
        *measure(args.layers, args.reps, args.threads),
        *measure_decode(args.layers, args.reps, args.threads),
    ]
    for row in rows:
        print(
            f"{row['metric']:32s} {row['value']:8.3f}  ({row['geometry']}, {row['tokens']} tokens, "
            f"{row['copy_kind']}, load {row['load_1m']})"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
