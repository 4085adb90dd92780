"""Decode throughput and step latency of the reference engine on this CPU (issue 7).

The default tiny model (4 layers, hidden 64, vocab 256, fp32) decodes ``--steps`` steps at
batch 1, 16 and 64 (prompts of 32 tokens, paged KV with block size 16). Baseline, in the same
run: the same model decoding the same batch with the plain torch idiom, contiguous per-batch
K/V tensors and one batched SDPA per layer (no pages, no scheduler); the ratio is the cost of
paging and continuous batching. Then speculative decoding with a draft (the target truncated
to 2 of its 4 layers, late layers at ``--late-layer-scale``) at k = 2 and 4: tokens per verify
step against ``(1 - a^(k+1)) / (1 - a)`` for the measured per-position acceptance ``a`` (accepted /
tested drafts; accepted / proposed is reported too), and output tokens/s
against plain decoding. Correctness is checked once before timing (greedy tokens of engine,
baseline and speculative decoding agree in float64). Latencies are medians over the steps of
this thread's CPU time (``--clock wall`` for wall-clock time).

    python bench/engine_step.py [--json PATH] [--steps N] [--threads N] [--clock cpu|wall] [--quick]

Under pytest-benchmark (``make bench``) ``test_engine_decode_step`` times one batch-16 step.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass

import torch
from torch.nn import functional as F

from lumen_core.engine import (
    CacheConfig,
    DraftProposer,
    Engine,
    Llama,
    ModelConfig,
    SamplingParams,
    SchedulerConfig,
    SpeculativeDecoder,
    build_draft_pair,
)
from lumen_core.policy import expected_tokens_per_step

PROMPT_TOKENS = 32
BLOCK_SIZE = 16
BATCHES = (1, 16, 64)
# The step clock: this thread's CPU time by default. With one torch thread (and verify_draft
# running inline at one thread) every step's work runs on this thread, and the 2 shared
# cores run other builds whose time wall-clock figures would count as ours. ``--clock wall``
# switches to wall-clock time.
CLOCK: list[Callable[[], float]] = [time.thread_time]
DRAFT_KS = (2, 4)


@dataclass(frozen=True)
class DecodeRow:
    batch: int
    engine_step_ms: float
    engine_tokens_per_s: float
    baseline_step_ms: float
    baseline_tokens_per_s: float
    ratio_vs_baseline: float


@dataclass(frozen=True)
class SpecRow:
    batch: int
    k: int
    acceptance_rate: float
    chain_acceptance_rate: float
    tokens_per_verify_step: float
    expected_tokens_per_verify_step: float
    step_ms: float
    tokens_per_s: float
    ratio_vs_plain_decode: float


def prompts(batch: int, vocab_size: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(batch)
    return torch.randint(0, vocab_size, (batch, PROMPT_TOKENS), generator=generator).tolist()


class DenseBatchAttention:
    """Baseline attention: contiguous ``[B, H, max_len, D]`` K/V per layer, one SDPA per layer
    for the whole batch (all requests have the same length, so no mask is needed)."""

    def __init__(self, model: Llama, batch: int, max_len: int) -> None:
        c = model.config
        shape = (batch, c.num_kv_heads, max_len, c.head_dim)
        self.k = [torch.zeros(shape, dtype=model.dtype) for _ in range(c.num_layers)]
        self.v = [torch.zeros(shape, dtype=model.dtype) for _ in range(c.num_layers)]
        self.batch, self.length, self.num_new = batch, 0, 0

    def __call__(self, layer_id: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        b, n = self.batch, self.num_new
        end = self.length + n
        self.k[layer_id][:, :, self.length : end] = k.view(b, n, *k.shape[1:]).transpose(1, 2)
        self.v[layer_id][:, :, self.length : end] = v.view(b, n, *v.shape[1:]).transpose(1, 2)
        qs = q.view(b, n, *q.shape[1:]).transpose(1, 2)
        group = q.shape[1] // k.shape[1]
        ks = self.k[layer_id][:, :, :end].repeat_interleave(group, dim=1)
        vs = self.v[layer_id][:, :, :end].repeat_interleave(group, dim=1)
        mask = torch.ones(n, end, dtype=torch.bool).tril(diagonal=self.length) if n > 1 else None
        out = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask)
        return out.transpose(1, 2).reshape(b * n, *q.shape[1:])


def baseline_decode(
    model: Llama, ps: Sequence[Sequence[int]], steps: int
) -> tuple[list[list[int]], list[float]]:
    """Greedy decode with the dense baseline; returns tokens and per-step seconds."""
    b = len(ps)
    attention = DenseBatchAttention(model, b, PROMPT_TOKENS + steps + 1)
    tokens = torch.tensor(ps)
    attention.num_new = PROMPT_TOKENS
    positions = torch.arange(PROMPT_TOKENS).repeat(b)
    last_rows = torch.arange(b) * PROMPT_TOKENS + PROMPT_TOKENS - 1
    next_ids = model(tokens.flatten(), positions, attention, last_rows).argmax(-1)
    attention.length, attention.num_new = PROMPT_TOKENS, 1
    out = [[t] for t in next_ids.tolist()]
    times = []
    for _ in range(steps):
        t0 = CLOCK[0]()
        positions = torch.full((b,), attention.length)
        next_ids = model(next_ids, positions, attention).argmax(-1)
        attention.length += 1
        times.append(CLOCK[0]() - t0)
        for row, t in zip(out, next_ids.tolist(), strict=True):
            row.append(t)
    return out, times


def engine_decode(
    model: Llama, ps: Sequence[Sequence[int]], steps: int
) -> tuple[list[list[int]], list[float]]:
    """Greedy decode with the engine: prefill, then ``steps`` timed decode steps."""
    engine = Engine(
        model,
        CacheConfig(
            num_blocks=len(ps) * ((PROMPT_TOKENS + steps + BLOCK_SIZE) // BLOCK_SIZE + 1),
            block_size=BLOCK_SIZE,
        ),
        SchedulerConfig(max_num_batched_tokens=max(512, len(ps) * PROMPT_TOKENS), max_num_seqs=len(ps)),
    )
    for i, p in enumerate(ps):
        engine.add_request(str(i), p, SamplingParams(max_tokens=steps + 1))
    out: dict[str, list[int]] = {str(i): [] for i in range(len(ps))}
    while any(not v for v in out.values()):
        for rid, toks in engine.step().new_token_ids.items():
            out[rid].extend(toks)
    times = []
    for _ in range(steps):
        t0 = CLOCK[0]()
        step = engine.step()
        times.append(CLOCK[0]() - t0)
        for rid, toks in step.new_token_ids.items():
            out[rid].extend(toks)
    return [out[str(i)] for i in range(len(ps))], times


def spec_decode(
    target: Llama, draft: Llama, ps: Sequence[Sequence[int]], k: int, max_tokens: int
) -> tuple[list[list[int]], SpeculativeDecoder, list[float]]:
    blocks = len(ps) * ((PROMPT_TOKENS + max_tokens + k + BLOCK_SIZE) // BLOCK_SIZE + 1)
    spec = SpeculativeDecoder(
        Engine(
            target,
            CacheConfig(blocks, BLOCK_SIZE),
            SchedulerConfig(max_num_batched_tokens=max(512, len(ps) * PROMPT_TOKENS), max_num_seqs=len(ps)),
        ),
        DraftProposer(draft, CacheConfig(blocks, BLOCK_SIZE)),
        k,
    )
    for i, p in enumerate(ps):
        spec.engine.add_request(str(i), p, SamplingParams(max_tokens=max_tokens))
    out: dict[str, list[int]] = {str(i): [] for i in range(len(ps))}
    times = []
    while spec.engine.has_unfinished():
        t0 = CLOCK[0]()
        step = spec.step()
        if step.num_draft_tokens:
            times.append(CLOCK[0]() - t0)
        for rid, toks in step.new_token_ids.items():
            out[rid].extend(toks)
    return [out[str(i)] for i in range(len(ps))], spec, times


def check_correctness(late_layer_scale: float) -> None:
    target64, draft64 = build_draft_pair(
        ModelConfig(),
        seed=0,
        draft_num_layers=2,
        late_layer_scale=late_layer_scale,
        dtype="float64",
    )
    ps = prompts(4, target64.config.vocab_size)
    engine_out, _ = engine_decode(target64, ps, 8)
    baseline_out, _ = baseline_decode(target64, ps, 8)
    spec_out, _, _ = spec_decode(target64, draft64, ps, 3, 9)
    if not engine_out == baseline_out == spec_out:
        raise SystemExit("correctness check failed: engine, baseline and speculative outputs differ")


@dataclass(frozen=True)
class AcceptanceRow:
    draft_num_layers: int
    late_layer_scale: float
    k: int
    acceptance_rate: float
    chain_acceptance_rate: float
    tokens_per_verify_step: float


def acceptance_sweep(
    num_tokens: int, layer_counts: Sequence[int], scales: Sequence[float]
) -> list[AcceptanceRow]:
    """Greedy acceptance of draft settings: 32 prompts of 32 tokens, ``num_tokens`` outputs."""
    rows = []
    ps = prompts(32, ModelConfig().vocab_size)
    for layers in layer_counts:
        for scale in scales:
            target, draft = build_draft_pair(
                ModelConfig(), seed=0, draft_num_layers=layers, late_layer_scale=scale
            )
            for k in DRAFT_KS:
                _, spec, _ = spec_decode(target, draft, ps, k, num_tokens)
                s = spec.stats
                rows.append(
                    AcceptanceRow(
                        layers,
                        scale,
                        k,
                        s.acceptance_rate,
                        s.chain_acceptance_rate,
                        s.tokens_per_verify_step,
                    )
                )
    return rows


def run(
    steps: int, batches: Sequence[int], late_layer_scale: float, *, quick: bool = False
) -> dict[str, object]:
    check_correctness(late_layer_scale)
    target, draft = build_draft_pair(
        ModelConfig(), seed=0, draft_num_layers=2, late_layer_scale=late_layer_scale
    )
    decode_rows, spec_rows = [], []
    for b in batches:
        ps = prompts(b, target.config.vocab_size)
        _, engine_times = engine_decode(target, ps, steps)
        _, base_times = baseline_decode(target, ps, steps)
        e_ms, b_ms = statistics.median(engine_times) * 1e3, statistics.median(base_times) * 1e3
        decode_rows.append(DecodeRow(b, e_ms, b / e_ms * 1e3, b_ms, b / b_ms * 1e3, (b / e_ms) / (b / b_ms)))
        for k in DRAFT_KS:
            _, spec, times = spec_decode(target, draft, ps, k, steps + 1)
            s = spec.stats
            step_ms = statistics.median(times) * 1e3
            tokens_per_s = s.num_emitted / sum(times)
            spec_rows.append(
                SpecRow(
                    b,
                    k,
                    s.acceptance_rate,
                    s.chain_acceptance_rate,
                    s.tokens_per_verify_step,
                    expected_tokens_per_step(s.chain_acceptance_rate, k),
                    step_ms,
                    tokens_per_s,
                    tokens_per_s / decode_rows[-1].engine_tokens_per_s,
                )
            )
    return {
        "config": asdict(ModelConfig()),
        "dtype": "float32",
        "threads": torch.get_num_threads(),
        "steps": steps,
        "prompt_tokens": PROMPT_TOKENS,
        "block_size": BLOCK_SIZE,
        "draft": {"num_layers": 2, "late_layer_scale": late_layer_scale},
        "decode": [asdict(r) for r in decode_rows],
        "speculative": [asdict(r) for r in spec_rows],
        "acceptance": [
            asdict(r)
            for r in (
                acceptance_sweep(steps, (2,), (0.2, 1.0))
                if quick
                else acceptance_sweep(steps, (1, 2, 3), (0.1, 0.2, 0.5, 1.0))
            )
        ],
    }


def markdown_table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(str(x) for x in row) + " |" for row in rows]
    return "\n".join(lines)


def print_tables(result: dict) -> None:  # type: ignore[type-arg]
    print(
        f"threads={result['threads']} clock={result['clock']} steps={result['steps']} "
        f"prompt={result['prompt_tokens']} dtype={result['dtype']}"
    )
    headers = ["batch", "engine step ms", "engine tok/s", "baseline step ms", "baseline tok/s"]
    rows = [
        [
            r["batch"],
            f"{r['engine_step_ms']:.2f}",
            f"{r['engine_tokens_per_s']:.0f}",
            f"{r['baseline_step_ms']:.2f}",
            f"{r['baseline_tokens_per_s']:.0f}",
            f"{r['ratio_vs_baseline']:.2f}",
        ]
        for r in result["decode"]
    ]
    print(markdown_table([*headers, "ratio"], rows), end="\n\n")
    headers = ["batch", "k", "accepted/proposed", "a = accepted/tested", "tokens/verify"]
    headers += ["(1-a^(k+1))/(1-a)", "verify step ms", "tok/s", "vs plain decode"]
    rows = [
        [
            r["batch"],
            r["k"],
            f"{r['acceptance_rate']:.3f}",
            f"{r['chain_acceptance_rate']:.3f}",
            f"{r['tokens_per_verify_step']:.2f}",
            f"{r['expected_tokens_per_verify_step']:.2f}",
            f"{r['step_ms']:.2f}",
            f"{r['tokens_per_s']:.0f}",
            f"{r['ratio_vs_plain_decode']:.2f}",
        ]
        for r in result["speculative"]
    ]
    print(markdown_table(headers, rows), end="\n\n")
    headers = ["draft layers (of 4)", "late_layer_scale", "k", "accepted/proposed"]
    headers += ["a = accepted/tested", "tokens/verify"]
    rows = [
        [
            r["draft_num_layers"],
            r["late_layer_scale"],
            r["k"],
            f"{r['acceptance_rate']:.3f}",
            f"{r['chain_acceptance_rate']:.3f}",
            f"{r['tokens_per_verify_step']:.2f}",
        ]
        for r in result["acceptance"]
    ]
    print(markdown_table(headers, rows))


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", help="write the results as JSON to this path")
    parser.add_argument("--steps", type=int, default=64, help="decode steps per measurement")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    parser.add_argument("--late-layer-scale", type=float, default=0.2, help="draft/target divergence")
    parser.add_argument("--clock", choices=("cpu", "wall"), default="cpu", help="step clock")
    parser.add_argument("--quick", action="store_true", help="8 steps, batches 1 and 16, a short sweep")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    CLOCK[0] = time.thread_time if args.clock == "cpu" else time.perf_counter
    steps = 8 if args.quick else args.steps
    batches = (1, 16) if args.quick else BATCHES
    result = run(steps, batches, args.late_layer_scale, quick=args.quick)
    result["clock"] = args.clock
    print_tables(result)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return 0


def test_engine_decode_step(benchmark) -> None:  # type: ignore[no-untyped-def]
    """One batch-16 decode step of the default tiny model (200 rounds, one torch thread)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    target, _ = build_draft_pair(ModelConfig(), seed=0, draft_num_layers=2, late_layer_scale=0.2)
    engine = Engine(target, CacheConfig(16 * 17, BLOCK_SIZE))
    for i, p in enumerate(prompts(16, target.config.vocab_size)):
        engine.add_request(str(i), p, SamplingParams(max_tokens=230))
    engine.step()
    benchmark.pedantic(engine.step, rounds=200, iterations=1)
    torch.set_num_threads(threads)
    assert engine.has_unfinished()


if __name__ == "__main__":
    sys.exit(main())
