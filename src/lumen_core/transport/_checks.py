"""The transport's argument checks: every message reads "`arg` must be ..., got ..."."""

from __future__ import annotations

import numpy as np

U32_MAX = 2**32 - 1
U64_MAX = 2**64 - 1
# The longest deadline a call takes (about 11.6 days; kMaxTimeoutS in lumen/transport/worker.h).
# Deadlines are finite: inf and values past what a steady_clock deadline holds (about 9.2e9 s)
# are refused rather than read as "no deadline".
MAX_TIMEOUT_S = 1e6


def check_int(name: str, value: object, low: int, high: int) -> int:
    """``value`` as an int in [low, high]; TypeError for a non-int (bools included), else
    ValueError."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if not low <= int(value) <= high:
        raise ValueError(f"{name} must be in [{low}, {high}], got {value}")
    return int(value)


def check_bytes(name: str, value: object, size: int | None = None) -> bytes:
    """``value`` as bytes (of exactly ``size`` bytes when given)."""
    if not isinstance(value, (bytes, bytearray)):
        raise TypeError(f"{name} must be bytes, got {type(value).__name__}")
    if size is not None and len(value) != size:
        raise ValueError(f"{name} must be {size} bytes, got {len(value)}")
    return bytes(value)


def check_timeout(timeout_s: object, name: str = "timeout_s") -> float:
    """``timeout_s`` as a float in (0, MAX_TIMEOUT_S]; ValueError for anything else (nan and inf
    included), TypeError for a non-number."""
    if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)):
        raise TypeError(f"{name} must be a number, got {type(timeout_s).__name__}")
    if not 0 < timeout_s <= MAX_TIMEOUT_S:
        raise ValueError(f"{name} must be in (0, {MAX_TIMEOUT_S}] seconds, got {timeout_s}")
    return float(timeout_s)


def check_array(name: str, value: object, dtype: type, ndim: int) -> np.ndarray:
    """``value`` as a C-contiguous numpy array of ``dtype`` with ``ndim`` dimensions."""
    if not isinstance(value, np.ndarray):
        raise TypeError(f"{name} must be a numpy.ndarray, got {type(value).__name__}")
    if value.dtype != dtype:
        raise ValueError(f"{name} must have dtype {np.dtype(dtype)}, got {value.dtype}")
    if value.ndim != ndim:
        raise ValueError(f"{name} must have {ndim} dimension(s), got {value.ndim}")
    if not value.flags.c_contiguous:
        raise ValueError(f"{name} must be C-contiguous, got a strided array")
    return value


def check_key(request_id: object, shard: object, epoch: object) -> tuple[int, int, int]:
    """A checkpoint's (request_id u64, shard u32, epoch u32)."""
    return (
        check_int("request_id", request_id, 0, U64_MAX),
        check_int("shard", shard, 0, U32_MAX),
        check_int("epoch", epoch, 0, U32_MAX),
    )
