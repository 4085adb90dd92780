"""CheckpointStreamer on a CUDA KV cache (marked `cuda`; scripts/gpu_check.sh runs them on a GPU
machine): what a holder ends up with are the rows the engine wrote, in every layout, and a step
is gathered only after the work the engine queued on its stream before save_step."""

from __future__ import annotations

import time
from typing import Any

import numpy as np
import pytest
import torch

from lumen_core import _native
from lumen_core.auth import CapabilityIssuer
from lumen_core.layouts import KVLayout
from lumen_core.ops import gather_tokens, scatter_tokens
from lumen_core.stream import CheckpointStreamer, RestoreStatus, remote_restore
from lumen_core.testing import make_paged_cache
from lumen_core.transport import Client

pytestmark = [pytest.mark.ucx, pytest.mark.timeout(120)]
needs_gpu = pytest.mark.skipif(not _native.HAS_CUDA, reason="needs a CUDA device")

MODEL = "stream-model-cuda"
TLS = "tcp"
GEOMETRY: dict[str, Any] = {
    "num_layers": 2,
    "num_blocks": 64,
    "block_size": 16,
    "num_kv_heads": 2,
    "head_dim": 16,
}


def held_records(
    port: int, secret: bytes, issuer: CapabilityIssuer, rid: int, kind: str, n: int
) -> torch.Tensor:
    """The n records the holder at port keeps for rid, restored into a CPU cache of kind."""
    target = make_paged_cache(kind, seed=9, **GEOMETRY)
    slots = torch.arange(n, dtype=torch.int64)
    with Client("127.0.0.1", port, secret, tls=TLS) as client:
        result = remote_restore(
            client,
            rid,
            target,
            slots,
            token_ids=np.arange(n, dtype=np.uint32),
            model_fingerprint=MODEL,
            capability=issuer.issue(rid, 0, 0, holder_id=0),
        )
    assert (result.status, result.restored_tokens) == (RestoreStatus.COMPLETE, n)
    return gather_tokens(target, slots)


def streamer_for(
    layout: KVLayout, secret: bytes, issuer: CapabilityIssuer, port: int, rid: int
) -> CheckpointStreamer:
    streamer = CheckpointStreamer(layout, secret, model_fingerprint=MODEL, tls=TLS, ack_timeout_s=10.0)
    streamer.add_request(rid, [("127.0.0.1", port)], [issuer.issue(rid, 0, 0, holder_id=0)])
    return streamer


def test_the_cuda_path_is_built_with_the_cuda_module() -> None:
    assert _native.require_ucx().STREAMER_CUDA == ("cuda" in _native.BUILD_INFO["modules"])


@pytest.mark.cuda
@needs_gpu
@pytest.mark.parametrize(
    "kind", ["vllm_flash", "vllm_flash_hnd", "sglang", "mla", "vllm_paged", "vllm_paged_blocks_outer"]
)
def test_a_cuda_cache_streams_bit_exact(
    issuer: CapabilityIssuer, kind: str, holder: Any, secret: bytes
) -> None:
    layout = make_paged_cache(kind, device="cuda", seed=1, **GEOMETRY)
    h = holder()
    slots = torch.randperm(layout.num_slots, generator=torch.Generator().manual_seed(2))[:40]
    with streamer_for(layout, secret, issuer, h.port, 7) as streamer:
        for start in range(0, 40, 8):  # five steps of eight tokens
            end = start + 8
            streamer.save_step(
                [7] * 8, list(range(start, end)), slots[start:end], np.arange(start, end, dtype=np.uint32)
            )
        assert streamer.flush(timeout_s=30)
        stats = streamer.stats()
    assert stats.durable == {7: 40} and stats.counters["gather_failures"] == 0
    expected = gather_tokens(layout, slots.to(layout.device)).cpu()
    assert torch.equal(held_records(h.port, secret, issuer, 7, kind, 40), expected)


@pytest.mark.cuda
@needs_gpu
@pytest.mark.parametrize("engine_on_side_stream", [False, True])
def test_a_step_is_gathered_after_the_engines_queued_writes(
    issuer: CapabilityIssuer, engine_on_side_stream: bool, holder: Any, secret: bytes
) -> None:
    layout = make_paged_cache("vllm_flash", device="cuda", seed=1, **GEOMETRY)
    h = holder()
    n = 64
    slots = torch.arange(100, 100 + n, dtype=torch.int64)
    fresh = torch.randint(
        0, 256, (n, layout.record_bytes), dtype=torch.uint8, generator=torch.Generator().manual_seed(3)
    ).to(layout.device)
    torch.cuda.synchronize()
    engine = torch.cuda.Stream() if engine_on_side_stream else torch.cuda.current_stream()
    with streamer_for(layout, secret, issuer, h.port, 3) as streamer, torch.cuda.stream(engine):
        # The engine's step: a long kernel, then the writes of the step's KV, all queued and
        # none done when save_step is called. A gather that did not wait would read old rows.
        torch.cuda._sleep(4_000_000_000)  # about two seconds of GPU time
        scatter_tokens(layout, slots, fresh, stream=engine)  # CPU ids: no wait for the device
        started = time.perf_counter()
        fence = streamer.save_step([3] * n, list(range(n)), slots, np.arange(n, dtype=np.uint32))
        assert time.perf_counter() - started < 0.5  # save_step only enqueues
        assert not engine.query()  # the engine's work is still running
        streamer.wait_fence(fence, timeout_s=60)
        assert engine.query()  # the gather waited for it
        assert streamer.flush(timeout_s=30)
    assert torch.equal(held_records(h.port, secret, issuer, 3, "vllm_flash", n), fresh.cpu())
