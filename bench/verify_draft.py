"""Benchmark of verify_draft against a vectorised torch implementation of the same semantics
in the style of vLLM's rejection sampler, measured in the same run with the same threads.

    python bench/verify_draft.py [--device cpu|cuda] [--threads N] [--repeat R] [--calls N]
                                 [--hot-path-only] [--json PATH]

B = 64 requests, k = 4 drafts, V = 32,000 and 151,936, float32 target probabilities, dense
and one-hot draft probabilities. The torch baseline gathers p(d) and q(d), builds the accept
mask by a cumulative product, computes the residual max(p - q, 0) normalised for every
position and draws the recovered and bonus tokens with torch.multinomial. Correctness is
checked once before timing: the accepted counts and accepted tokens of both implementations
agree on the same uniforms (acceptance depends only on u0), and two requests match the loop
reference bit for bit. A second baseline, `torch_cdf`, replaces torch.multinomial by an
inverse CDF (cumsum + searchsorted) on the given uniforms, the strongest torch idiom found.
JSON rows (metric `verify_draft_vs_torch`): vocab, draft, impl, device, threads, ms,
ratio_vs_torch, ratio_vs_torch_cdf.

The hot path (metric `verify_draft_ms`, with B, k, V, device, clock, calls): B = 64, k = 4,
V = 32,000, probabilities on the device, one-hot drafts, Philox draws. `clock` `host_wall`: wall
time per call over `calls` back-to-back calls (Python checks included) with one
synchronisation at the end. `clock` `cuda_event` (CUDA only): device time per call between two
events around the same number of calls, queued while the GPU sleeps so that no launch gap
counts. The outputs of the first call are checked against the CPU path bit for bit first.
"""

import argparse
import functools
import json
import os
import statistics
import time
from collections.abc import Callable

import torch

from lumen_core import verify_draft
from lumen_core.reference import verify_draft_reference

NUM_REQUESTS = 64
NUM_DRAFTS = 4
VOCAB_SIZES = (32_000, 151_936)


