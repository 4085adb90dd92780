"""Checkpoint streaming versus decode latency (docs/streaming.md).

A decode loop on the CPU stands in for the GPU: each step does real matmul work on one thread
(calibrated to --step-ms, never a sleep) and writes one new token of KV per running request
into a 32-layer, 8-head, 128-dim bf16 vLLM flash cache (128 KiB token records). It runs with
streaming off, then on (a CheckpointStreamer saving every step to a `lumen holder` process on
loopback), interleaved, at each request count. With two or more cores the decode thread is
pinned to core 0 and the data plane (streamer thread, its UCX progress thread, the holder
process) to core 1. Reported: p50 and p99 step-latency ratio (on / off), the stream bandwidth
achieved (bytes acknowledged durable per second), and the restore of 4096 tokens from a
HolderStore in host memory with verification (fingerprints, token ids, crc32c) and scatter
into a cache, against a one-thread memcpy of the same bytes.

    python bench/stream_vs_decode.py [--requests 64 256] [--steps 40] [--json PATH] [--quick]
        [--device cuda]

With `--device cuda` the same runs on a GPU: the cache lives on the device, each step's
matmuls are bf16 [4096, 4096] products and its KV writes go to the device cache on the current
stream, which is synchronised at the end of every step (as an engine does to sample); the
streamer gathers on its own stream after an event on that one. The restore goes into a
cache on the device and is compared with a pinned host-to-device copy of the same bytes.

JSON rows: case (request count, or "4096 tokens"), metric, value, ratio:
step_latency_p50_ratio / step_latency_p99_ratio (value: on-latency ms, ratio: on / off),
stream_gb_per_s (value: GB/s acked, ratio: acked over produced bytes per second),
restore_vs_memcpy (value: restore GB/s, ratio: restore / memcpy); and step_cpu_p50_ratio /
step_cpu_p99_ratio, the same ratios of the decode thread's CPU time per step, which other
tenants of a shared machine do not inflate (wall-clock latency includes their preemptions).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from lumen_core import _native
from lumen_core.auth import CapabilityIssuer, write_issuer_public_key_file
from lumen_core.layouts import KVLayout
from lumen_core.ops import checksum, gather_tokens, scatter_tokens
from lumen_core.stream import CheckpointStreamer, HolderStore, RestoreStatus, fingerprint_bytes
from lumen_core.transport import Client

LAYERS, HEADS, HEAD_DIM, BLOCK_SIZE = 32, 8, 128, 16
MODEL = "bench-model"
MATMUL = 512
MATMUL_CUDA = 4096


def make_layout(num_slots: int, layers: int, device: str = "cpu") -> KVLayout:
    blocks = -(-num_slots // BLOCK_SIZE)
    # zeros: every page is touched before timing
    return KVLayout.vllm_flash(
        [
            torch.zeros(2, blocks, BLOCK_SIZE, HEADS, HEAD_DIM, dtype=torch.bfloat16, device=device)
            for _ in range(layers)
        ]
    )


def end_of_step(device: torch.device) -> None:
    """Where an engine waits for its step (to sample): the current stream only, so that the
    streamer's own stream is not waited for."""
    if device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()


CORES = os.sched_getaffinity(0)


def pin(cores: set[int]) -> None:
    """Pins the calling thread (threads it starts inherit it) when there are two cores."""
    if len(CORES) >= 2:
        os.sched_setaffinity(0, cores)


