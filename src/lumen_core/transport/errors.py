"""Typed errors of the transport; the native module raises these by wire status."""

from __future__ import annotations


class TransportError(RuntimeError):
    """A transport operation failed; ``status`` is the wire status name."""

    status = "error"


class PeerGone(TransportError):
    """The connection failed or was closed (the peer died, or it dropped us)."""

    status = "peer gone"


class Timeout(TransportError, TimeoutError):
    """No answer before the deadline."""

    status = "timeout"


class Rejected(TransportError):
    """Refused: wrong secret or capability, not opened, a gap, or an unknown checkpoint."""

    status = "rejected"


class Conflict(TransportError):
    """An overlapping append or re-open that does not match what is stored."""

    status = "conflict"


class StaleEpoch(TransportError):
    """The epoch is older than the one recorded for the request (fenced)."""

    status = "stale epoch"


class Malformed(TransportError):
    """A message failed validation (including records whose crc32c does not match)."""

    status = "malformed"


class Aborted(TransportError):
    """An earlier append of the same checkpoint failed; resend from the durable length."""

    status = "aborted"


# Wire status code -> class (values of lumen::transport::Status).
BY_STATUS: dict[int, type[TransportError]] = {
    1: Rejected,
    2: Conflict,
    3: StaleEpoch,
    4: Malformed,
    5: PeerGone,
    6: Timeout,
    7: Aborted,
}
