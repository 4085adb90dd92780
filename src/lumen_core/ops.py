"""Data-plane ops on token records: validation in Python, then one native call.

Records are ``[n, record_bytes]`` uint8 tensors (DESIGN.md section 3.1). Every argument is
checked here before a pointer reaches native code; the native side re-checks cheap invariants.
"""

from __future__ import annotations

import os

import torch

from lumen_core import _native


def _num_threads(num_threads: int | None) -> int:
    """The thread count of a CPU op: all cores by default."""
    if num_threads is None:
        return max(1, os.cpu_count() or 1)
    if isinstance(num_threads, bool) or not isinstance(num_threads, int):
        raise TypeError(f"`num_threads` must be an int or None, got {type(num_threads).__name__}")
    if num_threads < 1:
        raise ValueError(f"`num_threads` must be >= 1, got {num_threads}")
    return num_threads


def _check_records_tensor(records: object, name: str) -> torch.Tensor:
    """A 2-D, C-contiguous uint8 tensor, or TypeError/ValueError."""
    if not isinstance(records, torch.Tensor):
        raise TypeError(f"`{name}` must be a torch.Tensor, got {type(records).__name__}")
    if records.dtype != torch.uint8:
        raise ValueError(f"`{name}` must have dtype torch.uint8, got {records.dtype}")
    if records.dim() != 2:
        raise ValueError(f"`{name}` must be 2-D [n, record_bytes], got shape {tuple(records.shape)}")
    if not records.is_contiguous():
        raise ValueError(f"`{name}` must be C-contiguous, got strides {records.stride()}")
    return records


def checksum(records: torch.Tensor, *, num_threads: int | None = None) -> torch.Tensor:
    """CRC-32C (Castagnoli) of each token record.

    Args:
        records: ``[n, record_bytes]`` uint8, C-contiguous, on the CPU. Not modified.
        num_threads: CPU threads to use; default all cores.

    Returns:
        ``[n]`` torch.uint32 on the CPU: the standard CRC-32C of each row
        (``crc32c(b"123456789") == 0xE3069283``).

    Raises:
        TypeError: ``records`` is not a tensor, ``num_threads`` not an int.
        ValueError: wrong dtype, rank, contiguity or device; ``num_threads < 1``.
    """
    records = _check_records_tensor(records, "records")
    if records.device.type != "cpu":
        raise ValueError(f"`records` must be on the CPU, got device {records.device}")
    threads = _num_threads(num_threads)
    num_records, record_bytes = records.shape
    out = torch.empty(num_records, dtype=torch.uint32)
    if num_records == 0:
        return out
    _native.require_cpu().checksum_records(
        out.data_ptr(), records.data_ptr(), num_records, record_bytes, threads
    )
    return out