def torch_verify(
    target: torch.Tensor,
    draft_token_ids: torch.Tensor,
    draft_probs: torch.Tensor | None,
    uniforms: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Vectorised chain verification: every position's residual is formed, one is used."""
    num_requests, rows, vocab_size = target.shape
    k = rows - 1
    ids = draft_token_ids.unsqueeze(-1)
    p_d = target[:, :k].gather(-1, ids).squeeze(-1).double()
    if draft_probs is None:
        q_d = torch.ones_like(p_d)
        residual = target[:, :k].clone()
        residual.scatter_(-1, ids, 0.0)  # max(p - onehot(d), 0)
    else:
        q_d = draft_probs.gather(-1, ids).squeeze(-1).double()
        residual = (target[:, :k] - draft_probs).clamp_min_(0.0)
    accept = (q_d > 0) & (uniforms[:, :k, 0] * q_d < p_d)
    num_accepted = accept.int().cumprod(dim=1).sum(dim=1)
    mass = residual.sum(-1, keepdim=True)
    residual = torch.where(mass > 1e-12, residual / mass, target[:, :k])
    recovered = torch.multinomial(residual.reshape(-1, vocab_size), 1).view(num_requests, k)
    bonus = torch.multinomial(target[:, k], 1)
    candidates = torch.cat([recovered, bonus], dim=1)
    columns = torch.arange(k + 1, device=target.device).unsqueeze(0)
    accepted_part = torch.cat([draft_token_ids, torch.zeros_like(bonus)], dim=1)
    out = torch.where(columns < num_accepted.unsqueeze(1), accepted_part, -1)
    out = torch.where(columns == num_accepted.unsqueeze(1), candidates, out)
    return out, num_accepted


def torch_verify_cdf(
    target: torch.Tensor,
    draft_token_ids: torch.Tensor,
    draft_probs: torch.Tensor | None,
    uniforms: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The same, sampling by inverse CDF (cumsum + searchsorted) with the given uniforms
    instead of torch.multinomial: the strongest torch idiom found for this op."""
    _, rows, vocab_size = target.shape
    k = rows - 1
    ids = draft_token_ids.unsqueeze(-1)
    p_d = target[:, :k].gather(-1, ids).squeeze(-1).double()
    if draft_probs is None:
        q_d = torch.ones_like(p_d)
        residual = target[:, :k].clone()
        residual.scatter_(-1, ids, 0.0)
    else:
        q_d = draft_probs.gather(-1, ids).squeeze(-1).double()
        residual = (target[:, :k] - draft_probs).clamp_min_(0.0)
    accept = (q_d > 0) & (uniforms[:, :k, 0] * q_d < p_d)
    num_accepted = accept.int().cumprod(dim=1).sum(dim=1)
    mass = residual.sum(-1, keepdim=True)
    weights = torch.cat([torch.where(mass > 1e-12, residual, target[:, :k]), target[:, k:]], dim=1)
    cdf = weights.cumsum(-1)
    x = (uniforms[:, :, 1] * cdf[..., -1].double()).to(cdf.dtype).unsqueeze(-1)
    candidates = torch.searchsorted(cdf, x, right=True).squeeze(-1).clamp_max_(vocab_size - 1)
    columns = torch.arange(k + 1, device=target.device).unsqueeze(0)
    accepted_part = torch.cat([draft_token_ids, torch.zeros_like(draft_token_ids[:, :1])], dim=1)
    out = torch.where(columns < num_accepted.unsqueeze(1), accepted_part, -1)
    out = torch.where(columns == num_accepted.unsqueeze(1), candidates, out)
    return out, num_accepted


def make_inputs(
    vocab_size: int, device: str, seed: int = 0
) -> tuple[torch.Tensor, dict[str, tuple[torch.Tensor, torch.Tensor | None]], torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(NUM_REQUESTS, NUM_DRAFTS + 1, vocab_size, generator=gen) * 4
    target = torch.softmax(logits, -1)
    draft_logits = logits[:, :NUM_DRAFTS] + torch.randn(NUM_REQUESTS, NUM_DRAFTS, vocab_size, generator=gen)
    dense = torch.softmax(draft_logits, -1)
    dense_ids = torch.multinomial(dense.view(-1, vocab_size), 1, generator=gen).view(NUM_REQUESTS, NUM_DRAFTS)
    greedy_ids = draft_logits.argmax(-1)
    uniforms = torch.rand(NUM_REQUESTS, NUM_DRAFTS + 1, 2, generator=gen, dtype=torch.float64)
    return (
        target.to(device),
        {"dense": (dense_ids.to(device), dense.to(device)), "one_hot": (greedy_ids.to(device), None)},
        uniforms.to(device),
    )


def timed_ms(fn: Callable[[], object], repeat: int, device: str) -> float:
    samples = []
    for _ in range(repeat + 1):  # the first call warms up
        if device == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        if device == "cuda":
            torch.cuda.synchronize()
        samples.append((time.perf_counter() - start) * 1e3)
    return statistics.median(samples[1:])


def check(target, ids, draft_probs, uniforms, threads: int) -> None:
    ours = verify_draft(target, ids, draft_probs, uniforms=uniforms, num_threads=threads)
    for baseline in (torch_verify, torch_verify_cdf):
        out, num_accepted = baseline(target, ids, draft_probs, uniforms)
        assert torch.equal(ours.num_accepted, num_accepted.to(torch.int64)), "accepted counts differ"
        accepted = torch.arange(NUM_DRAFTS + 1, device=target.device).unsqueeze(0) < num_accepted.unsqueeze(1)
        assert torch.equal(ours.output_token_ids[accepted], out[accepted]), "accepted tokens differ"
    cpu = [x[:2].cpu() if x is not None else None for x in (target, ids, draft_probs, uniforms)]
    ref = verify_draft_reference(cpu[0], cpu[1], cpu[2], uniforms=cpu[3])
    assert torch.equal(ours.output_token_ids[:2].cpu(), ref.output_token_ids), "reference differs"


def hot_path_rows(device: str, calls: int, threads: int) -> list[dict[str, object]]:
    """The `verify_draft_ms` rows of the hot path (module docstring)."""
    vocab_size = VOCAB_SIZES[0]
    target, drafts, _ = make_inputs(vocab_size, device)
    ids, _ = drafts["one_hot"]
    seeds = torch.arange(NUM_REQUESTS, dtype=torch.int64, device=device)
    positions = torch.full((NUM_REQUESTS,), 1000, dtype=torch.int64, device=device)

    def call() -> object:
        return verify_draft(target, ids, seeds=seeds, positions=positions, num_threads=threads)

    first = call().check()
    cpu = verify_draft(target.cpu(), ids.cpu(), seeds=seeds.cpu(), positions=positions.cpu())
    assert torch.equal(first.output_token_ids.cpu(), cpu.output_token_ids), "differs from the CPU path"
    for _ in range(10):  # warm-up
        call()
    synchronize = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        call()
    synchronize()
    timings = {"host_wall": (time.perf_counter() - start) * 1e3 / calls}
    if device == "cuda":
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        # Keep the GPU busy (at ~2 GHz) for twice the host time of the calls below, so they are
        # all queued before the first one runs.
        torch.cuda._sleep(int(timings["host_wall"] * calls * 2e6 * 2))
        begin.record()
        for _ in range(calls):
            call()
        end.record()
        end.synchronize()
        timings["cuda_event"] = begin.elapsed_time(end) / calls
    rows = []
    for clock, ms in timings.items():
        rows.append(
            {
                "metric": "verify_draft_ms",
                "B": NUM_REQUESTS,
                "k": NUM_DRAFTS,
                "V": vocab_size,
                "device": device,
                "clock": clock,
                "calls": calls,
                "threads": threads,
                "ms": round(ms, 4),
            }
        )
        print(
            f"verify_draft_ms B={NUM_REQUESTS} k={NUM_DRAFTS} V={vocab_size} {device} {clock:>10} "
            f"{ms:9.4f} ms"
        )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument(
        "--calls", type=int, default=None, help="hot-path calls (1000 on CUDA, 20 on the CPU)"
    )
    parser.add_argument("--hot-path-only", action="store_true", help="only the verify_draft_ms rows")
    parser.add_argument("--json", dest="json_path", default=None)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    calls = args.calls if args.calls is not None else (1000 if args.device == "cuda" else 20)
    rows = hot_path_rows(args.device, calls, args.threads)
    for vocab_size in () if args.hot_path_only else VOCAB_SIZES:
        target, drafts, uniforms = make_inputs(vocab_size, args.device)
        for draft, (ids, draft_probs) in drafts.items():
            check(target, ids, draft_probs, uniforms, args.threads)
            inputs = (target, ids, draft_probs, uniforms)
            ms_torch = timed_ms(functools.partial(torch_verify, *inputs), args.repeat, args.device)
            ms_cdf = timed_ms(functools.partial(torch_verify_cdf, *inputs), args.repeat, args.device)
            ours = functools.partial(
                verify_draft, target, ids, draft_probs, uniforms=uniforms, num_threads=args.threads
            )
            ms_ours = timed_ms(ours, args.repeat, args.device)
            impl = "native_cuda" if args.device == "cuda" else "native_cpu"
            for name, ms in ((impl, ms_ours), ("torch", ms_torch), ("torch_cdf", ms_cdf)):
                rows.append(
                    {
                        "metric": "verify_draft_vs_torch",
                        "vocab": vocab_size,
                        "draft": draft,
                        "impl": name,
                        "device": args.device,
                        "threads": args.threads,
                        "ms": round(ms, 3),
                        "ratio_vs_torch": round(ms_torch / ms, 2),
                        "ratio_vs_torch_cdf": round(ms_cdf / ms, 2),
                    }
                )
                print(
                    f"{vocab_size:>7} {draft:>8} {name:>12} {ms:9.3f} ms  "
                    f"{ms_torch / ms:6.2f}x torch  {ms_cdf / ms:6.2f}x torch_cdf"
                )
    if args.json_path:
        with open(args.json_path, "w") as f:
            json.dump(rows, f, indent=1)


# ---- pytest-benchmark (make bench): one vocabulary, dense drafts, checked first -----------


def test_verify_draft_dense(benchmark) -> None:  # type: ignore[no-untyped-def]
    target, drafts, uniforms = make_inputs(4096, "cpu")
    ids, draft_probs = drafts["dense"]
    check(target, ids, draft_probs, uniforms, threads=1)
    benchmark(verify_draft, target, ids, draft_probs, uniforms=uniforms, num_threads=1)


if __name__ == "__main__":
    main()
