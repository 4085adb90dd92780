"""Data-plane ops on token records: validation in Python, then one native call.

Records are ``[n, record_bytes]`` uint8 tensors (DESIGN.md section 3.1). Every argument is
checked here before a pointer reaches native code; the native side re-checks cheap invariants.
"""

from __future__ import annotations

import os
from typing import Literal

import torch

from lumen_core import _native
from lumen_core.layouts import KVLayout

RecordMode = Literal["device", "mapped", "staged"]
_RECORD_MODES = ("device", "mapped", "staged")


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


def _check_layout(layout: object) -> KVLayout:
    if not isinstance(layout, KVLayout):
        raise TypeError(f"`layout` must be a KVLayout, got {type(layout).__name__}")
    return layout


def _check_slot_ids(slot_ids: object, layout: KVLayout, *, unique: bool) -> torch.Tensor:
    """The ids, validated (convert them with _as_index)."""
    if not isinstance(slot_ids, torch.Tensor):
        raise TypeError(f"`slot_ids` must be a torch.Tensor, got {type(slot_ids).__name__}")
    if slot_ids.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"`slot_ids` must have dtype torch.int32 or torch.int64, got {slot_ids.dtype}")
    if slot_ids.dim() != 1:
        raise ValueError(f"`slot_ids` must be 1-D, got shape {tuple(slot_ids.shape)}")
    if slot_ids.device.type != "cpu" and slot_ids.device != layout.device:
        where = "the CPU" if layout.device.type == "cpu" else f"the CPU or {layout.device}"
        raise ValueError(f"`slot_ids` must be on {where}, got {slot_ids.device}")
    if slot_ids.numel() > 0:
        low, high = int(slot_ids.min()), int(slot_ids.max())
        if low < 0 or high >= layout.num_slots:
            bad = low if low < 0 else high
            raise IndexError(f"`slot_ids` must lie in [0, {layout.num_slots}), got {bad}")
        if unique:
            repeats = slot_ids.numel() - torch.unique(slot_ids).numel()
            if repeats:
                raise ValueError(f"`slot_ids` must not repeat in a scatter, got {repeats} repeated ids")
    return slot_ids


