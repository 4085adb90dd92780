"""StagingPool: a bounded set of reusable, page-aligned host buffers for token records.

Gathers write records into a buffer acquired here; the sender releases it when the bytes are
on the wire. The pool never grows: when every buffer is held, ``acquire`` waits (up to a
timeout) so that a slow consumer shows up as back-pressure instead of unbounded memory.
With CUDA present the buffers are pinned (page-locked and mapped), so device copies into them
run at full PCIe speed and the CUDA gather can write them directly.
"""

from __future__ import annotations

import contextlib
import mmap
from collections.abc import Iterator

import torch

from lumen_core import _native
from lumen_core._validate import check_int

__all__ = ["StagingPool"]

_CUDA_HOST_REGISTER_PORTABLE_MAPPED = 0x01 | 0x02  # cudaHostRegisterPortable | cudaHostRegisterMapped
_MAX_ARENA_BYTES = 2**63 - 1  # the native pool's sizes are int64
_FOREVER_S = 1e9  # waits this long or longer never end (StagingPool::kForeverS)


class StagingPool:
    """``num_buffers`` host buffers of ``buffer_bytes`` each, page-aligned, handed out as
    ``[buffer_bytes]`` uint8 CPU tensors.

    Args:
        num_buffers: how many buffers (the bound).
        buffer_bytes: bytes per buffer (each starts on a page boundary).
        pinned: page-lock the buffers with CUDA; default: when a CUDA device is present.

    Raises:
        TypeError: a size is not an int.
        ValueError: a size < 1, or the buffers (each rounded up to whole pages) would take
            more than 2**63 - 1 bytes; ``pinned=True`` without a CUDA device.
        RuntimeError: the memory cannot be mapped or pinned.
    """

    def __init__(self, num_buffers: int, buffer_bytes: int, *, pinned: bool | None = None):
        num_buffers = check_int("num_buffers", num_buffers, low=1)
        buffer_bytes = check_int("buffer_bytes", buffer_bytes, low=1)
        stride = -(-buffer_bytes // mmap.PAGESIZE) * mmap.PAGESIZE
        if num_buffers * stride > _MAX_ARENA_BYTES:
            raise ValueError(
                f"`num_buffers` x `buffer_bytes` must be at most {_MAX_ARENA_BYTES} bytes in whole pages, "
                f"got {num_buffers} x {buffer_bytes}"
            )
        if pinned is None:
            pinned = _native.HAS_CUDA
        if pinned and not _native.HAS_CUDA:
            raise ValueError("`pinned` must be False or None without a CUDA device, got True")
        self._native = _native.require_cpu().StagingPool(num_buffers, buffer_bytes)
        self._arena = torch.from_numpy(self._native.arena())
        self._pinned = False
        if pinned:
            status = torch.cuda.cudart().cudaHostRegister(  # type: ignore[no-untyped-call]
                self._arena.data_ptr(), self._arena.numel(), _CUDA_HOST_REGISTER_PORTABLE_MAPPED
            )
            if int(status) != 0:
                raise RuntimeError(f"cudaHostRegister of {self._arena.numel()} bytes failed: {status}")
            self._pinned = True
        stride = self._native.stride_bytes
        self._buffers = [self._arena[i * stride : i * stride + buffer_bytes] for i in range(num_buffers)]
        self._index_of = {buf.data_ptr(): i for i, buf in enumerate(self._buffers)}

    @property
    def num_buffers(self) -> int:
        return int(self._native.num_buffers)

    @property
    def buffer_bytes(self) -> int:
        return int(self._native.buffer_bytes)

    @property
    def num_free(self) -> int:
        return int(self._native.num_free)

    @property
    def pinned(self) -> bool:
        return self._pinned

    def acquire(self, timeout_s: float | None = None) -> torch.Tensor | None:
        """A free buffer (``[buffer_bytes]`` uint8, CPU), waiting up to ``timeout_s`` seconds
        (``None``, ``inf`` or 1e9 and more: forever; ``0``: do not wait). Returns ``None`` if
        none became free. The GIL is released while waiting.

        Raises:
            TypeError: ``timeout_s`` is not a number.
            ValueError: ``timeout_s < 0`` or nan.
        """
        if timeout_s is None:
            wait_s = -1.0
        else:
            if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)):
                raise TypeError(f"`timeout_s` must be a number or None, got {type(timeout_s).__name__}")
            if not timeout_s >= 0:  # nan too
                raise ValueError(f"`timeout_s` must be >= 0 or None, got {timeout_s}")
            wait_s = -1.0 if timeout_s >= _FOREVER_S else float(timeout_s)
        index = self._native.acquire(wait_s)
        return None if index < 0 else self._buffers[index]

    def release(self, buf: torch.Tensor) -> None:
        """Return a buffer obtained from ``acquire``.

        Raises:
            TypeError: ``buf`` is not a tensor.
            ValueError: ``buf`` is not a buffer of this pool, or is not held (double release).
        """
        if not isinstance(buf, torch.Tensor):
            raise TypeError(f"`buf` must be a torch.Tensor, got {type(buf).__name__}")
        index = self._index_of.get(buf.data_ptr())
        if index is None or buf.numel() != self.buffer_bytes:
            raise ValueError(f"`buf` must be a buffer of this pool, got a tensor at {buf.data_ptr():#x}")
        try:
            self._native.release(index)
        except ValueError as exc:
            raise ValueError(f"`buf` must be held, got buffer {index} which is already free") from exc

    @contextlib.contextmanager
    def borrow(self, timeout_s: float | None = None) -> Iterator[torch.Tensor]:
        """``with pool.borrow() as buf:`` acquires a buffer and releases it on exit, also on
        an exception.

        Raises:
            TimeoutError: no buffer became free within ``timeout_s``.
            TypeError, ValueError: as ``acquire``.
        """
        buf = self.acquire(timeout_s)
        if buf is None:
            raise TimeoutError(f"no staging buffer became free within {timeout_s} s")
        try:
            yield buf
        finally:
            self.release(buf)

    def close(self) -> None:
        """Unpin the buffers (the memory itself lives while any tensor views it)."""
        if self._pinned:
            torch.cuda.cudart().cudaHostUnregister(self._arena.data_ptr())  # type: ignore[no-untyped-call]
            self._pinned = False

    def __del__(self) -> None:
        if getattr(self, "_pinned", False):
            self.close()

    def __repr__(self) -> str:
        return (
            f"StagingPool(num_buffers={self.num_buffers}, buffer_bytes={self.buffer_bytes}, "
            f"num_free={self.num_free}, pinned={self._pinned})"
        )
