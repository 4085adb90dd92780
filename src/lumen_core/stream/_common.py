"""Shared checks and encodings of the stream package."""

from __future__ import annotations

import hashlib

import numpy as np
import torch

from lumen_core.layouts import KVLayout


def check_str(name: str, value: object) -> str:
    """``value`` itself; TypeError unless it is a non-empty str (request ids, fingerprints)."""
    if not isinstance(value, str) or not value:
        raise TypeError(f"`{name}` must be a non-empty str, got {value!r}")
    return value


def fingerprint_bytes(layout: KVLayout, model_fingerprint: str) -> bytes:
    """The 64 bytes a checkpoint names its origin by on the wire: SHA-256 of the layout's
    fingerprint, then SHA-256 of the model's."""
    return (
        hashlib.sha256(layout.fingerprint().encode()).digest()
        + hashlib.sha256(model_fingerprint.encode()).digest()
    )


def request_key(request_id: str) -> int:
    """The u64 a string request id is keyed by on the wire (first 8 bytes of its SHA-256)."""
    return int.from_bytes(hashlib.sha256(check_str("request_id", request_id).encode()).digest()[:8], "little")


def as_array(name: str, value: object, dtype: type) -> np.ndarray:
    """A 1-d C-contiguous numpy array of dtype from a sequence, numpy array or CPU tensor."""
    if isinstance(value, torch.Tensor):
        if value.device.type != "cpu":
            raise ValueError(f"{name} must be on the CPU, got device {value.device}")
        value = value.numpy()
    if isinstance(value, (str, bytes)) or not hasattr(value, "__len__"):
        raise TypeError(f"{name} must be a sequence of ints, got {type(value).__name__}")
    if isinstance(value, np.ndarray):
        array = value
        if array.size and not np.issubdtype(array.dtype, np.integer):
            raise TypeError(f"{name} must hold ints, got dtype {array.dtype}")
    else:
        array = np.asarray(value, dtype=object)
        if any(isinstance(v, bool) or not isinstance(v, (int, np.integer)) for v in array.flat):
            raise TypeError(f"{name} must hold ints, got {value!r}")
    if array.ndim != 1:
        raise ValueError(f"{name} must have 1 dimension, got {array.ndim}")
    info = np.iinfo(dtype)
    if array.size and (int(array.min()) < info.min or int(array.max()) > info.max):
        raise ValueError(f"{name} must be in [{info.min}, {info.max}], got values outside")
    return np.ascontiguousarray(array, dtype=dtype)
