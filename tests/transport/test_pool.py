"""ClientPool: one reused connection per holder, replaced when the holder went away, bounded."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from lumen_core import ops
from lumen_core import transport as tp
from lumen_core.auth import CapabilityIssuer
from lumen_core.stream import HolderStore

pytestmark = [pytest.mark.ucx, pytest.mark.timeout(90)]

SECRET = bytes(range(32))
TLS = "tcp"
FP = bytes(32)


def _checkpoint(server: tp.Server, issuer: CapabilityIssuer, request_id: int, num_tokens: int) -> None:
    """Writes ``num_tokens`` one-byte records of ``request_id`` at epoch 0 on ``server``."""
    cap = issuer.issue(request_id, 0, 0, holder_id=0)
    ids = np.arange(num_tokens, dtype=np.uint32)
    records = np.zeros((num_tokens, 1), np.uint8)
    crcs = ops.checksum(torch.from_numpy(records)).numpy().astype(np.uint32)
    with tp.Client("127.0.0.1", server.port, SECRET, tls=TLS) as client:
        client.open(request_id, 0, 0, 1, FP, FP, cap)
        assert client.append(request_id, 0, 0, 0, ids, crcs, records, cap) == num_tokens


def _durable(issuer: CapabilityIssuer, request_id: int):
    cap = issuer.issue(request_id, 0, 0, holder_id=0)
    return lambda client: client.read(request_id, 0, 0, 0, 1, 1, cap).durable_tokens


def test_calls_to_one_holder_share_one_connection(issuer: CapabilityIssuer) -> None:
    with tp.Server(SECRET, issuer_public_key=issuer.public_key, store=HolderStore(), tls=TLS) as server:
        _checkpoint(server, issuer, 7, 5)
        before = server.stats()["handshakes_ok"]
        pool = tp.ClientPool(SECRET, tls=TLS)
        try:
            assert [pool.call(("127.0.0.1", server.port), _durable(issuer, 7)) for _ in range(6)] == [5] * 6
            assert server.stats()["handshakes_ok"] == before + 1
            with pytest.raises(tp.Rejected):  # a refusal keeps the connection
                pool.call(("127.0.0.1", server.port), _durable(issuer, 8))
            assert pool.call(("127.0.0.1", server.port), _durable(issuer, 7)) == 5
            assert server.stats()["handshakes_ok"] == before + 1
        finally:
            pool.close()


def test_a_restarted_holder_is_reconnected_and_a_dead_one_raises(issuer: CapabilityIssuer) -> None:
    store = HolderStore()
    server = tp.Server(SECRET, issuer_public_key=issuer.public_key, store=store, tls=TLS)
    port = server.port
    pool = tp.ClientPool(SECRET, tls=TLS)
    try:
        _checkpoint(server, issuer, 7, 3)
        assert pool.call(("127.0.0.1", port), _durable(issuer, 7)) == 3
        server.close()
        with tp.Server(SECRET, issuer_public_key=issuer.public_key, store=store, tls=TLS, port=port) as again:
            assert pool.call(("127.0.0.1", port), _durable(issuer, 7)) == 3  # the stale connection replaced
            assert again.stats()["handshakes_ok"] == 1
        with pytest.raises(tp.TransportError):
            pool.call(("127.0.0.1", port), _durable(issuer, 7))
        assert len(pool) == 0  # the failed connection was not kept
    finally:
        pool.close()
        server.close()


def test_the_least_recently_used_connection_is_closed_past_the_bound(issuer: CapabilityIssuer) -> None:
    with (
        tp.Server(SECRET, issuer_public_key=issuer.public_key, store=HolderStore(), tls=TLS) as a,
        tp.Server(SECRET, issuer_public_key=issuer.public_key, store=HolderStore(), tls=TLS) as b,
    ):
        _checkpoint(a, issuer, 1, 2)
        _checkpoint(b, issuer, 1, 4)
        pool = tp.ClientPool(SECRET, tls=TLS, max_connections=1)
        try:
            assert pool.call(("127.0.0.1", a.port), _durable(issuer, 1)) == 2
            assert pool.call(("127.0.0.1", b.port), _durable(issuer, 1)) == 4
            assert len(pool) == 1
            assert pool.call(("127.0.0.1", a.port), _durable(issuer, 1)) == 2
            assert a.stats()["handshakes_ok"] == 3  # _checkpoint's, then one per return to a
        finally:
            pool.close()


def test_bad_arguments() -> None:
    with pytest.raises(ValueError, match="max_connections"):
        tp.ClientPool(SECRET, max_connections=0)
    with pytest.raises(ValueError, match="connect_timeout_s"):
        tp.ClientPool(SECRET, connect_timeout_s=float("inf"))
