"""Page allocation for the paged KV cache: plain Python, check/commit pairs, no tensors."""

from __future__ import annotations

from collections import deque

from lumen_core.engine.request import Request


class BlockManager:
    """Hands out fixed-size pages (blocks) of ``block_size`` token slots.

    ``can_allocate`` checks and ``allocate`` commits; ``allocate`` without room raises
    RuntimeError (a scheduler bug, never user input). A request's pages are in
    ``request.block_ids``, which this class mutates.
    """

    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError(f"`num_blocks` and `block_size` must be > 0, got {num_blocks} and {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free_block_ids: deque[int] = deque(range(num_blocks))

    @property
    def num_free_blocks(self) -> int:
        return len(self._free_block_ids)

    def num_blocks_for(self, num_tokens: int) -> int:
        """Pages needed to hold ``num_tokens`` tokens."""
        return -(-num_tokens // self.block_size)

    def num_missing_blocks(self, request: Request, num_tokens: int) -> int:
        """Pages ``request`` lacks to hold its first ``num_tokens`` tokens."""
        return max(0, self.num_blocks_for(num_tokens) - len(request.block_ids))

    def can_allocate(self, request: Request, num_tokens: int) -> bool:
        """Whether ``request`` can grow to hold ``num_tokens`` tokens."""
        return self.num_missing_blocks(request, num_tokens) <= len(self._free_block_ids)

    def allocate(self, request: Request, num_tokens: int) -> None:
        """Grow ``request.block_ids`` to hold ``num_tokens`` tokens."""
        missing = self.num_missing_blocks(request, num_tokens)
        if missing > len(self._free_block_ids):
            raise RuntimeError(
                f"allocate({request.request_id!r}, {num_tokens}) needs {missing} blocks, "
                f"{len(self._free_block_ids)} free: call can_allocate first"
            )
        request.block_ids.extend(self._free_block_ids.popleft() for _ in range(missing))

    def truncate(self, request: Request, num_tokens: int) -> None:
        """Free the pages of ``request`` past those holding its first ``num_tokens`` tokens."""
        keep = self.num_blocks_for(num_tokens)
        self._free_block_ids.extend(request.block_ids[keep:])
        del request.block_ids[keep:]

    def free(self, request: Request) -> None:
        """Return all pages of ``request``."""
        self.truncate(request, 0)

    def slot_ids(self, request: Request, start: int, end: int) -> list[int]:
        """Slots of token positions ``[start, end)`` of ``request`` (its pages must hold them)."""
        bs = self.block_size
        if end > len(request.block_ids) * bs or start < 0:
            raise IndexError(
                f"positions [{start}, {end}) of {request.request_id!r} are outside its "
                f"{len(request.block_ids)} blocks"
            )
        return [request.block_ids[p // bs] * bs + p % bs for p in range(start, end)]
