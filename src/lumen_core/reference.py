"""The slow, obvious version of every op in ops.py: the specification the native code meets."""

from __future__ import annotations

import torch

from lumen_core.layouts import KVLayout

_CRC32C_POLY = 0x82F63B78


def _crc32c_table() -> list[int]:
    table = []
    for byte in range(256):
        crc = byte
        for _ in range(8):
            crc = (crc >> 1) ^ _CRC32C_POLY if crc & 1 else crc >> 1
        table.append(crc)
    return table


_CRC32C_TABLE = _crc32c_table()


def crc32c(data: bytes, crc: int = 0) -> int:
    """CRC-32C of ``data`` continuing from ``crc``, one byte at a time."""
    crc ^= 0xFFFFFFFF
    for byte in data:
        crc = (crc >> 8) ^ _CRC32C_TABLE[(crc ^ byte) & 0xFF]
    return crc ^ 0xFFFFFFFF


def checksum(records: torch.Tensor) -> torch.Tensor:
    """``[n]`` uint32 CRC-32C of each row of ``[n, record_bytes]`` uint8 ``records``."""
    values = [crc32c(bytes(row.tolist())) for row in records.cpu()]
    return torch.tensor(values, dtype=torch.int64).to(torch.uint32)


def _row_bytes_view(view: torch.Tensor, slot: int, block_size: int) -> torch.Tensor:
    """The row of ``slot`` in a plane view ``[num_blocks, block_size, pieces, elems]`` as bytes."""
    row = view[slot // block_size, slot % block_size]  # [pieces, elems]
    return row.contiguous().view(torch.uint8).reshape(-1)


def gather_tokens(layout: KVLayout, slot_ids: torch.Tensor) -> torch.Tensor:
    """``[n, record_bytes]`` uint8 on the CPU: each slot's rows of every plane, in plane order."""
    records = torch.empty((slot_ids.numel(), layout.record_bytes), dtype=torch.uint8)
    for t, slot in enumerate(slot_ids.tolist()):
        for view, plane in zip(layout.views, layout.planes):
            row = _row_bytes_view(view, slot, layout.block_size).cpu()
            records[t, plane.record_offset : plane.record_offset + plane.row_bytes] = row
    return records


def scatter_tokens(layout: KVLayout, slot_ids: torch.Tensor, records: torch.Tensor) -> None:
    """Write row ``t`` of ``records`` into the rows of ``slot_ids[t]``, plane by plane."""
    for t, slot in enumerate(slot_ids.tolist()):
        for view, plane in zip(layout.views, layout.planes):
            row = view[slot // layout.block_size, slot % layout.block_size]
            data = records[t, plane.record_offset : plane.record_offset + plane.row_bytes]
            row.copy_(data.clone().to(row.device).view(row.dtype).reshape(row.shape))