def _as_index(slot_ids: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Contiguous int64 ids on ``device`` (on a CUDA device: call under the op's stream)."""
    return slot_ids.to(device=device, dtype=torch.int64).contiguous()


def _check_records_shape(records: torch.Tensor, name: str, num_tokens: int, layout: KVLayout) -> None:
    expected = (num_tokens, layout.record_bytes)
    if tuple(records.shape) != expected:
        raise ValueError(f"`{name}` must have shape (n, record_bytes) = {expected}, got {tuple(records.shape)}")


def _check_mode(mode: object, layout: KVLayout, records: torch.Tensor | None) -> RecordMode | None:
    """The CUDA record placement; None for CPU layouts."""
    if layout.device.type == "cpu":
        if mode is not None:
            raise ValueError(f"`mode` must be None for a CPU layout, got {mode!r}")
        return None
    if mode is None:
        return "staged" if records is not None and records.device.type == "cpu" else "device"
    if mode not in _RECORD_MODES:
        raise ValueError(f"`mode` must be one of {_RECORD_MODES}, got {mode!r}")
    return mode  # type: ignore[return-value]


def _check_stream(stream: object, layout: KVLayout) -> None:
    if stream is None:
        return
    if layout.device.type == "cpu":
        raise ValueError(f"`stream` must be None for a CPU layout, got {type(stream).__name__}")
    if not isinstance(stream, torch.cuda.Stream):
        raise TypeError(f"`stream` must be a torch.cuda.Stream or None, got {type(stream).__name__}")
    if stream.device != layout.device:
        raise ValueError(f"`stream` must belong to {layout.device}, got a stream of {stream.device}")


def _check_records_device(records: torch.Tensor, name: str, layout: KVLayout, mode: RecordMode | None) -> None:
    if mode is None or mode == "device":
        if records.device != layout.device:
            raise ValueError(f"`{name}` must be on {layout.device}, got {records.device}")
    elif records.numel() > 0:  # an empty tensor has no storage to pin; nothing is copied
        if records.device.type != "cpu" or not records.is_pinned():
            raise ValueError(f"`{name}` must be pinned CPU memory for mode {mode!r}, got {records.device} "
                             f"(pinned={records.device.type == 'cpu' and records.is_pinned()})")


def _cuda_move(direction: str, layout: KVLayout, ids: torch.Tensor, records: torch.Tensor, mode: RecordMode,
               stream: torch.cuda.Stream | None) -> None:
    cuda = _native.require_cuda()
    stream = torch.cuda.current_stream(layout.device) if stream is None else stream
    placement = {"device": cuda.RecordPlacement.device, "mapped": cuda.RecordPlacement.mapped_host,
                 "staged": cuda.RecordPlacement.staged_host}[mode]
    # The launch goes to the layout's device. Temporaries are allocated under `stream`, so the
    # caching allocator does not hand their memory to other work before this stream's kernel
    # and copies are done with it.
    with torch.cuda.device(layout.device), torch.cuda.stream(stream):
        ids = _as_index(ids, layout.device)
        staging = torch.empty_like(records, device=layout.device) if mode == "staged" else None
        move = cuda.gather_tokens if direction == "gather" else cuda.scatter_tokens
        move(records.data_ptr(), layout.descriptors().data_ptr(), layout.device_descriptors().data_ptr(),
             layout.num_planes, layout.record_bytes, ids.data_ptr(), ids.numel(), placement,
             0 if staging is None else staging.data_ptr(), stream.cuda_stream)


def gather_tokens(
    layout: KVLayout,
    slot_ids: torch.Tensor,
    out: torch.Tensor | None = None,
    *,
    num_threads: int | None = None,
    mode: RecordMode | None = None,
    stream: torch.cuda.Stream | None = None,
) -> torch.Tensor:
    """Copy the rows of ``slot_ids`` from every plane of ``layout`` into token records.

    Args:
        layout: the KV cache (not modified).
        slot_ids: ``[n]`` int32/int64 slots (``block_id * block_size + offset``), on the CPU or
            on the layout's device; repeats are allowed.
        out: optional ``[n, record_bytes]`` uint8, C-contiguous; written in place.
        num_threads: CPU layouts: threads to use (default all cores).
        mode: CUDA layouts only: ``"device"`` (records in device memory; default without a
            CPU ``out``), ``"mapped"`` (the kernel writes pinned host memory directly) or
            ``"staged"`` (device staging + ``cudaMemcpyAsync`` into pinned host memory;
            default for a CPU ``out``). CUDA work is asynchronous on ``stream`` (default: the
            current stream): synchronise before reading host records.
        stream: CUDA layouts only: the stream to run on.

    Returns:
        ``out`` or a new ``[n, record_bytes]`` uint8 tensor: row ``t`` is the record of
        ``slot_ids[t]`` (plane ``i`` at ``layout.planes[i].record_offset``).

    Raises:
        TypeError: ``layout`` is not a KVLayout, ``slot_ids``/``out`` not tensors, ``stream``
            not a ``torch.cuda.Stream``.
        ValueError: wrong dtype, rank, shape, contiguity or device of ``slot_ids``/``out``;
            ``out`` not pinned for a host mode; an unknown ``mode``; ``mode``/``stream`` given
            for a CPU layout or a stream of another device.
        IndexError: a slot outside ``[0, layout.num_slots)``.
    """
    layout = _check_layout(layout)
    threads = _num_threads(num_threads)
    ids = _check_slot_ids(slot_ids, layout, unique=False)
    if out is not None:
        _check_records_tensor(out, "out")
        _check_records_shape(out, "out", ids.numel(), layout)
    record_mode = _check_mode(mode, layout, out)
    _check_stream(stream, layout)
    if out is None:
        shape = (ids.numel(), layout.record_bytes)
        if record_mode in ("mapped", "staged"):
            out = torch.empty(shape, dtype=torch.uint8, pin_memory=True)
        else:
            out = torch.empty(shape, dtype=torch.uint8, device=layout.device)
    _check_records_device(out, "out", layout, record_mode)
    if ids.numel() == 0:
        return out
    if record_mode is None:
        ids = _as_index(ids, layout.device)
        _native.require_cpu().gather_tokens(
            out.data_ptr(), layout.descriptors().data_ptr(), layout.num_planes, layout.record_bytes,
            ids.data_ptr(), ids.numel(), threads,
        )
    else:
        _cuda_move("gather", layout, ids, out, record_mode, stream)
    return out


def scatter_tokens(
    layout: KVLayout,
    slot_ids: torch.Tensor,
    records: torch.Tensor,
    *,
    num_threads: int | None = None,
    mode: RecordMode | None = None,
    stream: torch.cuda.Stream | None = None,
) -> None:
    """Write token records back into the rows of ``slot_ids``; the inverse of gather_tokens.

    Args:
        layout: the KV cache; only the rows of ``slot_ids`` are modified, in every plane.
        slot_ids: ``[n]`` int32/int64 distinct slots, on the CPU or the layout's device.
        records: ``[n, record_bytes]`` uint8, C-contiguous (not modified). For a CUDA layout:
            device memory, or pinned host memory read by the kernel (``mode="mapped"``) or
            copied to device staging first (``"staged"``, the default for CPU records).
        num_threads, mode, stream: as in gather_tokens.

    Raises:
        TypeError: ``layout`` is not a KVLayout, ``slot_ids``/``records`` not tensors, ``stream``
            not a ``torch.cuda.Stream``.
        ValueError: wrong dtype, rank, shape, contiguity or device; repeated slot ids; as in
            gather_tokens for ``mode`` and ``stream``.
        IndexError: a slot outside ``[0, layout.num_slots)``.
    """
    layout = _check_layout(layout)
    threads = _num_threads(num_threads)
    ids = _check_slot_ids(slot_ids, layout, unique=True)
    _check_records_tensor(records, "records")
    _check_records_shape(records, "records", ids.numel(), layout)
    record_mode = _check_mode(mode, layout, records)
    _check_stream(stream, layout)
    _check_records_device(records, "records", layout, record_mode)
    if ids.numel() == 0:
        return
    if record_mode is None:
        ids = _as_index(ids, layout.device)
        _native.require_cpu().scatter_tokens(
            records.data_ptr(), layout.descriptors().data_ptr(), layout.num_planes, layout.record_bytes,
            ids.data_ptr(), ids.numel(), threads,
        )
    else:
        _cuda_move("scatter", layout, ids, records, record_mode, stream)
