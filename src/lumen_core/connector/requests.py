"""What a caller hands the connector core about one request: where its checkpoint streams
(``StreamGrant``), where a resumed request's prefix is read (``RestoreSource``) and the
tokens a step wrote (``StepTokens``). Capabilities are opaque bytes: whoever issues them
(the gateway, or whoever holds an issuer key) decides their format; the holders check them."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from lumen_core._validate import U32_MAX, U64_MAX, check_int
from lumen_core.stream.streamer import Address, _check_address

__all__ = ["Address", "RestoreSource", "StepTokens", "StreamGrant", "check_capability"]


def check_capability(name: str, value: object) -> bytes:
    """``value`` as bytes; TypeError unless it is bytes, ValueError when empty. Nothing else
    is assumed of its contents."""
    if not isinstance(value, (bytes, bytearray)):
        raise TypeError(f"`{name}` must be bytes, got {type(value).__name__}")
    if not value:
        raise ValueError(f"`{name}` must be non-empty bytes, got b''")
    return bytes(value)


@dataclass(frozen=True)
class StreamGrant:
    """Where one request's checkpoint goes: ``holders`` (empty: it is not checkpointed), the
    request's ``epoch`` (a resumed request gets a newer one, which fences older writers), for
    each holder the ``capabilities`` entry it accepts for (request, shard, epoch) (a
    capability names the one holder it is valid on), and ``expected_tokens`` (prompt +
    expected output) each holder reserves room for.

    Raises TypeError / ValueError on a malformed field (a capability is checked only for
    being non-empty bytes, one per holder)."""

    epoch: int
    holders: tuple[Address, ...]
    capabilities: tuple[bytes, ...]
    expected_tokens: int = 0

    def __post_init__(self) -> None:
        check_int("epoch", self.epoch, 0, U32_MAX)
        if not isinstance(self.holders, tuple):
            raise TypeError(
                f"`holders` must be a tuple of (address, port), got {type(self.holders).__name__}"
            )
        for holder in self.holders:
            _check_address("holders[i]", holder)
        if not isinstance(self.capabilities, tuple) or len(self.capabilities) != len(self.holders):
            raise ValueError(
                f"`capabilities` must be a tuple of one capability per holder ({len(self.holders)}), "
                f"got {self.capabilities!r:.80}"
            )
        for i, capability in enumerate(self.capabilities):
            check_capability(f"capabilities[{i}]", capability)
        check_int("expected_tokens", self.expected_tokens, 0, U64_MAX)


@dataclass(frozen=True)
class RestoreSource:
    """Where a resumed request's checkpoint is read: ``address`` None = the core's own
    ``store`` (this process's holder); otherwise the holder at ``address``, read at ``epoch``
    (the request's new epoch: reading there fences the dead incarnation's writers) with
    ``capability``."""

    epoch: int
    address: Address | None
    capability: bytes

    def __post_init__(self) -> None:
        check_int("epoch", self.epoch, 0, U32_MAX)
        if self.address is not None:
            _check_address("address", self.address)
            check_capability("capability", self.capability)


@dataclass(frozen=True)
class StepTokens:
    """Tokens of one request whose K and V a step wrote: positions ``start_position ...``, in
    ``slot_ids`` (``slot = block_id * block_size + offset``), with ``token_ids``."""

    request_id: str
    start_position: int
    slot_ids: Sequence[int]
    token_ids: Sequence[int]

    def __post_init__(self) -> None:
        check_int("start_position", self.start_position, 0, U64_MAX)
        if len(self.slot_ids) != len(self.token_ids):
            raise ValueError(
                f"`slot_ids` and `token_ids` must have one entry per token, "
                f"got {len(self.slot_ids)} and {len(self.token_ids)}"
            )
