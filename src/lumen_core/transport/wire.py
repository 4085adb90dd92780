"""What both ends of the transport agree on (lumen/transport/wire.h): field sizes and the limits a
receiver enforces on one message. Capabilities are issued in ``lumen_core.auth``."""

from __future__ import annotations

from dataclasses import dataclass

from lumen_core._validate import U32_MAX, U64_MAX, check_int
from lumen_core.auth import CAPABILITY_BYTES

__all__ = ["CAPABILITY_BYTES", "FINGERPRINT_BYTES", "WireLimits", "append_payload_bytes", "read_reply_bytes"]

FINGERPRINT_BYTES = 32


def append_payload_bytes(num_tokens: int, record_bytes: int) -> int:
    """Bytes of an APPEND payload: token ids and crcs (u32 each), then the records."""
    return num_tokens * (8 + record_bytes)


def read_reply_bytes(num_tokens: int, record_bytes: int) -> int:
    """Bytes of a READ_DATA payload: both fingerprints, then what an append of it carries."""
    return 2 * FINGERPRINT_BYTES + append_payload_bytes(num_tokens, record_bytes)


@dataclass(frozen=True)
class WireLimits:
    """What a receiver accepts in one message; larger messages are refused as malformed."""

    max_tokens_per_message: int = 1 << 16
    max_record_bytes: int = 1 << 24
    max_payload_bytes: int = 1 << 30

    def __post_init__(self) -> None:
        check_int("max_tokens_per_message", self.max_tokens_per_message, 1, U32_MAX)
        check_int("max_record_bytes", self.max_record_bytes, 1, U32_MAX)
        check_int("max_payload_bytes", self.max_payload_bytes, 1, U64_MAX)

    def _kwargs(self) -> dict[str, int]:
        """The limits as the native constructors' keyword arguments (the streamer's too)."""
        return {
            "max_tokens_per_message": self.max_tokens_per_message,
            "max_record_bytes": self.max_record_bytes,
            "max_payload_bytes": self.max_payload_bytes,
        }
