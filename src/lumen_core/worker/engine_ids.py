"""Where the gateway's request ids (u64 ints, on the wire and in every directive) meet the
engine's (strings): the decimal form, so a capability the gateway issued for a request is
valid on the holders for the engine's key of it as it is. Nothing else in ``worker/``
converts between the two."""

from __future__ import annotations


def engine_key(request_id: int) -> str:
    """The engine's id of a gateway request."""
    return str(request_id)


def request_id_of(key: str) -> int:
    """The gateway's id of an engine request (one ``engine_key`` made)."""
    return int(key)
