"""Bounds of the transport (issue 17): connections that do not authenticate are bounded in
number and time from the moment they are accepted, a stalled receive times out, wrong
arguments get a clear error before anything is sent, and a closed server is PeerGone to its
clients, never a timeout."""

from __future__ import annotations

import os
import signal
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from lumen_core import _native
from lumen_core import transport as tp
from lumen_core.auth import CapabilityIssuer
from lumen_core.stream import HolderStore

pytestmark = [pytest.mark.ucx, pytest.mark.timeout(60)]

TLS = "tcp"
SECRET = b"b" * 32
LIMITS = tp.WireLimits(max_tokens_per_message=64, max_record_bytes=256, max_payload_bytes=4096)


@pytest.fixture
def pair(issuer: CapabilityIssuer) -> Iterator[tuple[tp.Server, tp.Client]]:
    """An in-process server and a client connected to it, both with LIMITS."""
    with (
        tp.Server(
            SECRET,
            issuer_public_key=issuer.public_key,
            store=HolderStore(),
            tls=TLS,
            limits=LIMITS,
        ) as server,
        tp.Client("127.0.0.1", server.port, SECRET, tls=TLS, limits=LIMITS) as client,
    ):
        yield server, client


def _append_args(num_tokens: int, record_bytes: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    ids = np.zeros(num_tokens, np.uint32)
    return ids, ids.copy(), np.zeros((num_tokens, record_bytes), np.uint8)


def test_records_wider_than_32_bits_are_refused_not_truncated(issuer: CapabilityIssuer, pair) -> None:
    server, client = pair
    cap = issuer.issue(1, 0, 0, holder_id=0)
    # 4 GiB + 16 bytes a record: np.zeros maps it lazily, nothing is touched.
    ids, crcs, _ = _append_args(1, 1)
    wide = np.zeros((1, 2**32 + 16), np.uint8)
    with pytest.raises(ValueError, match=r"records must have at most 256 bytes a record, got 4294967312"):
        client.start_append(1, 0, 0, 0, ids, crcs, wide, cap)
    assert client.connected and server.stats()["malformed"] == 0


def test_oversized_append_raises_before_sending(issuer: CapabilityIssuer, pair) -> None:
    server, client = pair
    cap = issuer.issue(1, 0, 0, holder_id=0)
    with pytest.raises(ValueError, match=r"records must have at most 256 bytes a record, got 257"):
        client.start_append(1, 0, 0, 0, *_append_args(1, 257), cap)
    # 32 tokens of 256 bytes: 8,448 payload bytes, over the 4,096 the receiver accepts.
    with pytest.raises(ValueError, match=r"records must fit max_payload_bytes=4096, got 8448 bytes"):
        client.start_append(1, 0, 0, 0, *_append_args(32, 256), cap)
    assert client.connected and server.stats()["malformed"] == 0


def test_read_whose_reply_could_exceed_the_limit_raises_before_sending(
    issuer: CapabilityIssuer, pair
) -> None:
    server, client = pair
    cap = issuer.issue(1, 0, 1, holder_id=0)
    client.open(1, 0, 1, 256, bytes(32), bytes(32), cap)
    # The reply to 16 tokens of 256 bytes is 64 + 16 * 264 = 4,288 bytes: over 4,096.
    with pytest.raises(
        ValueError,
        match=r"max_tokens must be at most 15 for record_bytes=256 \(the reply must fit max_payload_b",
    ):
        client.read(1, 0, 1, 0, 16, 256, cap)
    assert client.read(1, 0, 1, 0, 15, 256, cap).durable_tokens == 0
    assert client.connected and server.stats()["malformed"] == 0


def test_the_client_takes_the_smaller_of_its_limits_and_those_the_holder_announces(
    issuer: CapabilityIssuer,
) -> None:
    ours = tp.WireLimits(max_tokens_per_message=32, max_record_bytes=1 << 20, max_payload_bytes=1 << 20)
    with (
        tp.Server(
            SECRET, store=HolderStore(), tls=TLS, limits=LIMITS, issuer_public_key=issuer.public_key
        ) as server,
        tp.Client("127.0.0.1", server.port, SECRET, tls=TLS) as client,
        tp.Client("127.0.0.1", server.port, SECRET, tls=TLS, limits=ours) as smaller,
    ):
        assert client.limits == LIMITS
        assert smaller.limits == tp.WireLimits(32, 256, 4096)
        cap = issuer.issue(1, 0, 1, holder_id=0)
        # What the holder would refuse as malformed (dropping the connection) is refused here.
        with pytest.raises(ValueError, match=r"`record_bytes` must be in \[1, 256\], got 512"):
            client.open(1, 0, 1, 512, bytes(32), bytes(32), cap)
        with pytest.raises(ValueError, match=r"records must hold 1 to 64 tokens, got 65"):
            client.start_append(1, 0, 1, 0, *_append_args(65, 16), cap)
        with pytest.raises(ValueError, match=r"records must fit max_payload_bytes=4096, got 8448 bytes"):
            client.start_append(1, 0, 1, 0, *_append_args(32, 256), cap)
        with pytest.raises(ValueError, match=r"records must hold 1 to 32 tokens, got 33"):
            smaller.start_append(1, 0, 1, 0, *_append_args(33, 16), cap)
        assert client.open(1, 0, 1, 256, bytes(32), bytes(32), cap) == 0
        assert client.connected and smaller.connected and server.stats()["malformed"] == 0


@pytest.mark.parametrize("timeout_s", [float("inf"), 1e10, float("nan"), 0.0, -1.0])
def test_timeouts_must_be_finite_and_bounded(issuer: CapabilityIssuer, pair, timeout_s: float) -> None:
    _, client = pair
    cap = issuer.issue(1, 0, 0, holder_id=0)
    refused = r"must be (in \(0, 1000000\.0\] seconds|a number other than NaN), got"
    with pytest.raises(ValueError, match=rf"`timeout_s` {refused}"):
        client.release(1, 0, 0, cap, timeout_s=timeout_s)
    with pytest.raises(ValueError, match=rf"`connect_timeout_s` {refused}"):
        tp.Client("127.0.0.1", 1, SECRET, connect_timeout_s=timeout_s)
    assert client.connected


def test_a_long_but_finite_timeout_waits_for_the_answer(issuer: CapabilityIssuer, pair) -> None:
    _, client = pair
    cap = issuer.issue(1, 0, 1, holder_id=0)
    assert client.open(1, 0, 1, 16, bytes(32), bytes(32), cap, timeout_s=1e6) == 0


def test_closed_server_is_peer_gone_to_its_clients(issuer: CapabilityIssuer, pair) -> None:
    server, client = pair
    cap = issuer.issue(1, 0, 1, holder_id=0)
    client.open(1, 0, 1, 16, bytes(32), bytes(32), cap)
    server.close()
    started = time.monotonic()
    with pytest.raises(tp.PeerGone):
        client.release(1, 0, 1, cap, timeout_s=5.0)
    assert time.monotonic() - started < 2.0
    assert not client.connected


def _wait_for(predicate, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.02)


def _stop_mid_receive(server: tp.Server, pid: int) -> None:
    """SIGSTOPs the writer pid while the server is receiving one of its appends."""
    for _ in range(200):
        os.kill(pid, signal.SIGSTOP)
        time.sleep(0.05)  # what was sent before the stop has arrived
        if server.stats()["receives_in_flight"] > 0:
            return
        os.kill(pid, signal.SIGCONT)
        time.sleep(0.005)
    raise AssertionError("the writer was never stopped in the middle of an append")


def _closed_by_peer(sock: socket.socket, timeout_s: float) -> bool:
    """True when the server closes sock within timeout_s (EOF or a reset)."""
    sock.settimeout(timeout_s)
    try:
        return sock.recv(1) == b""
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False


def test_plain_tcp_connections_are_dropped_at_the_handshake_deadline(issuer: CapabilityIssuer) -> None:
    """Sockets that never speak UCX (silent, or sending garbage) are closed once the handshake
    deadline passes after they were accepted, and counted as handshake timeouts."""
    # 2 s: time enough for a real client's handshake on a loaded machine.
    with tp.Server(
        SECRET,
        issuer_public_key=issuer.public_key,
        store=HolderStore(),
        tls=TLS,
        handshake_timeout_s=2.0,
    ) as server:
        raw = [socket.create_connection(("127.0.0.1", server.port)) for _ in range(6)]
        started = time.monotonic()
        for sock in raw[:3]:
            sock.sendall(b"GET / HTTP/1.0\r\n\r\n")
        _wait_for(lambda: server.stats()["connections_unauthenticated"] == 6)
        for sock in raw:
            assert _closed_by_peer(sock, timeout_s=5.0)
            sock.close()
        assert time.monotonic() - started >= 1.9  # not before the deadline
        stats = server.stats()
        assert stats["handshake_timeouts"] == 6 and stats["connections_unauthenticated"] == 0
        with tp.Client("127.0.0.1", server.port, SECRET, tls=TLS) as client:
            assert client.connected


def test_unauthenticated_connections_are_bounded_in_number_and_the_server_recovers(
    issuer: CapabilityIssuer,
) -> None:
    with tp.Server(
        SECRET,
        issuer_public_key=issuer.public_key,
        store=HolderStore(),
        tls=TLS,
        handshake_timeout_s=2.0,
        max_unauthenticated=16,
    ) as server:
        raw = [socket.create_connection(("127.0.0.1", server.port)) for _ in range(200)]
        _wait_for(lambda: server.stats()["connections_refused"] == 184)
        assert server.stats()["connections_unauthenticated"] == 16
        # Those past the bound were closed at once; the first 16 wait for their deadline.
        assert all(_closed_by_peer(sock, timeout_s=2.0) for sock in raw[16:])
        for sock in raw:
            sock.close()
        _wait_for(lambda: server.stats()["connections_unauthenticated"] == 0)
        with tp.Client("127.0.0.1", server.port, SECRET, tls=TLS) as client:
            cap = issuer.issue(1, 0, 1, holder_id=0)
            assert client.open(1, 0, 1, 16, bytes(32), bytes(32), cap) == 0
        assert server.stats()["handshakes_ok"] == 1


def test_an_authenticated_connection_outlives_the_handshake_deadline(issuer: CapabilityIssuer) -> None:
    with (
        tp.Server(
            SECRET,
            issuer_public_key=issuer.public_key,
            store=HolderStore(),
            tls=TLS,
            handshake_timeout_s=2.0,
        ) as server,
        tp.Client("127.0.0.1", server.port, SECRET, tls=TLS) as client,
    ):
        time.sleep(2.5)
        cap = issuer.issue(1, 0, 1, holder_id=0)
        assert client.open(1, 0, 1, 16, bytes(32), bytes(32), cap) == 0
        stats = server.stats()
        assert stats["handshake_timeouts"] == 0 and stats["connections_active"] == 1


def test_a_timeout_with_a_transfer_in_flight_drops_the_connection(issuer: CapabilityIssuer) -> None:
    with (
        tp.Server(
            SECRET,
            issuer_public_key=issuer.public_key,
            store=HolderStore(),
            tls=TLS,
        ) as server,
        tp.Client("127.0.0.1", server.port, SECRET, tls=TLS) as client,
    ):
        cap = issuer.issue(2, 0, 1, holder_id=0)
        client.open(2, 0, 1, 1 << 16, bytes(32), bytes(32), cap)
        # 64 MiB take far longer than 100 us over tcp: the send is still in flight.
        ids, crcs, records = _append_args(1024, 1 << 16)
        with pytest.raises(tp.Timeout):
            client.append(2, 0, 1, 0, ids, crcs, records, cap, timeout_s=1e-4)
        assert not client.connected
        with pytest.raises(tp.PeerGone):
            client.release(2, 0, 1, cap)


def test_a_stalled_writer_is_dropped_at_the_receive_deadline(
    issuer: CapabilityIssuer, spawn_streamer, peer, secret
) -> None:
    """A writer stopped (SIGSTOP) in the middle of its appends: the receive that cannot finish
    times out, its connection is dropped, and a new epoch takes the checkpoint over."""
    request_id, n, record_bytes = 31, 1024, 32768  # 32 MiB appends, 4 in flight: always one
    with tp.Server(
        secret,
        issuer_public_key=issuer.public_key,
        store=HolderStore(),
        tls=TLS,
        receive_timeout_s=1.0,
    ) as server:
        streamer = spawn_streamer(server.port, request_id, n, record_bytes, num_appends=8)
        assert streamer.read()["durable"] >= n
        try:
            _stop_mid_receive(server, streamer.proc.pid)
            _wait_for(lambda: server.stats()["connections_active"] == 0, timeout_s=10.0)
            assert server.stats()["receive_timeouts"] == 1
            cap = issuer.issue(request_id, peer.SHARD, 2, holder_id=0)
            with tp.Client("127.0.0.1", server.port, secret, tls=TLS) as client:
                fingerprints = (peer.LAYOUT_FP, peer.MODEL_FP)
                durable = client.open(request_id, peer.SHARD, 2, record_bytes, *fingerprints, cap)
                assert durable % n == 0 and durable >= n
                append = peer.make_append(request_id, durable, n, record_bytes)
                assert client.append(request_id, peer.SHARD, 2, durable, *append, cap) == durable + n
        finally:
            if streamer.proc.poll() is None:
                os.kill(streamer.proc.pid, signal.SIGCONT)


RETIRED_EPOCHS = 65_536  # kMaxRetiredEpochs in csrc/holder/holder_store.cpp; the README's figure


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_holder_remembers_the_latest_retired_epochs(issuer: CapabilityIssuer, pair) -> None:
    """A released checkpoint's epoch is remembered, so its old writer cannot re-create it, for
    the latest RETIRED_EPOCHS checkpoints: the oldest one is forgotten after one more."""
    _, client = pair

    def open_at(request_id: int, epoch: int) -> int:
        cap = issuer.issue(request_id, 0, epoch, holder_id=0)
        return client.open(request_id, 0, epoch, 16, bytes(32), bytes(32), cap)

    def release(request_id: int, epoch: int) -> None:
        client.release(request_id, 0, epoch, issuer.issue(request_id, 0, epoch, holder_id=0))

    open_at(0, 2)
    release(0, 2)
    with pytest.raises(tp.StaleEpoch):
        open_at(0, 1)
    for request_id in range(1, RETIRED_EPOCHS):  # 0 is still among the latest RETIRED_EPOCHS
        open_at(request_id, 2)
        release(request_id, 2)
    with pytest.raises(tp.StaleEpoch):
        open_at(0, 1)
    open_at(RETIRED_EPOCHS, 2)
    release(RETIRED_EPOCHS, 2)  # pushes 0 out
    assert open_at(0, 1) == 0
    with pytest.raises(tp.StaleEpoch):
        open_at(1, 1)


def test_memory_a_stalled_receive_writes_into_counts_against_the_budget(
    issuer: CapabilityIssuer, spawn_streamer, peer, secret
) -> None:
    """A writer stalls (SIGSTOP) with appends half received; a new epoch takes the checkpoint
    over and appends until the budget refuses. The chunks the stalled receives still write
    into stay mapped beside the new ones, so they are charged: the records in use never
    exceed the budget, and the charge returns once those receives end."""
    request_id, n, record_bytes = 41, 1024, 32768  # 32 MiB appends, 4 in flight
    budget, chunk = 256 << 20, 2 << 20
    store = HolderStore(budget, chunk_bytes=chunk)
    with tp.Server(secret, issuer_public_key=issuer.public_key, store=store, tls=TLS) as server:
        streamer = spawn_streamer(server.port, request_id, n, record_bytes, num_appends=8)
        assert streamer.read()["durable"] >= n
        try:
            _stop_mid_receive(server, streamer.proc.pid)
            cap = issuer.issue(request_id, peer.SHARD, 2, holder_id=0)
            with tp.Client("127.0.0.1", server.port, secret, tls=TLS) as client:
                fingerprints = (peer.LAYOUT_FP, peer.MODEL_FP)
                pos = client.open(request_id, peer.SHARD, 2, record_bytes, *fingerprints, cap)
                with pytest.raises(tp.Rejected):
                    for _ in range(16):  # 16 MiB appends: the budget runs out first
                        append = peer.make_append(request_id, pos, n // 2, record_bytes)
                        pos = client.append(request_id, peer.SHARD, 2, pos, *append, cap)
                stats = store.stats()
                assert stats["appends_refused_budget"] >= 1
                assert stats["arena_bytes"] - stats["arena_free_bytes"] <= budget + chunk
                charged = stats["bytes_charged"]
                os.kill(streamer.proc.pid, signal.SIGCONT)  # its receives end; it is refused
                streamer.proc.wait(timeout=30)
                _wait_for(lambda: store.stats()["bytes_charged"] < charged)
                assert store.stats()["bytes_charged"] <= budget
        finally:
            if streamer.proc.poll() is None:
                os.kill(streamer.proc.pid, signal.SIGCONT)


RAW_OP = 2**63  # send_raw's first op id


def _unauthenticated_peer(port: int):
    """A native client connected without proving the secret (the binding's test mode)."""
    return _native.require_ucx().Client(
        address="127.0.0.1",
        port=port,
        secret=SECRET,
        tls=TLS,
        connect_timeout_s=5.0,
        skip_handshake=True,
        **LIMITS._kwargs(),
    )


def _open_header(issuer: CapabilityIssuer, request_id: int) -> bytes:
    cap = issuer.issue(request_id, 0, 1, holder_id=0)
    return _native.require_ucx().encode_header(
        4, request_id=request_id, op_id=RAW_OP, epoch=1, record_bytes=16, payload_bytes=64, capability=cap
    )


def test_a_request_before_the_handshake_is_counted_and_drops_the_connection(issuer: CapabilityIssuer) -> None:
    with tp.Server(
        SECRET,
        issuer_public_key=issuer.public_key,
        store=HolderStore(),
        tls=TLS,
        limits=LIMITS,
    ) as server:
        peer = _unauthenticated_peer(server.port)
        try:
            with pytest.raises((tp.PeerGone, tp.Timeout)):
                peer.send_raw(_open_header(issuer, 1), bytes(64), RAW_OP, 5.0)
            _wait_for(lambda: server.stats()["connections_active"] == 0)
            stats = server.stats()
            assert stats["unauthenticated"] == 1 and stats["opens"] == 0
            assert stats["connections_accepted"] == 1 and stats["handshakes_ok"] == 0
        finally:
            peer.close()


def test_a_message_without_a_reply_endpoint_drops_the_unauthenticated_connections(
    issuer: CapabilityIssuer,
) -> None:
    """UCX does not say which connection such a message came on; no client of ours sends one,
    so the connections still in their handshake are dropped at once (long before their
    deadline), the authenticated ones kept."""
    with (
        tp.Server(
            SECRET,
            issuer_public_key=issuer.public_key,
            store=HolderStore(),
            tls=TLS,
            limits=LIMITS,
            handshake_timeout_s=60.0,
        ) as server,
        tp.Client("127.0.0.1", server.port, SECRET, tls=TLS, limits=LIMITS) as client,
    ):
        peers = [_unauthenticated_peer(server.port) for _ in range(2)]
        try:
            _wait_for(lambda: server.stats()["connections_active"] == 3)
            with pytest.raises((tp.PeerGone, tp.Timeout)):
                peers[0].send_raw(_open_header(issuer, 1), bytes(64), RAW_OP, 1.0, reply_ep=False)
            _wait_for(lambda: server.stats()["connections_active"] == 1, timeout_s=5.0)
            stats = server.stats()
            assert stats["malformed"] == 1 and stats["handshake_timeouts"] == 0
            cap = issuer.issue(1, 0, 1, holder_id=0)
            assert client.open(1, 0, 1, 16, bytes(32), bytes(32), cap) == 0
        finally:
            for peer in peers:
                peer.close()


def test_appends_received_aside_count_against_the_budget(spawn_streamer, peer, secret, issuer) -> None:
    """Appends that overlap what is durable or pending are received into buffers of their
    own, which stay mapped until they commit (here: behind a stalled writer's receive). Those
    buffers are charged: once they would exceed the budget the holder refuses, and their
    charge returns when they end."""
    request_id, n, record_bytes = 43, 1024, 32768  # 32 MiB appends, 4 in flight
    budget = 512 << 20
    store = HolderStore(budget, chunk_bytes=2 << 20)
    cap = issuer.issue(request_id, peer.SHARD, peer.EPOCH, holder_id=0)
    with tp.Server(secret, store=store, tls=TLS, issuer_public_key=issuer.public_key) as server:
        streamer = spawn_streamer(server.port, request_id, n, record_bytes, num_appends=8)
        assert streamer.read()["durable"] >= n
        try:
            _stop_mid_receive(server, streamer.proc.pid)
            overlap = peer.make_append(request_id, 0, n, record_bytes)  # what the writer sent first
            with tp.Client("127.0.0.1", server.port, secret, tls=TLS) as client:
                fingerprints = (peer.LAYOUT_FP, peer.MODEL_FP)
                assert client.open(request_id, peer.SHARD, peer.EPOCH, record_bytes, *fingerprints, cap) >= n
                # 16 x 32 MiB received aside: twice what the budget has left beside the writer's.
                ops = [
                    client.start_append(request_id, peer.SHARD, peer.EPOCH, 0, *overlap, cap)
                    for _ in range(16)
                ]
                _wait_for(lambda: store.stats()["appends_refused_budget"] >= 1)
                assert store.stats()["bytes_charged"] <= budget
                os.kill(streamer.proc.pid, signal.SIGCONT)  # its receives end, the aside ones commit
                refused = 0
                for op_id in ops:
                    try:
                        client.wait(op_id, timeout_s=30.0)
                    except tp.Rejected:
                        refused += 1
                assert 1 <= refused < len(ops)
                streamer.proc.wait(timeout=30)
                stats = store.stats()
                assert stats["bytes_charged"] == stats["tokens_held"] * (record_bytes + 8)
        finally:
            if streamer.proc.poll() is None:
                os.kill(streamer.proc.pid, signal.SIGCONT)


def _listening_ports() -> set[int]:
    """TCP ports this process listens on (from /proc: the sockets among its descriptors)."""
    inodes = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            link = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:  # closed meanwhile
            continue
        if link.startswith("socket:["):
            inodes.add(link[len("socket:[") : -1])
    ports = set()
    for table in ("/proc/self/net/tcp", "/proc/self/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] == "0A" and fields[9] in inodes:  # 0A: LISTEN
                ports.add(int(fields[1].rsplit(":", 1)[1], 16))
    return ports


def _num_descriptors() -> int:
    return len(os.listdir("/proc/self/fd"))


def test_silent_sockets_give_their_descriptors_back_to_the_holder() -> None:
    """Shut down at the deadline, the sockets UCX's listener accepted are closed by UCX too: the
    holder's process gets every descriptor back (what locked clients out before)."""
    with tp.Server(SECRET, store=HolderStore(), tls=TLS, handshake_timeout_s=1.0) as server:
        with tp.Client("127.0.0.1", server.port, SECRET, tls=TLS) as client:
            assert client.connected  # UCX's lazily made resources exist from here on
        baseline = _num_descriptors()
        silent = [socket.create_connection(("127.0.0.1", server.port)) for _ in range(40)]
        _wait_for(lambda: server.stats()["connections_unauthenticated"] == 40)
        assert _num_descriptors() >= baseline + 80  # ours and UCX's
        assert all(_closed_by_peer(sock, timeout_s=5.0) for sock in silent)
        for sock in silent:
            sock.close()
        _wait_for(lambda: _num_descriptors() <= baseline)
        assert server.stats()["handshake_timeouts"] == 40
        with tp.Client("127.0.0.1", server.port, SECRET, tls=TLS) as client:
            assert client.connected


def test_ucx_data_lanes_are_outside_the_admission_bound() -> None:
    """The limit docs/security.md states: besides its connection listener (the holder's port),
    UCX listens on one port per network device (its tcp data lanes). A silent socket there is
    neither counted nor closed at the handshake deadline: UCX offers no hook before a lane's
    own connection setup. Should this change, update the doc."""
    before = _listening_ports()
    with tp.Server(SECRET, store=HolderStore(), tls=TLS, handshake_timeout_s=1.0) as server:
        own = _listening_ports() - before - {server.port}
        assert own  # at least the loopback data lane
        silent = []
        for port in sorted(own):
            try:
                silent.append(socket.create_connection(("127.0.0.1", port), timeout=2.0))
            except ConnectionRefusedError:  # a data lane on another device than loopback
                continue
        assert silent
        time.sleep(1.5)  # past the deadline
        assert not any(_closed_by_peer(sock, timeout_s=0.5) for sock in silent)
        assert server.stats()["connections_unauthenticated"] == 0
        for sock in silent:
            sock.close()
        with tp.Client("127.0.0.1", server.port, SECRET, tls=TLS) as client:
            assert client.connected
