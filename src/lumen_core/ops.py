"""Data-plane ops on token records: gather, scatter and checksum (``csrc/gather.*``,
``csrc/checksum.*``). Validation in Python, then one native call.

Records are ``[n, record_bytes]`` uint8 tensors (docs/data_plane.md). Every argument is
checked here before a pointer reaches native code; the native side re-checks cheap invariants.
Draft verification, the other op family, lives in ``lumen_core.verify``.
"""

from __future__ import annotations

from typing import Literal

import torch

from lumen_core import _native
from lumen_core._tensors import check_num_threads, check_tensor, to_device
from lumen_core._validate import check_bool, check_instance
from lumen_core.layouts import KVLayout

RecordMode = Literal["device", "mapped", "staged"]
_RECORD_MODES = ("device", "mapped", "staged")


def _check_records_tensor(records: object, name: str) -> torch.Tensor:
    """A 2-D, C-contiguous uint8 tensor, or TypeError/ValueError."""
    records = check_tensor(name, records)
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
    threads = check_num_threads(num_threads)
    num_records, record_bytes = records.shape
    out = torch.empty(num_records, dtype=torch.uint32)
    if num_records == 0:
        return out
    _native.require_cpu().checksum_records(
        out.data_ptr(), records.data_ptr(), num_records, record_bytes, threads
    )
    return out


def _check_slot_ids(slot_ids: object, layout: KVLayout, *, unique: bool, check_slots: object) -> torch.Tensor:
    """The ids, validated (convert them with _as_index). The values of ids on a CUDA device are
    checked only when ``check_slots`` (that costs a device synchronisation)."""
    check_bool("check_slots", check_slots)
    slot_ids = check_tensor("slot_ids", slot_ids)
    if slot_ids.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"`slot_ids` must have dtype torch.int32 or torch.int64, got {slot_ids.dtype}")
    if slot_ids.dim() != 1:
        raise ValueError(f"`slot_ids` must be 1-D, got shape {tuple(slot_ids.shape)}")
    if slot_ids.device.type != "cpu" and slot_ids.device != layout.device:
        where = "the CPU" if layout.device.type == "cpu" else f"the CPU or {layout.device}"
        raise ValueError(f"`slot_ids` must be on {where}, got {slot_ids.device}")
    if slot_ids.numel() > 0 and (check_slots or slot_ids.device.type == "cpu"):
        low, high = torch.stack(torch.aminmax(slot_ids)).tolist()  # one device sync, not two
        if low < 0 or high >= layout.num_slots:
            bad = low if low < 0 else high
            raise IndexError(f"`slot_ids` must lie in [0, {layout.num_slots}), got {bad}")
        if unique:
            repeats = slot_ids.numel() - torch.unique(slot_ids).numel()
            if repeats:
                raise ValueError(f"`slot_ids` must not repeat in a scatter, got {repeats} repeated ids")
    return slot_ids


