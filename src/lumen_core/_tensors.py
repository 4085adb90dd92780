"""Tensor helpers of the op modules (``ops`` for records, ``verify`` for draft verification)."""

from __future__ import annotations

import os

import torch

from lumen_core._validate import check_instance, check_int


def check_tensor(name: str, value: object) -> torch.Tensor:
    """``value`` itself; TypeError unless it is a torch.Tensor."""
    return check_instance(name, value, torch.Tensor, "a torch.Tensor")


def check_num_threads(num_threads: object, default: int | None = None) -> int:
    """The thread count of a CPU op: ``num_threads``, or ``default`` (all cores when None) for
    None. Raises TypeError for a non-int, ValueError below 1."""
    if num_threads is None:
        return default if default is not None else max(1, os.cpu_count() or 1)
    return check_int("num_threads", num_threads, low=1)


def to_device(x: torch.Tensor, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """``x`` as a contiguous ``dtype`` tensor on ``device`` (a CUDA device: call under the op's
    stream). A CPU tensor goes up through pinned memory with an asynchronous copy, so the call
    does not wait for the work already queued on the stream, as a pageable copy would."""
    x = x.detach().to(dtype=dtype).contiguous()
    if device.type == "cuda" and x.device.type == "cpu":
        return x.pin_memory().to(device, non_blocking=True)
    return x.to(device)
