"""Paged attention equals contiguous attention; chunked prefill equals one-shot prefill."""

from __future__ import annotations

import pytest
import torch

import lumen_core.engine.runner as runner_module
from lumen_core.engine import CacheConfig, Llama, forward_contiguous
from lumen_core.engine.block_manager import BlockManager
from lumen_core.engine.cache import PagedKVCache
from lumen_core.engine.config import SamplingParams
from lumen_core.engine.request import Request
from lumen_core.engine.runner import Chunk, ModelRunner


def make_runner(model: Llama, num_blocks: int, block_size: int) -> tuple[ModelRunner, BlockManager]:
    cache = PagedKVCache(model.config, CacheConfig(num_blocks, block_size), dtype=model.dtype)
    manager = BlockManager(num_blocks, block_size)
    # Hand pages out in a scrambled order so block tables are far from the identity.
    order = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(0)).tolist()
    manager._free_block_ids.clear()
    manager._free_block_ids.extend(order)
    return ModelRunner(model, cache), manager


def run_chunks(
    runner: ModelRunner, manager: BlockManager, seqs: list[list[int]], chunk_sizes: list[int]
) -> list[torch.Tensor]:
    """Feed every sequence in chunks (all sequences advance together each step) and return
    the logits of every position, gathered over the steps."""
    requests = [Request(str(i), list(s), len(s), SamplingParams()) for i, s in enumerate(seqs)]
    logits: list[list[torch.Tensor]] = [[] for _ in seqs]
    step = 0
    while any(r.num_computed_tokens < r.num_tokens for r in requests):
        size = chunk_sizes[step % len(chunk_sizes)]
        chunks, owners = [], []
        for i, r in enumerate(requests):
            start = r.num_computed_tokens
            n = min(size, r.num_tokens - start)
            if n == 0:
                continue
            manager.allocate(r, start + n)
            chunks.append(
                Chunk(
                    r.token_ids[start : start + n],
                    start,
                    manager.slot_ids(r, start, start + n),
                    list(r.block_ids),
                    n,
                )
            )
            owners.append(i)
            r.num_computed_tokens = start + n
        for i, out in zip(owners, runner.execute(chunks), strict=True):
            logits[i].append(out)
        step += 1
    return [torch.cat(x) for x in logits]


@pytest.mark.parametrize("block_size", [1, 3, 16])
@pytest.mark.parametrize("dtype_name", ["model32", "model64"])
def test_paged_equals_contiguous(block_size: int, dtype_name: str, request: pytest.FixtureRequest) -> None:
    model: Llama = request.getfixturevalue(dtype_name)
    generator = torch.Generator().manual_seed(block_size)
    seqs = [torch.randint(0, 256, (n,), generator=generator).tolist() for n in (1, 17, 40)]
    runner, manager = make_runner(model, num_blocks=128, block_size=block_size)
    paged = run_chunks(runner, manager, seqs, [10**6])
    contiguous = forward_contiguous(model, seqs)
    tol = 1e-5 if model.dtype == torch.float32 else 1e-12
    for p, c in zip(paged, contiguous, strict=True):
        torch.testing.assert_close(p, c, atol=tol, rtol=0)


@pytest.mark.parametrize("chunk_sizes", [[1], [5], [3, 7, 1]], ids=["1", "5", "3-7-1"])
def test_chunked_prefill_equals_one_shot(model64: Llama, chunk_sizes: list[int]) -> None:
    generator = torch.Generator().manual_seed(2)
    seqs = [torch.randint(0, 256, (n,), generator=generator).tolist() for n in (9, 33)]
    one_shot = run_chunks(*make_runner(model64, 64, 4), seqs, [10**6])
    chunked = run_chunks(*make_runner(model64, 64, 4), seqs, chunk_sizes)
    for a, b in zip(one_shot, chunked, strict=True):
        # Same math, different query batching inside SDPA: equal to float64 rounding.
        torch.testing.assert_close(a, b, atol=1e-12, rtol=0)


def test_a_wrong_causal_mask_would_fail(model64: Llama, monkeypatch: pytest.MonkeyPatch) -> None:
    """A top-left aligned mask (what is_causal=True gives for a multi-token append) differs."""
    seq = torch.randint(0, 256, (12,), generator=torch.Generator().manual_seed(3)).tolist()
    runner, manager = make_runner(model64, 16, 4)
    good = run_chunks(runner, manager, [seq], [4])[0]
    runner, manager = make_runner(model64, 16, 4)
    original = torch.nn.functional.scaled_dot_product_attention

    def top_left(q, k, v, attn_mask, **kwargs):
        n, length = attn_mask.shape[-2:]
        mask = torch.ones(n, length, dtype=torch.bool).tril() & attn_mask
        return original(q, k, v, attn_mask=mask, **kwargs)

    monkeypatch.setattr(runner_module.F, "scaled_dot_product_attention", top_left)
    bad = run_chunks(runner, manager, [seq], [4])[0]
    assert torch.equal(good[:4], bad[:4])  # the first chunk starts at 0: both masks agree
    assert (good[4:] - bad[4:]).abs().max() > 1e-3


def test_cache_write_read_roundtrip(model64: Llama) -> None:
    cache = PagedKVCache(model64.config, CacheConfig(8, 4), dtype=torch.float64)
    k = torch.randn(6, 2, 16, dtype=torch.float64)
    v = torch.randn(6, 2, 16, dtype=torch.float64)
    block_ids = torch.tensor([5, 2])
    slots = torch.tensor([20, 21, 22, 23, 8, 9])
    cache.write(1, slots, k, v)
    k_out, v_out = cache.read(1, block_ids, 6)
    assert torch.equal(k_out, k) and torch.equal(v_out, v)
    assert torch.equal(cache.kv_caches[1][0, 5, 3], k[3])
    assert cache.kv_caches[0].abs().sum() == 0


def test_flash_attn_is_not_used_where_it_cannot_read_the_cache(model32: Llama) -> None:
    cache = PagedKVCache(model32.config, CacheConfig(4, 256), dtype=torch.float32)
    assert runner_module.find_flash_attn(cache) is None  # CPU, float32
    assert ModelRunner(model32, cache).flash is None


@pytest.mark.cuda
def test_flash_attn_path_equals_the_sdpa_path() -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    pytest.importorskip("flash_attn")
    from lumen_core.engine import ModelConfig, random_weights

    model = random_weights(ModelConfig(), seed=0, dtype="bfloat16").to("cuda")
    seqs = [torch.randint(0, 256, (n,)).tolist() for n in (5, 300, 513)]
    results = []
    for use_flash in (True, False):
        cache = PagedKVCache(model.config, CacheConfig(16, 256), dtype=torch.bfloat16, device="cuda")
        runner = ModelRunner(model, cache)
        assert runner.flash is not None
        if not use_flash:
            runner.flash = None
        manager = BlockManager(16, 256)
        results.append(run_chunks(runner, manager, seqs, [200, 1, 3]))
    for a, b in zip(*results, strict=True):
        torch.testing.assert_close(a.float(), b.float(), atol=5e-2, rtol=0)
