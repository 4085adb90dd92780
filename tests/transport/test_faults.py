"""Faults with real processes on loopback: killed peers, malformed and oversized messages."""

from __future__ import annotations

import os
import signal
import threading
import time
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lumen_core import _native
from lumen_core import transport as tp
from lumen_core.auth import CapabilityIssuer

pytestmark = [pytest.mark.ucx, pytest.mark.timeout(120)]

TLS = "tcp"
RAW_OP = 2**63


def _wait_for(predicate, timeout_s: float = 15.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.05)


def _check_prefix(
    client: tp.Client,
    peer: Any,
    issuer: CapabilityIssuer,
    request_id: int,
    tokens_per_append: int,
    record_bytes: int,
) -> int:
    """Reads the whole durable prefix of request_id back and checks it append by append;
    returns its length."""
    cap = issuer.issue(request_id, peer.SHARD, peer.EPOCH, holder_id=0)
    first = client.read(request_id, peer.SHARD, peer.EPOCH, 0, 1, record_bytes, cap)
    durable = first.durable_tokens
    assert durable % tokens_per_append == 0, "a partial append became durable"
    for start in range(0, durable, tokens_per_append):
        got = client.read(request_id, peer.SHARD, peer.EPOCH, start, tokens_per_append, record_bytes, cap)
        token_ids, crcs, records = peer.make_append(request_id, start, tokens_per_append, record_bytes)
        assert got.start_pos == start and got.records.shape[0] == tokens_per_append
        np.testing.assert_array_equal(got.records, records)
        np.testing.assert_array_equal(got.token_ids, token_ids)
        np.testing.assert_array_equal(got.crcs, crcs)
    return durable


def test_killed_streamer_leaves_only_whole_verified_appends(
    issuer: CapabilityIssuer, server, spawn_streamer, peer, secret
) -> None:
    request_id, n, record_bytes, num_appends = 21, 128, 32768, 48  # 4 MiB appends
    streamer = spawn_streamer(
        server.port, request_id, n, record_bytes, num_appends=num_appends, interval_s=0.02
    )
    # Kill only once 8 appends are durable, while later ones are in flight.
    reported = 0
    while reported < 8 * n:
        line = streamer.read()
        assert "done" not in line, "the streamer finished before it could be killed"
        reported = line["durable"]
    os.kill(streamer.proc.pid, signal.SIGKILL)
    streamer.proc.wait(timeout=10)
    _wait_for(lambda: server.ask("stats")["connections_active"] == 0)
    with tp.Client("127.0.0.1", server.port, secret, tls=TLS) as client:
        durable = _check_prefix(client, peer, issuer, request_id, n, record_bytes)
    assert reported <= durable < num_appends * n
    stats = server.ask("stats")
    assert stats["appends_committed"] == durable // n
    assert stats["malformed"] == 0 and stats["crc_failures"] == 0


def test_fenced_writer_resuming_mid_transfer_cannot_touch_the_new_epoch(
    issuer: CapabilityIssuer, server, spawn_streamer, peer, secret
) -> None:
    """A writer stalls (SIGSTOP) with appends half received, a new epoch takes the checkpoint
    over and writes past them; when the old writer resumes, the rest of its payload lands,
    but never in the records of the new epoch."""
    request_id, n, record_bytes = 23, 1024, 32768  # 32 MiB appends: long in flight
    streamer = spawn_streamer(server.port, request_id, n, record_bytes, num_appends=6)
    while streamer.read()["durable"] < n:
        pass
    os.kill(streamer.proc.pid, signal.SIGSTOP)
    try:
        cap = issuer.issue(request_id, peer.SHARD, 2, holder_id=0)
        with tp.Client("127.0.0.1", server.port, secret, tls=TLS) as client:
            durable = client.open(request_id, peer.SHARD, 2, record_bytes, peer.LAYOUT_FP, peer.MODEL_FP, cap)
            ours = [peer.make_append(request_id + 1, durable + i * n, n, record_bytes) for i in range(2)]
            for i, append in enumerate(ours):
                client.append(request_id, peer.SHARD, 2, durable + i * n, *append, cap)
            os.kill(streamer.proc.pid, signal.SIGCONT)
            streamer.proc.wait(timeout=30)  # its next ack is a refusal: it stops
            _wait_for(lambda: server.ask("stats")["connections_active"] == 1)
            for i, (token_ids, crcs, records) in enumerate(ours):
                got = client.read(request_id, peer.SHARD, 2, durable + i * n, n, record_bytes, cap)
                np.testing.assert_array_equal(got.token_ids, token_ids)
                np.testing.assert_array_equal(got.crcs, crcs)
                np.testing.assert_array_equal(got.records, records)
    finally:
        if streamer.proc.poll() is None:
            os.kill(streamer.proc.pid, signal.SIGCONT)