class Decode:
    """One decode step: `reps` [512, 512] float32 matmuls (one thread; on a GPU [4096, 4096]
    bf16) and the new KV rows."""

    def __init__(self, layout: KVLayout, num_requests: int, steps: int, step_ms: float) -> None:
        self.layout = layout
        self.num_requests = num_requests
        self.steps = steps
        gen = torch.Generator().manual_seed(0)
        device = layout.device
        self.rows = torch.randint(
            0, 256, (num_requests, layout.record_bytes), dtype=torch.uint8, generator=gen
        ).to(device)
        size, dtype = (MATMUL_CUDA, torch.bfloat16) if device.type == "cuda" else (MATMUL, torch.float32)
        self.scale = 1.0 / size**0.5
        self.a = torch.randn(size, size, generator=gen).to(device, dtype)
        self.b = torch.randn(size, size, generator=gen).to(device, dtype)
        self.reps = 1
        self.reps = self._calibrate(step_ms)

    def slots(self, position: int) -> torch.Tensor:
        return torch.arange(self.num_requests, dtype=torch.int64) * self.steps + position

    def step(self, position: int) -> torch.Tensor:
        c = self.a
        for _ in range(self.reps):
            c = torch.mm(c, self.b)
            c = c * self.scale
        slots = self.slots(position)
        if self.layout.device.type == "cuda":
            scatter_tokens(self.layout, slots, self.rows)
        else:
            scatter_tokens(self.layout, slots, self.rows, num_threads=1)
        return slots

    def _median_step(self, reps: int) -> float:
        self.reps = reps
        times = []
        for position in range(9):
            t0 = time.perf_counter()
            self.step(position % self.steps)
            end_of_step(self.layout.device)
            times.append(time.perf_counter() - t0)
        return float(np.median(times))

    def _calibrate(self, step_ms: float) -> int:
        """Matmul repetitions that make one step last step_ms (a line through two sizes)."""
        low, high = 4, 32
        t_low, t_high = self._median_step(low), self._median_step(high)
        per_rep = max((t_high - t_low) / (high - low), 1e-6)
        reps = max(1, round(low + (step_ms / 1000 - t_low) / per_rep))
        # One correction at the chosen size (the line is only as good as two noisy medians).
        t_reps = self._median_step(reps)
        return max(1, round(reps + (step_ms / 1000 - t_reps) / per_rep))


@functools.cache
def _issuer() -> CapabilityIssuer:
    """This run's capability issuer (the holder trusts its public key); holder id 0."""
    return CapabilityIssuer.generate()


