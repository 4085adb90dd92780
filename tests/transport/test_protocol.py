"""Protocol over loopback against a server process: round trips, ordering, auth, fencing."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from lumen_core import transport as tp
from lumen_core.auth import CapabilityIssuer
from lumen_core.stream import HolderStore
from lumen_core.transport.client import SELF_TEST_REQUEST_ID

pytestmark = [pytest.mark.ucx, pytest.mark.timeout(90)]

TLS = "tcp"


@pytest.fixture
def client(server: Any, secret: bytes):
    with tp.Client("127.0.0.1", server.port, secret, tls=TLS) as c:
        yield c


def _open(
    client: tp.Client, peer: Any, issuer: CapabilityIssuer, request_id: int, record_bytes: int, epoch: int = 1
) -> bytes:
    cap = issuer.issue(request_id, 0, epoch, holder_id=0)
    assert client.open(request_id, 0, epoch, record_bytes, peer.LAYOUT_FP, peer.MODEL_FP, cap) == 0
    return cap


def _read_all(
    client: tp.Client,
    issuer: CapabilityIssuer,
    request_id: int,
    num_tokens: int,
    record_bytes: int,
    epoch: int = 1,
) -> tp.ReadResult:
    cap = issuer.issue(request_id, 0, epoch, holder_id=0)
    return client.read(request_id, 0, epoch, 0, num_tokens, record_bytes, cap)


@pytest.mark.parametrize("record_bytes", [1, 64, 4096])
def test_round_trip_is_bit_exact(issuer: CapabilityIssuer, client, peer, secret, record_bytes: int) -> None:
    request_id = 100 + record_bytes
    cap = _open(client, peer, issuer, request_id, record_bytes)
    sizes = [1, 3, 17, 257]
    if record_bytes == 4096:
        sizes.append(2048)  # 8 MiB: the rendezvous path
    expected = []
    pos = 0
    for n in sizes:
        token_ids, crcs, records = peer.make_append(request_id, pos, n, record_bytes)
        assert client.append(request_id, 0, 1, pos, token_ids, crcs, records, cap) == pos + n
        expected.append((token_ids, crcs, records))
        pos += n
    got = _read_all(client, issuer, request_id, pos, record_bytes)
    assert (got.start_pos, got.durable_tokens, got.records.shape) == (0, pos, (pos, record_bytes))
    np.testing.assert_array_equal(got.records, np.concatenate([e[2] for e in expected]))
    np.testing.assert_array_equal(got.token_ids, np.concatenate([e[0] for e in expected]))
    np.testing.assert_array_equal(got.crcs, np.concatenate([e[1] for e in expected]))
    assert (got.layout_fingerprint, got.model_fingerprint) == (peer.LAYOUT_FP, peer.MODEL_FP)
    # A read from the middle, into the caller's buffer, past the end: clipped to durable.
    out = np.zeros((64, record_bytes), dtype=np.uint8)
    tail = client.read(request_id, 0, 1, pos - 5, 64, record_bytes, cap, out=out)
    assert tail.start_pos == pos - 5 and tail.records.shape[0] == 5
    assert np.shares_memory(tail.records, out)
    np.testing.assert_array_equal(out[:5], expected[-1][2][-5:])


def test_pipelined_appends_land_in_order(issuer: CapabilityIssuer, client, peer, secret) -> None:
    request_id, n, record_bytes = 7, 256, 16384  # 4 MiB per append
    cap = _open(client, peer, issuer, request_id, record_bytes)
    appends = [peer.make_append(request_id, i * n, n, record_bytes) for i in range(8)]
    ops = [client.start_append(request_id, 0, 1, i * n, *a, cap) for i, a in enumerate(appends)]
    assert [client.wait(op) for op in ops] == [(i + 1) * n for i in range(8)]
    got = _read_all(client, issuer, request_id, 8 * n, record_bytes)
    np.testing.assert_array_equal(got.records, np.concatenate([a[2] for a in appends]))


def test_overlap_gap_conflict_and_crc(issuer: CapabilityIssuer, client, server, peer, secret) -> None:
    request_id, record_bytes = 9, 32
    cap = _open(client, peer, issuer, request_id, record_bytes)
    token_ids, crcs, records = peer.make_append(request_id, 0, 20, record_bytes)
    assert client.append(request_id, 0, 1, 0, token_ids[:10], crcs[:10], records[:10], cap) == 10
    # An overlap that matches what is stored extends the checkpoint.
    assert client.append(request_id, 0, 1, 5, token_ids[5:15], crcs[5:15], records[5:15], cap) == 15
    # A gap is refused.
    with pytest.raises(tp.Rejected, match="append of request 9 shard 0 epoch 1 refused"):
        client.append(request_id, 0, 1, 16, token_ids[16:], crcs[16:], records[16:], cap)
    # An overlap with other content is a conflict.
    bad_ids = token_ids[10:20].copy()
    bad_ids[0] ^= 1
    with pytest.raises(tp.Conflict):
        client.append(request_id, 0, 1, 10, bad_ids, crcs[10:20], records[10:20], cap)
    # Records that do not match their crcs are refused and nothing of them becomes durable.
    broken = records[15:20].copy()
    broken[2, 3] ^= 0x40
    with pytest.raises(tp.Malformed):
        client.append(request_id, 0, 1, 15, token_ids[15:20], crcs[15:20], broken, cap)
    got = _read_all(client, issuer, request_id, 20, record_bytes)
    assert got.durable_tokens == 15
    np.testing.assert_array_equal(got.records, records[:15])
    # Re-open with other fingerprints or record size: conflict.
    with pytest.raises(tp.Conflict):
        client.open(request_id, 0, 1, record_bytes, bytes(32), peer.MODEL_FP, cap)
    with pytest.raises(tp.Conflict):
        client.open(request_id, 0, 1, record_bytes + 1, peer.LAYOUT_FP, peer.MODEL_FP, cap)
    # Reading with other record bytes than stored is refused on the client.
    with pytest.raises(tp.Conflict, match="records of 32 bytes, the read expects 16"):
        client.read(request_id, 0, 1, 0, 4, 16, cap)
    stats = server.ask("stats")
    assert stats["rejected"] == 1 and stats["conflicts"] == 3 and stats["crc_failures"] == 1
    assert stats["tokens_committed"] == 20  # 10 + 10 (the overlap counted as sent)
    client.release(request_id, 0, 1, cap)
    with pytest.raises(tp.Rejected):
        client.read(request_id, 0, 1, 0, 4, record_bytes, cap)
    assert client.connected


def test_epoch_fencing(issuer: CapabilityIssuer, server, peer, secret) -> None:
    request_id, record_bytes = 11, 64
    with (
        tp.Client("127.0.0.1", server.port, secret, tls=TLS) as old,
        tp.Client("127.0.0.1", server.port, secret, tls=TLS) as new,
    ):
        cap1 = _open(old, peer, issuer, request_id, record_bytes, epoch=1)
        token_ids, crcs, records = peer.make_append(request_id, 0, 8, record_bytes)
        assert old.append(request_id, 0, 1, 0, token_ids[:4], crcs[:4], records[:4], cap1) == 4
        # The request is re-routed: its new incarnation opens at epoch 2 and keeps the prefix.
        cap2 = issuer.issue(request_id, 0, 2, holder_id=0)
        assert new.open(request_id, 0, 2, record_bytes, peer.LAYOUT_FP, peer.MODEL_FP, cap2) == 4
        for call in (
            lambda: old.append(request_id, 0, 1, 4, token_ids[4:], crcs[4:], records[4:], cap1),
            lambda: old.read(request_id, 0, 1, 0, 8, record_bytes, cap1),
            lambda: old.release(request_id, 0, 1, cap1),
            lambda: old.open(request_id, 0, 1, record_bytes, peer.LAYOUT_FP, peer.MODEL_FP, cap1),
        ):
            with pytest.raises(tp.StaleEpoch):
                call()
        # An append at a newer epoch than opened is refused until that epoch is opened.
        cap3 = issuer.issue(request_id, 0, 3, holder_id=0)
        with pytest.raises(tp.Rejected):
            new.append(request_id, 0, 3, 4, token_ids[4:], crcs[4:], records[4:], cap3)
        assert new.append(request_id, 0, 2, 4, token_ids[4:], crcs[4:], records[4:], cap2) == 8
        got = new.read(request_id, 0, 2, 0, 8, record_bytes, cap2)
        np.testing.assert_array_equal(got.records, records)
        assert server.ask("stats")["stale_epoch"] == 4


def test_a_dropped_checkpoint_stays_fenced(issuer: CapabilityIssuer, server, peer, secret) -> None:
    """A fenced incarnation must not re-create a checkpoint released (or evicted) at a newer
    epoch: with its old, still valid capability it would fill it with records a later restore
    would trust."""
    request_id, record_bytes = 12, 64
    with (
        tp.Client("127.0.0.1", server.port, secret, tls=TLS) as old,
        tp.Client("127.0.0.1", server.port, secret, tls=TLS) as new,
    ):
        cap1 = _open(old, peer, issuer, request_id, record_bytes, epoch=1)
        cap2 = issuer.issue(request_id, 0, 2, holder_id=0)
        assert new.open(request_id, 0, 2, record_bytes, peer.LAYOUT_FP, peer.MODEL_FP, cap2) == 0
        new.release(request_id, 0, 2, cap2)  # the request finished at epoch 2
        token_ids, crcs, records = peer.make_append(request_id, 0, 4, record_bytes)
        for call in (
            lambda: old.open(request_id, 0, 1, record_bytes, peer.LAYOUT_FP, peer.MODEL_FP, cap1),
            lambda: old.append(request_id, 0, 1, 0, token_ids, crcs, records, cap1),
            lambda: old.read(request_id, 0, 1, 0, 4, record_bytes, cap1),
            lambda: old.release(request_id, 0, 1, cap1),
        ):
            with pytest.raises(tp.StaleEpoch):
                call()
        # Only a newer incarnation re-creates it: the epoch it ended at is fenced too.
        with pytest.raises(tp.StaleEpoch):
            new.open(request_id, 0, 2, record_bytes, peer.LAYOUT_FP, peer.MODEL_FP, cap2)
        cap3 = issuer.issue(request_id, 0, 3, holder_id=0)
        assert new.open(request_id, 0, 3, record_bytes, peer.LAYOUT_FP, peer.MODEL_FP, cap3) == 0
        assert server.ask("stats")["stale_epoch"] == 5


def test_wrong_secret_is_refused_and_gets_nothing(server, peer, secret) -> None:
    with pytest.raises(tp.Rejected, match="refused the handshake"):
        tp.Client("127.0.0.1", server.port, b"w" * 32, tls=TLS, connect_timeout_s=5.0)
    stats = server.ask("stats")
    assert stats["handshakes_failed"] == 1 and stats["handshakes_ok"] == 0
    assert stats["opens"] == 0


def test_unknown_checkpoint_is_rejected(issuer: CapabilityIssuer, client, secret) -> None:
    cap = issuer.issue(99, 0, 1, holder_id=0)
    ids = np.zeros(1, np.uint32)
    with pytest.raises(tp.Rejected):
        client.append(99, 0, 1, 0, ids, ids, np.zeros((1, 8), np.uint8), cap)
    with pytest.raises(tp.Rejected):
        client.release(99, 0, 1, cap)


def test_self_test_reports_transports_and_bandwidth(issuer: CapabilityIssuer, client, server) -> None:
    cap = issuer.issue(SELF_TEST_REQUEST_ID, 5, 0, holder_id=0)
    result = client.self_test(cap, shard=5, message_bytes=1 << 20, count=8, expected_gb_per_s=0.0)
    assert ("tcp", "lo") in result.transports or ("tcp", "") in result.transports
    assert result.gb_per_s > 0.0
    with pytest.warns(RuntimeWarning, match="transport self-test: .* expected at least"):
        # a released checkpoint's epoch is retired: each run needs a shard (and capability) of its own
        client.self_test(
            issuer.issue(SELF_TEST_REQUEST_ID, 6, 0, holder_id=0), shard=6, message_bytes=1 << 16, count=2,
            expected_gb_per_s=1e6,
        )  # fmt: skip
    stats = server.ask("stats")
    assert stats["appends_committed"] == 10 and stats["releases"] == 2
    with pytest.raises(ValueError, match=r"`count` must be in \[1, "):
        client.self_test(cap, shard=5, count=0)
    with pytest.raises(ValueError, match=r"`window` must be in \[1, "):
        client.self_test(cap, shard=5, window=0)
    with pytest.raises(TypeError, match="expected_gb_per_s must be a number, got str"):
        client.self_test(cap, shard=5, expected_gb_per_s="fast")
    with pytest.raises(tp.Rejected):  # the capability is for shard 5 only
        client.self_test(cap, shard=7, message_bytes=1 << 16, count=2, expected_gb_per_s=0.0)


def test_newer_epoch_fences_an_append_in_flight(issuer: CapabilityIssuer, server, peer, secret) -> None:
    request_id, n, record_bytes = 12, 1024, 49152  # one 48 MiB append
    token_ids, crcs, records = peer.make_append(request_id, 0, n, record_bytes)
    with (
        tp.Client("127.0.0.1", server.port, secret, tls=TLS) as old,
        tp.Client("127.0.0.1", server.port, secret, tls=TLS) as new,
    ):
        cap1 = _open(old, peer, issuer, request_id, record_bytes, epoch=1)
        op = old.start_append(request_id, 0, 1, 0, token_ids, crcs, records, cap1)
        cap2 = issuer.issue(request_id, 0, 2, holder_id=0)
        durable_at_open = new.open(request_id, 0, 2, record_bytes, peer.LAYOUT_FP, peer.MODEL_FP, cap2)
        # The new writer goes on at once, while the fenced receive may still be landing.
        ids2, crcs2, records2 = peer.make_append(request_id + 1, durable_at_open, 16, record_bytes)
        assert new.append(request_id, 0, 2, durable_at_open, ids2, crcs2, records2, cap2) == (
            durable_at_open + 16
        )
        try:
            landed = old.wait(op, timeout_s=30.0) == n
        except tp.StaleEpoch:
            landed = False
        # Whatever the timing, nothing of epoch 1 becomes durable after epoch 2 was opened,
        # and nothing of it overwrites what epoch 2 wrote.
        got = new.read(request_id, 0, 2, durable_at_open, 16, record_bytes, cap2)
        assert got.durable_tokens == durable_at_open + 16
        assert durable_at_open == (n if landed else 0)
        assert np.array_equal(got.records, records2) and np.array_equal(got.token_ids, ids2)
        assert old.connected and new.connected


def test_close_is_idempotent_and_later_calls_are_peer_gone(issuer: CapabilityIssuer, server, secret) -> None:
    client = tp.Client("127.0.0.1", server.port, secret, tls=TLS)
    client.close()
    client.close()
    assert not client.connected
    with pytest.raises(tp.PeerGone, match="the connection is closed"):
        client.release(1, 0, 1, issuer.issue(1, 0, 1, holder_id=0))
    local = tp.Server(secret, issuer_public_key=issuer.public_key, store=HolderStore(), tls=TLS)
    local.close()
    local.close()


def test_connection_that_does_not_authenticate_in_time_is_dropped(issuer: CapabilityIssuer, secret) -> None:
    # A deadline no handshake can meet: the proof arrives late (or never) and is refused.
    with tp.Server(
        secret, issuer_public_key=issuer.public_key, store=HolderStore(), tls=TLS, handshake_timeout_s=1e-6
    ) as server:
        with pytest.raises((tp.Timeout, tp.PeerGone)):
            tp.Client("127.0.0.1", server.port, secret, tls=TLS, connect_timeout_s=5.0)
        stats = server.stats()
        assert stats["handshake_timeouts"] == 1 and stats["handshakes_ok"] == 0
        assert stats["connections_active"] == 0