def _as_index(slot_ids: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Contiguous int64 ids on ``device`` (see to_device)."""
    return to_device(slot_ids, device, torch.int64)


def _check_records_shape(records: torch.Tensor, name: str, num_tokens: int, layout: KVLayout) -> None:
    expected = (num_tokens, layout.record_bytes)
    if tuple(records.shape) != expected:
        raise ValueError(
            f"`{name}` must have shape (n, record_bytes) = {expected}, got {tuple(records.shape)}"
        )


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


def _check_records_device(
    records: torch.Tensor, name: str, layout: KVLayout, mode: RecordMode | None
) -> None:
    if mode is None or mode == "device":
        if records.device != layout.device:
            raise ValueError(f"`{name}` must be on {layout.device}, got {records.device}")
    # An empty tensor has no storage to pin; nothing is copied.
    elif records.numel() > 0 and (records.device.type != "cpu" or not records.is_pinned()):
        raise ValueError(
            f"`{name}` must be pinned CPU memory for mode {mode!r}, got {records.device} "
            f"(pinned={records.device.type == 'cpu' and records.is_pinned()})"
        )


def _cuda_move(
    direction: str,
    layout: KVLayout,
    ids: torch.Tensor,
    records: torch.Tensor,
    mode: RecordMode,
    stream: torch.cuda.Stream | None,
) -> None:
    cuda = _native.require_cuda()
    stream = torch.cuda.current_stream(layout.device) if stream is None else stream
    placement = {
        "device": cuda.RecordPlacement.device,
        "mapped": cuda.RecordPlacement.mapped_host,
        "staged": cuda.RecordPlacement.staged_host,
    }[mode]
    # The launch goes to the layout's device. Temporaries are allocated under `stream`, so the
    # caching allocator does not hand their memory to other work before this stream's kernel
    # and copies are done with it.
    with torch.cuda.device(layout.device), torch.cuda.stream(stream):
        ids = _as_index(ids, layout.device)
        staging = torch.empty_like(records, device=layout.device) if mode == "staged" else None
        move = cuda.gather_tokens if direction == "gather" else cuda.scatter_tokens
        move(
            records.data_ptr(),
            layout.descriptors().data_ptr(),
            layout.device_descriptors().data_ptr(),
            layout.num_planes,
            layout.record_bytes,
            ids.data_ptr(),
            ids.numel(),
            placement,
            0 if staging is None else staging.data_ptr(),
            stream.cuda_stream,
        )


def gather_tokens(
    layout: KVLayout,
    slot_ids: torch.Tensor,
    out: torch.Tensor | None = None,
    *,
    num_threads: int | None = None,
    mode: RecordMode | None = None,
    stream: torch.cuda.Stream | None = None,
    check_slots: bool = True,
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
        check_slots: for ``slot_ids`` on a CUDA device, whether to range-check them before the
            launch, which waits for the device. ``False`` keeps the call asynchronous, for ids
            the caller derived from its own block table: the kernel still never touches memory
            outside the cache (an out-of-range id's record is zeros; a scatter skips it). Ids
            on the CPU are always checked, without waiting for the device.

    Returns:
        ``out`` or a new ``[n, record_bytes]`` uint8 tensor: row ``t`` is the record of
        ``slot_ids[t]`` (plane ``i`` at ``layout.planes[i].record_offset``).

    Raises:
        TypeError: ``layout`` is not a KVLayout, ``slot_ids``/``out`` not tensors, ``stream``
            not a ``torch.cuda.Stream``, ``check_slots`` not a bool.
        ValueError: wrong dtype, rank, shape, contiguity or device of ``slot_ids``/``out``;
            ``out`` not pinned for a host mode; an unknown ``mode``; ``mode``/``stream`` given
            for a CPU layout or a stream of another device.
        IndexError: a slot outside ``[0, layout.num_slots)``.
    """
    layout = check_instance("layout", layout, KVLayout)
    threads = check_num_threads(num_threads)
    ids = _check_slot_ids(slot_ids, layout, unique=False, check_slots=check_slots)
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
            out.data_ptr(),
            layout.descriptors().data_ptr(),
            layout.num_planes,
            layout.record_bytes,
            ids.data_ptr(),
            ids.numel(),
            threads,
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
    check_slots: bool = True,
) -> None:
    """Write token records back into the rows of ``slot_ids``; the inverse of gather_tokens.

    Args:
        layout: the KV cache; only the rows of ``slot_ids`` are modified, in every plane.
        slot_ids: ``[n]`` int32/int64 distinct slots, on the CPU or the layout's device.
        records: ``[n, record_bytes]`` uint8, C-contiguous (not modified). For a CUDA layout:
            device memory, or pinned host memory read by the kernel (``mode="mapped"``) or
            copied to device staging first (``"staged"``, the default for CPU records).
        num_threads, mode, stream: as in gather_tokens.
        check_slots: as in gather_tokens; it also covers the check for repeated ids (with
            ``False``, a repeated id's row ends up unspecified: its records' writes may
            interleave).

    Raises:
        TypeError: ``layout`` is not a KVLayout, ``slot_ids``/``records`` not tensors, ``stream``
            not a ``torch.cuda.Stream``, ``check_slots`` not a bool.
        ValueError: wrong dtype, rank, shape, contiguity or device; repeated slot ids; as in
            gather_tokens for ``mode`` and ``stream``.
        IndexError: a slot outside ``[0, layout.num_slots)``.
    """
    layout = check_instance("layout", layout, KVLayout)
    threads = check_num_threads(num_threads)
    ids = _check_slot_ids(slot_ids, layout, unique=True, check_slots=check_slots)
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
            records.data_ptr(),
            layout.descriptors().data_ptr(),
            layout.num_planes,
            layout.record_bytes,
            ids.data_ptr(),
            ids.numel(),
            threads,
        )
    else:
        _cuda_move("scatter", layout, ids, records, record_mode, stream)
