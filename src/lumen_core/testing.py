"""Helpers for engine developers' unit tests: build a paged KV cache, checkpoint and restore a
request's slots, assert that restored KV equals the original bit for bit.

Example (in an engine's own test)::

    from lumen_core import testing
    layout = testing.make_paged_cache("vllm_flash", num_layers=2, num_blocks=8, block_size=16)
    slots = testing.slots_for_blocks([3, 5], block_size=16, num_tokens=20)
    records = testing.checkpoint_slots(layout, slots)
    fresh = testing.make_paged_cache("vllm_flash", num_layers=2, num_blocks=8, block_size=16, seed=1)
    new_slots = testing.slots_for_blocks([0, 7], block_size=16, num_tokens=20)
    testing.restore_slots(fresh, new_slots, records)
    testing.assert_kv_equal(layout, slots, fresh, new_slots)
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import torch

from lumen_core.layouts import KVLayout
from lumen_core.ops import gather_tokens, scatter_tokens

__all__ = [
    "LAYOUT_KINDS",
    "VLLM_PAGED_ORDERS",
    "assert_kv_equal",
    "checkpoint_slots",
    "make_paged_cache",
    "random_tensor",
    "restore_slots",
    "slots_for_blocks",
]

LAYOUT_KINDS = (
    "vllm_flash",
    "vllm_flash_hnd",
    "vllm_flashinfer",
    "vllm_flashinfer_hnd",
    "sglang",
    "mla",
    "vllm_flash_fp8_scales",
    "vllm_paged",
    "vllm_paged_hnd",
    "vllm_paged_blocks_outer",
)

# The physical orders (vLLM's KVCacheLayout, of the logical axes layer, block, head, token,
# content) that make_paged_cache gives the vllm_paged kinds: LBNHC, LBHNC and BLNHC.
VLLM_PAGED_ORDERS = {
    "vllm_paged": (0, 1, 3, 2, 4),
    "vllm_paged_hnd": (0, 1, 2, 3, 4),
    "vllm_paged_blocks_outer": (1, 0, 3, 2, 4),
}


def random_tensor(
    shape: Sequence[int],
    dtype: torch.dtype,
    *,
    device: str | torch.device = "cpu",
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """A tensor of ``shape`` and ``dtype`` whose bytes are uniformly random (NaN bit patterns
    included: the ops move bytes, so compare with ``torch.equal`` on uint8 views)."""
    item = torch.empty((), dtype=dtype).element_size()
    shape = tuple(shape)
    raw = torch.randint(0, 256, shape[:-1] + (shape[-1] * item,), dtype=torch.uint8, generator=generator)
    return raw.view(dtype).to(device)


def make_paged_cache(
    kind: str,
    *,
    num_layers: int,
    num_blocks: int,
    block_size: int,
    num_kv_heads: int = 2,
    head_dim: int = 8,
    dtype: torch.dtype = torch.bfloat16,
    device: str | torch.device = "cpu",
    seed: int = 0,
) -> KVLayout:
    """A KV cache of layout ``kind`` (one of LAYOUT_KINDS) filled with random bytes.

    ``sglang`` has ``num_blocks * block_size`` slots and page size 1; ``mla`` rows are
    ``num_kv_heads * head_dim`` elements; ``vllm_flash_fp8_scales`` is a float8_e4m3fn flash
    cache with per-token-head float32 scale planes (``dtype`` is ignored there). The
    ``vllm_paged`` kinds are one storage for all layers in the physical order
    ``VLLM_PAGED_ORDERS`` names, as vLLM allocates them.
    """
    if kind not in LAYOUT_KINDS:
        raise ValueError(f"`kind` must be one of {LAYOUT_KINDS}, got {kind!r}")
    gen = torch.Generator().manual_seed(seed)
    h, d, nb, bs = num_kv_heads, head_dim, num_blocks, block_size

    def rand(*shape: int, dt: torch.dtype = dtype) -> torch.Tensor:
        return random_tensor(shape, dt, device=device, generator=gen)

    layers = range(num_layers)
    if kind == "vllm_flash":
        return KVLayout.vllm_flash([rand(2, nb, bs, h, d) for _ in layers])
    if kind == "vllm_flash_hnd":
        return KVLayout.vllm_flash_hnd([rand(2, nb, h, bs, d) for _ in layers])
    if kind == "vllm_flashinfer":
        return KVLayout.vllm_flashinfer([rand(nb, 2, bs, h, d) for _ in layers])
    if kind == "vllm_flashinfer_hnd":
        return KVLayout.vllm_flashinfer_hnd([rand(nb, 2, h, bs, d) for _ in layers])
    if kind == "sglang":
        return KVLayout.sglang([rand(nb * bs, h, d) for _ in layers], [rand(nb * bs, h, d) for _ in layers])
    if kind == "mla":
        return KVLayout.mla([rand(nb, bs, h * d) for _ in layers])
    if kind in VLLM_PAGED_ORDERS:
        order = VLLM_PAGED_ORDERS[kind]
        logical = (num_layers, nb, h, bs, 2 * d)
        physical = rand(*(logical[axis] for axis in order))
        return KVLayout.vllm_paged(
            list(physical.permute(*(order.index(axis) for axis in range(5))).unbind(0))
        )
    return KVLayout.vllm_flash(
        [rand(2, nb, bs, h, d, dt=torch.float8_e4m3fn) for _ in layers],
        scales=[rand(2, nb, bs, h, dt=torch.float32) for _ in layers],
    )


def slots_for_blocks(block_ids: Sequence[int], *, block_size: int, num_tokens: int) -> torch.Tensor:
    """``[num_tokens]`` int64 slots of a request whose block table is ``block_ids`` (vLLM's
    slot mapping: token ``i`` lives at ``block_ids[i // block_size] * block_size + i % block_size``)."""
    if num_tokens > len(block_ids) * block_size:
        raise ValueError(
            f"`num_tokens` must be <= {len(block_ids) * block_size} for {len(block_ids)} blocks, "
            f"got {num_tokens}"
        )
    positions = torch.arange(num_tokens, dtype=torch.int64)
    blocks = torch.as_tensor(list(block_ids), dtype=torch.int64)
    return blocks[positions // block_size] * block_size + positions % block_size


def checkpoint_slots(layout: KVLayout, slot_ids: torch.Tensor) -> torch.Tensor:
    """The token records of ``slot_ids`` on the CPU (``[n, record_bytes]`` uint8)."""
    records = gather_tokens(layout, slot_ids)
    if records.device.type != "cpu":
        torch.cuda.synchronize(records.device)
        records = records.cpu()
    return records


def restore_slots(layout: KVLayout, slot_ids: torch.Tensor, records: torch.Tensor) -> None:
    """Scatter CPU ``records`` into ``slot_ids`` of ``layout`` (and wait for a CUDA layout)."""
    if layout.device.type == "cuda":
        scatter_tokens(layout, slot_ids, records.to(layout.device))
        torch.cuda.synchronize(layout.device)
    else:
        scatter_tokens(layout, slot_ids, records)


def _row_bytes(view: torch.Tensor, slot: int, block_size: int) -> torch.Tensor:
    return view[slot // block_size, slot % block_size].contiguous().view(torch.uint8).reshape(-1).cpu()


def assert_kv_equal(
    layout_a: KVLayout, slots_a: torch.Tensor, layout_b: KVLayout, slots_b: torch.Tensor
) -> None:
    """Assert that the KV of ``slots_a`` in ``layout_a`` equals that of ``slots_b`` in
    ``layout_b`` bit for bit, plane by plane (block sizes may differ). Raises AssertionError
    naming the first differing token and plane."""
    if layout_a.fingerprint() != layout_b.fingerprint():
        raise AssertionError(f"layouts differ in record format: {layout_a!r} vs {layout_b!r}")
    if slots_a.numel() != slots_b.numel():
        raise AssertionError(f"token counts differ: {slots_a.numel()} vs {slots_b.numel()}")
    for t, (slot_a, slot_b) in enumerate(zip(slots_a.tolist(), slots_b.tolist())):
        for view_a, view_b, plane in zip(layout_a.views, layout_b.views, layout_a.planes):
            row_a = _row_bytes(view_a, slot_a, layout_a.block_size)
            row_b = _row_bytes(view_b, slot_b, layout_b.block_size)
            if not torch.equal(row_a, row_b):
                first = int((row_a != row_b).nonzero()[0])
                raise AssertionError(
                    f"token {t} (slot {slot_a} vs {slot_b}), plane {plane.name}: rows differ first "
                    f"at byte {first}"
                )


def wait_until(predicate: Callable[[], object], timeout_s: float = 10.0, poll_s: float = 0.02) -> bool:
    """Poll ``predicate`` every ``poll_s`` seconds until it is true (True) or ``timeout_s``
    has passed (False): how a test waits, bounded, for what another thread or process does."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(poll_s)
    return True
