"""Sealed messages on the data plane (issue 19): after the handshake, every message carries a
sequence number and an HMAC-SHA256 under a session key both ends derived from an X25519
exchange in the handshake (lumen/transport/auth.h). A message without a valid seal, or with a
number already used (a replay, or a reorder), drops its connection before the holder acts on
it; honest calls are sealed by the client and go through."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator

import pytest

from lumen_core import _native
from lumen_core import transport as tp
from lumen_core.auth import CapabilityIssuer
from lumen_core.stream import HolderStore

pytestmark = [pytest.mark.ucx, pytest.mark.timeout(60)]

TLS = "tcp"
SECRET = b"s" * 32
RAW_OP = 2**63  # send_raw's first op id
SEAL_SEQ, SEAL_MAC = 200, 208  # offsets of the seal in the header (wire.h)


@pytest.fixture
def pair(issuer: CapabilityIssuer) -> Iterator[tuple[tp.Server, tp.Client]]:
    """An in-process server trusting `issuer` and a client connected to it."""
    with (
        tp.Server(SECRET, issuer_public_key=issuer.public_key, store=HolderStore(), tls=TLS) as server,
        tp.Client("127.0.0.1", server.port, SECRET, tls=TLS) as client,
    ):
        yield server, client


def _open_message(issuer: CapabilityIssuer, request_id: int) -> tuple[bytes, bytes]:
    """An OPEN of checkpoint (request_id, 0) at epoch 1 that the holder would serve, unsealed."""
    header = _native.require_ucx().encode_header(
        4,
        request_id=request_id,
        op_id=RAW_OP,
        epoch=1,
        record_bytes=16,
        payload_bytes=64,
        capability=issuer.issue(request_id, 0, 1, holder_id=0),
    )
    return header, bytes(64)


def _wait_for(predicate, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.02)


def test_a_message_the_client_seals_is_served(issuer: CapabilityIssuer, pair) -> None:
    server, client = pair
    assert client._native.send_raw(*_open_message(issuer, 1), RAW_OP, 5.0) == 0
    stats = server.stats()
    assert stats["opens"] == 1 and stats["bad_seals"] == 0 and stats["out_of_sequence"] == 0
    assert client.connected


@pytest.mark.parametrize("seal", ["none", "guessed"])
def test_a_message_without_the_session_seal_drops_the_connection_unserved(
    issuer: CapabilityIssuer, pair, seal: str
) -> None:
    """What a peer that holds the cluster secret and a valid capability, but not this
    connection's session key, can inject into it: nothing the holder acts on."""
    server, client = pair
    header, payload = _open_message(issuer, 1)
    if seal == "guessed":  # the next sequence number and a MAC of its own making
        header = header[:SEAL_SEQ] + (1).to_bytes(8, "little") + os.urandom(32)
    with pytest.raises((tp.PeerGone, tp.Timeout)):
        client._native.send_raw(header, payload, RAW_OP, 5.0, seal="as_is")
    _wait_for(lambda: server.stats()["connections_active"] == 0)
    stats = server.stats()
    assert stats["bad_seals"] == 1 and stats["opens"] == 0 and stats["malformed"] == 0
    assert not client.connected


def test_a_replayed_or_reordered_message_drops_the_connection_unserved(
    issuer: CapabilityIssuer, pair
) -> None:
    """A valid seal carrying the number of a message already accepted (what a replay of that
    message, or one sent ahead of it, carries) is refused, though its MAC verifies."""
    server, client = pair
    assert client.open(1, 0, 1, 16, bytes(32), bytes(32), issuer.issue(1, 0, 1, holder_id=0)) == 0
    with pytest.raises((tp.PeerGone, tp.Timeout)):
        client._native.send_raw(*_open_message(issuer, 2), RAW_OP, 5.0, seal="repeat_sequence")
    _wait_for(lambda: server.stats()["connections_active"] == 0)
    stats = server.stats()
    assert stats["out_of_sequence"] == 1 and stats["bad_seals"] == 0 and stats["opens"] == 1


def test_send_raw_names_its_seal_modes(pair) -> None:
    _, client = pair
    with pytest.raises(ValueError, match="seal must be 'seal', 'repeat_sequence' or 'as_is', got 'off'"):
        client._native.send_raw(bytes(240), b"", RAW_OP, 1.0, seal="off")
