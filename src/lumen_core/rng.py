"""The package's one counter-based random generator: Philox4x32-10 keyed by (seed, position).

A uniform depends only on ``(seed, position, index)``, never on batch composition, thread
count or which worker draws it, so the engine's sampler and ``verify_draft`` give the same
result wherever they run. This numpy version is the reference; ``csrc/include/lumen/philox.h``
is the native one and must match it bit for bit.

Mapping: counter = (position lo, position hi, index, 0), key = (seed lo, seed hi); the first
two output words give a 53-bit double in [0, 1): ``((x0 >> 5) * 2**26 + (x1 >> 6)) / 2**53``.
``index`` separates the draws made at one position (e.g. 0 = accept test, 1 = resample).
"""

from __future__ import annotations

from typing import cast

import numpy as np
import numpy.typing as npt

_M0 = np.uint64(0xD2511F53)
_M1 = np.uint64(0xCD9E8D57)
_W0 = np.uint32(0x9E3779B9)
_W1 = np.uint32(0xBB67AE85)
_MASK32 = np.uint64(0xFFFFFFFF)
_ROUNDS = 10


def philox4x32(counter: np.ndarray, key: np.ndarray) -> np.ndarray:
    """Philox4x32-10 of ``counter`` ``[..., 4]`` uint32 under ``key`` ``[..., 2]`` uint32.

    Returns ``[..., 4]`` uint32. Shapes broadcast.
    """
    c = np.asarray(counter, dtype=np.uint32)
    k = np.asarray(key, dtype=np.uint32)
    c, k0 = np.broadcast_arrays(c, k[..., :1])
    k1 = np.broadcast_to(k[..., 1:2], k0.shape)
    c0, c1, c2, c3 = (c[..., i].astype(np.uint64) for i in range(4))
    k0 = k0[..., 0].astype(np.uint32)
    k1 = k1[..., 0].astype(np.uint32)
    with np.errstate(over="ignore"):
        for r in range(_ROUNDS):
            p0 = _M0 * c0
            p1 = _M1 * c2
            hi0, lo0 = p0 >> np.uint64(32), p0 & _MASK32
            hi1, lo1 = p1 >> np.uint64(32), p1 & _MASK32
            c0 = hi1 ^ c1 ^ k0.astype(np.uint64)
            c1 = lo1
            c2 = hi0 ^ c3 ^ k1.astype(np.uint64)
            c3 = lo0
            if r < _ROUNDS - 1:
                k0 = k0 + _W0
                k1 = k1 + _W1
    return np.stack([c0, c1, c2, c3], axis=-1).astype(np.uint32)


def uniforms(seeds: npt.ArrayLike, positions: npt.ArrayLike, index: int = 0) -> np.ndarray:
    """Uniform doubles in [0, 1) for each ``(seed, position)`` pair (broadcast), draw ``index``.

    ``seeds``: uint64-compatible array; ``positions``: non-negative int array; returns float64
    of the broadcast shape. Raises ValueError on negative positions or index outside [0, 2**32).
    """
    seeds = np.asarray(seeds).astype(np.uint64)
    positions = np.asarray(positions)
    if positions.size and int(positions.min()) < 0:
        raise ValueError(f"`positions` must be >= 0, got min {int(positions.min())}")
    if not 0 <= index < 2**32:
        raise ValueError(f"`index` must be in [0, 2**32), got {index}")
    seeds, positions = np.broadcast_arrays(seeds, positions.astype(np.uint64))
    counter = np.stack(
        [
            positions & _MASK32,
            positions >> np.uint64(32),
            np.full(positions.shape, index, dtype=np.uint64),
            np.zeros(positions.shape, dtype=np.uint64),
        ],
        axis=-1,
    ).astype(np.uint32)
    key = np.stack([seeds & _MASK32, seeds >> np.uint64(32)], axis=-1).astype(np.uint32)
    out = philox4x32(counter, key).astype(np.uint64)
    hi = (out[..., 0] >> np.uint64(5)).astype(np.float64)
    lo = (out[..., 1] >> np.uint64(6)).astype(np.float64)
    # numpy's stubs type arithmetic on an ndarray of unknown dtype as Any.
    return cast(np.ndarray, (hi * 67108864.0 + lo) / 9007199254740992.0)