def test_killed_server_is_peer_gone_not_a_hang(issuer: CapabilityIssuer, server, peer, secret) -> None:
    request_id, n, record_bytes = 22, 128, 32768
    appends = [peer.make_append(request_id, i * n, n, record_bytes) for i in range(4)]
    cap = issuer.issue(request_id, peer.SHARD, peer.EPOCH, holder_id=0)
    client = tp.Client("127.0.0.1", server.port, secret, tls=TLS)
    client.open(request_id, peer.SHARD, peer.EPOCH, record_bytes, peer.LAYOUT_FP, peer.MODEL_FP, cap)
    start = 0
    ops = []
    for i in range(8):  # four acknowledged, four in flight
        ops.append(client.start_append(request_id, peer.SHARD, peer.EPOCH, start, *appends[i % 4], cap))
        start += n
        if i >= 4:
            client.wait(ops.pop(0), timeout_s=20.0)
    os.kill(server.proc.pid, signal.SIGKILL)
    killed_at = time.monotonic()
    with pytest.raises(tp.PeerGone):
        # Whatever was still in flight, the next waits and appends must fail as PeerGone.
        while time.monotonic() - killed_at < 30.0:
            for op in ops:
                client.wait(op, timeout_s=20.0)
            ops = [client.start_append(request_id, peer.SHARD, peer.EPOCH, start, *appends[0], cap)]
            start += n
    assert time.monotonic() - killed_at < 10.0, "peer loss took too long to surface"
    assert not client.connected
    with pytest.raises(tp.PeerGone, match="the connection is closed"):
        client.release(request_id, peer.SHARD, peer.EPOCH, cap)
    client.close()


def _malformed_messages() -> st.SearchStrategy[tuple[bytes, bytes]]:
    m = _native.C_ucx

    def valid(kind: int, num_tokens: int = 2, record_bytes: int = 8) -> bytes:
        payload = {5: num_tokens * (8 + record_bytes), 4: 64}.get(kind, 0)
        return m.encode_header(
            kind,
            num_tokens=num_tokens,
            record_bytes=record_bytes,
            payload_bytes=payload,
            request_id=1,
            epoch=1,
        )

    corrupted = st.tuples(st.sampled_from([4, 5, 6, 7]), st.integers(0, 103), st.integers(1, 255)).map(
        lambda t: (
            bytes(b ^ (t[2] if i == t[1] else 0) for i, b in enumerate(valid(t[0]))),
            b"\0" * {5: 32, 4: 64}.get(t[0], 0),
        )
    )
    random_header = st.tuples(st.binary(min_size=0, max_size=160), st.binary(max_size=64))
    # Well-formed crc, but a field is wrong: kind, version, a payload that is truncated or
    # longer than the header says, a kind the server never accepts from a client.
    field = st.one_of(
        st.integers(11, 2**16 - 1).map(lambda k: (m.encode_header(k), b"")),
        st.integers(0, 2**16 - 1)
        .filter(lambda v: v != m.WIRE_VERSION)
        .map(lambda v: (m.encode_header(6, version=v), b"")),
        st.integers(0, 47).map(lambda cut: (valid(5, 2, 16), b"\1" * cut)),
        st.integers(1, 64).map(lambda extra: (valid(5, 2, 16), b"\1" * (48 + extra))),
        st.sampled_from([1, 2, 3, 8, 9]).map(
            lambda k: (
                m.encode_header(k, payload_bytes={1: 32, 2: 64, 3: 48, 9: 64}.get(k, 0)),
                b"\0" * {1: 32, 2: 64, 3: 48, 9: 64}.get(k, 0),
            )
        ),
    )
    return st.one_of(corrupted, random_header, field)


def test_malformed_messages_are_refused_while_another_client_streams(
    issuer: CapabilityIssuer, server, spawn_streamer, peer, secret
) -> None:
    # The honest client streams until the attack is over (stopped then, at most 100 s).
    request_id, n, record_bytes = 31, 16, 4096
    streamer = spawn_streamer(server.port, request_id, n, record_bytes, num_appends=10_000, interval_s=0.01)
    acks: list[float] = []
    first = streamer.read()  # streaming has begun
    assert "durable" in first

    done: list[dict] = []

    def follow() -> None:
        while "done" not in (line := streamer.read()):
            acks.append(time.monotonic())
        done.append(line)

    follower = threading.Thread(target=follow, daemon=True)
    follower.start()
    sent = []

    @settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
    @given(message=_malformed_messages())
    def send_one(message: tuple[bytes, bytes]) -> None:
        header, payload = message
        with tp.Client("127.0.0.1", server.port, secret, tls=TLS) as attacker, pytest.raises(tp.PeerGone):
            attacker._native.send_raw(header, payload, RAW_OP, 10.0)
        sent.append(time.monotonic())

    send_one()
    # Oversized: a real payload beyond the server's 64 MiB limit, and a truncated one.
    big = (64 << 20) // (8 + 65536) + 1
    oversized = _native.C_ucx.encode_header(
        5, num_tokens=big, record_bytes=65536, payload_bytes=big * (8 + 65536), request_id=1, epoch=1
    )
    for header, payload in ((oversized, b"\0" * (big * (8 + 65536))), (oversized, b"\0" * (1 << 20))):
        with tp.Client("127.0.0.1", server.port, secret, tls=TLS) as attacker, pytest.raises(tp.PeerGone):
            attacker._native.send_raw(header, payload, RAW_OP, 10.0)
        sent.append(time.monotonic())

    assert follower.is_alive(), "the honest streamer ended before the attack did"
    streamer.proc.stdin.write("stop\n")
    streamer.proc.stdin.flush()
    follower.join(timeout=60)
    assert not follower.is_alive(), "the honest streamer stalled"
    assert any(sent[0] < t < sent[-1] for t in acks), "the streamer was not served meanwhile"
    num_appends = done[0]["appends"]
    stats = server.ask("stats")
    assert stats["malformed"] == len(sent)
    assert stats["handshakes_ok"] == len(sent) + 1
    assert stats["appends_committed"] == num_appends
    with tp.Client("127.0.0.1", server.port, secret, tls=TLS) as client:
        assert _check_prefix(client, peer, issuer, request_id, n, record_bytes) == num_appends * n
