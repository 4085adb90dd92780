"""The transport's own argument checks, built on ``lumen_core._validate``: a deadline's range,
an array's dtype and layout, a checkpoint key's u64/u32 fields."""

from __future__ import annotations

import numpy as np

from lumen_core._validate import U32_MAX, U64_MAX, check_int, check_number

# The longest deadline a call takes (about 11.6 days; kMaxTimeoutS in lumen/transport/worker.h).
# Deadlines are finite: inf and values past what a steady_clock deadline holds (about 9.2e9 s)
# are refused rather than read as "no deadline".
MAX_TIMEOUT_S = 1e6


def check_timeout(timeout_s: object, name: str = "timeout_s") -> float:
    """``timeout_s`` as a float in (0, MAX_TIMEOUT_S]; ValueError for anything else (nan and inf
    included), TypeError for a non-number."""
    number = check_number(name, timeout_s)
    if not 0 < number <= MAX_TIMEOUT_S:
        raise ValueError(f"`{name}` must be in (0, {MAX_TIMEOUT_S}] seconds, got {timeout_s}")
    return number


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