def process_cpu_s(pid: int) -> float:
    """User + system CPU seconds of process pid, all threads."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def run(
    decode: Decode,
    streamer: CheckpointStreamer | None,
    request_base: int,
    secret: bytes,
    port: int,
    holder_pid: int,
) -> tuple[list[float], list[float], float, int, float]:
    """Wall-clock and decode-thread CPU latencies (s) of decode.steps steps; with a streamer
    also the seconds until every append was acknowledged, the bytes acknowledged and the CPU
    seconds of the data plane (this process's other threads and the holder process)."""
    rids = np.arange(request_base, request_base + decode.num_requests, dtype=np.uint64)
    if streamer is not None:
        for rid in rids:
            streamer.add_request(
                int(rid), [("127.0.0.1", port)], [_issuer().issue(int(rid), 0, 0, holder_id=0)]
            )
        acked_before = streamer.stats().counters["bytes_acked"]
    token_ids = np.zeros(decode.num_requests, dtype=np.uint32)
    latencies = []
    cpu = []
    start = time.perf_counter()
    cpu_start = process_cpu_s(os.getpid()) + process_cpu_s(holder_pid) - time.thread_time()
    for position in range(decode.steps):
        t0, c0 = time.perf_counter(), time.thread_time()
        slots = decode.step(position)
        if streamer is not None:
            positions = np.full(decode.num_requests, position, dtype=np.uint64)
            streamer.save_step(rids, positions, slots.numpy(), token_ids + position)
        end_of_step(decode.layout.device)
        latencies.append(time.perf_counter() - t0)
        cpu.append(time.thread_time() - c0)
    if streamer is None:
        return latencies, cpu, 0.0, 0, 0.0
    streamer.flush(timeout_s=60)
    elapsed = time.perf_counter() - start
    data_plane_cpu = process_cpu_s(os.getpid()) + process_cpu_s(holder_pid) - time.thread_time() - cpu_start
    stats = streamer.stats()
    acked = stats.counters["bytes_acked"] - acked_before
    for rid in rids:
        streamer.wait_for_save(int(rid))
        streamer.release(int(rid))
    streamer.flush(timeout_s=60)
    return latencies, cpu, elapsed, acked, data_plane_cpu


def check_stream_once(layout: KVLayout, secret: bytes, port: int, tls: str) -> None:
    """Correctness before timing: 8 requests x 20 tokens streamed, flushed, read back exact."""
    gen = torch.Generator().manual_seed(1)
    slots = torch.arange(160, dtype=torch.int64)
    scatter_tokens(
        layout,
        slots,
        torch.randint(0, 256, (160, layout.record_bytes), dtype=torch.uint8, generator=gen).to(layout.device),
    )
    with CheckpointStreamer(layout, secret, model_fingerprint=MODEL, tls=tls) as streamer:
        for r in range(8):
            streamer.add_request(r, [("127.0.0.1", port)], [_issuer().issue(r, 0, 0, holder_id=0)])
        ids = np.repeat(np.arange(8, dtype=np.uint64), 20)
        pos = np.tile(np.arange(20, dtype=np.uint64), 8)
        streamer.save_step(ids, pos, slots.numpy(), np.zeros(160, dtype=np.uint32))
        assert streamer.flush(timeout_s=30) and streamer.stats().coverage == 1.0
        with Client("127.0.0.1", port, secret, tls=tls) as client:
            for r in range(8):
                got = client.read(r, 0, 0, 0, 20, layout.record_bytes, _issuer().issue(r, 0, 0, holder_id=0))
                expected = gather_tokens(layout, slots[r * 20 : (r + 1) * 20]).cpu().numpy()
                assert np.array_equal(got.records, expected)
        for r in range(8):
            streamer.release(r)
        streamer.flush(timeout_s=30)


def bench_restore(num_tokens: int, layers: int, repeats: int, tls: str, device: str) -> tuple[float, float]:
    """(restore GB/s with verification, memcpy GB/s) for num_tokens records; on a GPU the
    baseline is a pinned host-to-device copy."""
    source = make_layout(num_tokens, layers, device)
    gen = torch.Generator().manual_seed(2)
    slots = torch.arange(num_tokens, dtype=torch.int64)
    for start in range(0, num_tokens, 256):
        chunk = slots[start : start + 256]
        scatter_tokens(
            source,
            chunk,
            torch.randint(0, 256, (len(chunk), source.record_bytes), dtype=torch.uint8, generator=gen).to(
                device
            ),
        )
    secret = os.urandom(32)
    store = HolderStore()
    fp = fingerprint_bytes(source, MODEL)
    tokens = np.arange(num_tokens, dtype=np.uint32)
    cap = _issuer().issue(1, 0, 0, holder_id=0)
    with (
        store.serve(secret, issuer_public_key=_issuer().public_key, tls=tls) as server,
        Client("127.0.0.1", server.port, secret, tls=tls) as client,
    ):
        client.open(1, 0, 0, source.record_bytes, fp[:32], fp[32:], cap)
        for start in range(0, num_tokens, 256):
            records = gather_tokens(source, slots[start : start + 256]).cpu()
            client.append(
                1,
                0,
                0,
                start,
                tokens[start : start + 256],
                checksum(records).numpy(),
                records.numpy(),
                cap,
                timeout_s=60,
            )
        target = make_layout(num_tokens, layers, device)
        order = torch.randperm(num_tokens, generator=gen)  # other slots than the source's
        result = store.restore(1, target, order, token_ids=tokens, model_fingerprint=MODEL)
        assert result.status is RestoreStatus.COMPLETE and result.restored_tokens == num_tokens
        for start in range(0, num_tokens, 512):
            assert torch.equal(
                gather_tokens(target, order[start : start + 512]),
                gather_tokens(source, slots[start : start + 512]),
            )
        total = num_tokens * source.record_bytes
        del source
        if device == "cuda":
            src = torch.empty(total, dtype=torch.uint8, pin_memory=True).fill_(1)
            dst = torch.zeros(total, dtype=torch.uint8, device=device)

            def copy() -> None:
                dst.copy_(src, non_blocking=True)
                torch.cuda.synchronize()

            def restore() -> None:
                store.restore(1, target, order, token_ids=tokens, model_fingerprint=MODEL)
                torch.cuda.synchronize()
        else:
            src = torch.empty(total, dtype=torch.uint8).fill_(1)
            dst = torch.empty(total, dtype=torch.uint8).fill_(0)

            def copy() -> None:
                _native.require_cpu().copy_bytes(dst.data_ptr(), src.data_ptr(), total, 1)

            def restore() -> None:
                store.restore(1, target, order, token_ids=tokens, model_fingerprint=MODEL)

        # Interleaved, so a burst of load on the shared machine hits both alike; best of each.
        restores, copies = [], []
        for _ in range(repeats):
            restores.append(_timed(restore))
            copies.append(_timed(copy))
    return total / min(restores) / 1e9, total / min(copies) / 1e9


def _timed(fn: object) -> float:
    t0 = time.perf_counter()
    fn()  # type: ignore[operator]
    return time.perf_counter() - t0


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--requests", type=int, nargs="+", default=[64, 256])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--step-ms", type=float, default=50.0)
    parser.add_argument("--repeats", type=int, default=2, help="off/on pairs per request count")
    parser.add_argument("--restore-tokens", type=int, default=4096)
    parser.add_argument("--tls", default="sm,tcp", help="UCX_TLS of the holder and the streamer")
    parser.add_argument("--no-pin", action="store_true", help="leave thread placement to the OS")
    parser.add_argument("--json", default=None, metavar="PATH")
    parser.add_argument("--quick", action="store_true", help="4 layers, 16 requests, 10 steps, 256 tokens")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="where the KV cache lives")
    args = parser.parse_args()
    if args.device == "cuda":
        _native.require_cuda()
    if not _native.HAS_UCX:  # e.g. a GPU machine without the libucx wheel
        print(
            f"skipped: the streamer needs the UCX module ({_native.IMPORT_ERRORS.get('_C_ucx', 'not built')})"
        )
        return 0
    layers = LAYERS
    if args.quick:
        layers, args.requests, args.steps, args.restore_tokens, args.repeats = 4, [16], 10, 256, 1
    torch.set_num_threads(1)
    if args.no_pin:
        CORES.clear()
    rows: list[dict[str, object]] = []
    secret = os.urandom(32)
    with tempfile.TemporaryDirectory() as tmp:
        secret_file = Path(tmp) / "secret"
        secret_file.write_bytes(secret)
        secret_file.chmod(0o600)
        issuer_public_key_file = Path(tmp) / "issuer.pub"
        write_issuer_public_key_file(issuer_public_key_file, _issuer().public_key)
        data_core = {1} if len(CORES) >= 2 else None  # --no-pin: CORES is empty
        holder = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "lumen_core.cli",
                "holder",
                "--port",
                "0",
                "--budget-bytes",
                str(64 << 30),
                "--secret-file",
                str(secret_file),
                "--issuer-key-file",
                str(issuer_public_key_file),
                "--tls",
                args.tls,
            ],
            stdout=subprocess.PIPE,
            stdin=subprocess.DEVNULL,
            text=True,
            preexec_fn=(lambda: os.sched_setaffinity(0, data_core)) if data_core else None,
        )
        try:
            assert holder.stdout is not None
            port = json.loads(holder.stdout.readline())["port"]
            for num_requests in args.requests:
                layout = make_layout(
                    max(num_requests * args.steps, 160), layers, args.device
                )  # 160: the check
                check_stream_once(layout, secret, port, args.tls)
                pin({1})  # the streamer's threads inherit the data-plane core
                streamer = CheckpointStreamer(
                    layout,
                    secret,
                    model_fingerprint=MODEL,
                    tls=args.tls,
                    staging_buffers=4,
                    staging_bytes=max(64 << 20, 2 * num_requests * layout.record_bytes),
                )
                pin({0})
                decode = Decode(layout, num_requests, args.steps, args.step_ms)
                off: list[float] = []
                on: list[float] = []
                off_cpu: list[float] = []
                on_cpu: list[float] = []
                elapsed = 0.0
                acked = 0
                data_cpu = 0.0
                for r in range(args.repeats):
                    lat, cpu, _, _, _ = run(decode, None, 0, secret, port, holder.pid)
                    off += lat
                    off_cpu += cpu
                    lat, cpu, el, ac, dc = run(decode, streamer, (r + 1) << 32, secret, port, holder.pid)
                    on += lat
                    on_cpu += cpu
                    elapsed += el
                    acked += ac
                    data_cpu += dc
                counters = streamer.stats().counters
                streamer.close()
                if CORES:
                    pin(CORES)
                produced = args.repeats * args.steps * num_requests * (layout.record_bytes + 8)
                p50 = (np.percentile(on, 50), np.percentile(off, 50))
                p99 = (np.percentile(on, 99), np.percentile(off, 99))
                cpu50 = (np.percentile(on_cpu, 50), np.percentile(off_cpu, 50))
                cpu99 = (np.percentile(on_cpu, 99), np.percentile(off_cpu, 99))
                gbps = acked / elapsed / 1e9
                demand = produced / (sum(on) if on else 1) / 1e9
                case = f"{num_requests} requests"
                rows += [
                    {
                        "case": case,
                        "metric": "step_latency_p50_ratio",
                        "value": p50[0] * 1e3,
                        "ratio": p50[0] / p50[1],
                    },
                    {
                        "case": case,
                        "metric": "step_latency_p99_ratio",
                        "value": p99[0] * 1e3,
                        "ratio": p99[0] / p99[1],
                    },
                    {"case": case, "metric": "stream_gb_per_s", "value": gbps, "ratio": gbps / demand},
                    {
                        "case": case,
                        "metric": "step_cpu_p50_ratio",
                        "value": cpu50[0] * 1e3,
                        "ratio": cpu50[0] / cpu50[1],
                    },
                    {
                        "case": case,
                        "metric": "step_cpu_p99_ratio",
                        "value": cpu99[0] * 1e3,
                        "ratio": cpu99[0] / cpu99[1],
                    },
                ]
                print(
                    f"{case}: off p50 {p50[1] * 1e3:.1f} ms p99 {p99[1] * 1e3:.1f} ms | "
                    f"on p50 {p50[0] * 1e3:.1f} ms p99 {p99[0] * 1e3:.1f} ms | "
                    f"p50 ratio {p50[0] / p50[1]:.3f} p99 ratio {p99[0] / p99[1]:.3f} | "
                    f"stream {gbps:.2f} GB/s acked (produced {demand:.2f} GB/s) | dropped steps "
                    f"{counters['steps_dropped']}, deferred tokens {counters['tokens_deferred']} | "
                    f"decode-thread CPU p50 ratio {cpu50[0] / cpu50[1]:.3f} "
                    f"p99 ratio {cpu99[0] / cpu99[1]:.3f} | "
                    f"data plane {data_cpu / elapsed:.0%} of a core ({os.getloadavg()[0]:.1f} load)",
                    flush=True,
                )
                del layout, decode
        finally:
            holder.terminate()
            holder.wait(timeout=30)
    restore, memcpy = bench_restore(args.restore_tokens, layers, 5, args.tls, args.device)
    rows.append(
        {
            "case": f"{args.restore_tokens} tokens",
            "metric": "restore_vs_memcpy",
            "value": restore,
            "ratio": restore / memcpy,
        }
    )
    print(
        f"restore {args.restore_tokens} tokens with verification: {restore:.2f} GB/s, memcpy "
        f"{memcpy:.2f} GB/s, ratio {restore / memcpy:.2f}",
        flush=True,
    )
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))
    return 0


# ---- pytest-benchmark (make bench): a verified restore of 256 tokens of 4 layers ------------


def test_restore_256_tokens(benchmark) -> None:  # type: ignore[no-untyped-def]
    # One call: a holder and a client set up, 256 records appended, the restore checked bit for
    # bit, then restores and memcpy timed interleaved; their GB/s go to extra_info.
    restore_gb_per_s, memcpy_gb_per_s = benchmark.pedantic(
        bench_restore, args=(256, 4, 3, "tcp", "cpu"), rounds=1, iterations=1
    )
    benchmark.extra_info.update(restore_gb_per_s=restore_gb_per_s, memcpy_gb_per_s=memcpy_gb_per_s)
    assert restore_gb_per_s > 0 and memcpy_gb_per_s > 0


if __name__ == "__main__":
    sys.exit(main())
