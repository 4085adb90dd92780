"""The slow, obvious version of every op in ops.py: the specification the native code meets."""

from __future__ import annotations

import torch

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
