"""Payload encryption (docs/security.md, "Payload encryption"): a connection that asks for it
carries its records in AES-256-GCM both ways. Checked on what crosses the loopback link, not
only by round trips: the records' bytes are on the wire in the clear without it and nowhere
with it."""

from __future__ import annotations

import os
import socket
import threading
from collections.abc import Iterator

import numpy as np
import pytest
import torch

from lumen_core import transport as tp
from lumen_core.auth import CapabilityIssuer
from lumen_core.ops import checksum
from lumen_core.stream import HolderStore

pytestmark = [pytest.mark.ucx, pytest.mark.timeout(60)]

TLS = "tcp"
SECRET = b"the-cluster-secret-every-worker-holds"
RECORD_BYTES = 4096
FP = bytes(32)
# What the records hold: a pattern no header, key or handshake contains.
MARK = b"LUMEN-PLAINTEXT-RECORD-"
SO_RCVBUFFORCE = 33  # Linux's (root may pass rmem_max); Python's socket module does not name it


def _records(start: int, n: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    row = np.frombuffer((MARK * (RECORD_BYTES // len(MARK) + 1))[:RECORD_BYTES], dtype=np.uint8)
    records = np.tile(row, (n, 1))
    records[:, -1] = np.arange(start, start + n) % 251  # each record its own
    crcs = checksum(torch.from_numpy(records)).numpy().astype(np.uint32)
    return np.arange(start, start + n, dtype=np.uint32), crcs, records


@pytest.fixture
def holder(issuer: CapabilityIssuer) -> Iterator[tp.Server]:
    with tp.Server(
        SECRET, store=HolderStore(), holder_id=0, issuer_public_key=issuer.public_key, tls=TLS
    ) as server:
        yield server


def _write_and_read(client: tp.Client, issuer: CapabilityIssuer, request_id: int) -> tp.ReadResult:
    """An eager append (one record) and a rendezvous one (1.2 MB), then the whole read back."""
    cap = issuer.issue(request_id, 0, 1, holder_id=0)
    client.open(request_id, 0, 1, RECORD_BYTES, FP, FP, cap)
    assert client.append(request_id, 0, 1, 0, *_records(0, 1), cap) == 1
    assert client.append(request_id, 0, 1, 1, *_records(1, 300), cap) == 301
    return client.read(request_id, 0, 1, 0, 301, RECORD_BYTES, cap)


def test_encrypted_and_plain_connections_share_a_holder_and_read_each_others_records(
    issuer: CapabilityIssuer, holder: tp.Server
) -> None:
    ids, crcs, records = _records(0, 301)
    with (
        tp.Client("127.0.0.1", holder.port, SECRET, tls=TLS, encrypt=True) as sealed,
        tp.Client("127.0.0.1", holder.port, SECRET, tls=TLS) as plain,
    ):
        for writer, request_id in ((sealed, 1), (plain, 2)):
            result = _write_and_read(writer, issuer, request_id)
            np.testing.assert_array_equal(result.records, records)
            np.testing.assert_array_equal(result.crcs, crcs)
            for reader in (sealed, plain):  # the holder keeps the plaintext, checked by its crcs
                again = reader.read(
                    request_id, 0, 1, 0, 301, RECORD_BYTES, issuer.issue(request_id, 0, 1, holder_id=0)
                )
                np.testing.assert_array_equal(again.records, records)
                np.testing.assert_array_equal(again.token_ids, ids)
    stats = holder.stats()
    assert stats["encrypted"] == 1 and stats["decrypt_failures"] == 0 and stats["crc_failures"] == 0
    assert stats["tokens_committed"] == 2 * 301


class _Capture:
    """Every frame on the loopback link while it runs (an AF_PACKET socket: root only)."""

    def __init__(self) -> None:
        self.sock = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.htons(0x0003))
        # Room for the whole exchange: a loaded machine may read the socket late.
        self.sock.setsockopt(socket.SOL_SOCKET, SO_RCVBUFFORCE, 64 << 20)
        self.sock.bind(("lo", 0))
        self.sock.settimeout(0.1)
        self.data = bytearray()
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self.stop.is_set():
            try:
                self.data += self.sock.recv(1 << 16)
            except TimeoutError:
                continue

    def close(self) -> bytes:
        self.stop.set()
        self.thread.join(timeout=5)
        # A thread starved on a loaded machine leaves frames in the socket: they count too.
        self.sock.setblocking(False)
        while True:
            try:
                self.data += self.sock.recv(1 << 16)
            except BlockingIOError:
                break
        self.sock.close()
        return bytes(self.data)


@pytest.mark.skipif(os.geteuid() != 0, reason="capturing the loopback link needs root")
def test_records_cross_the_link_in_the_clear_only_without_encryption(
    issuer: CapabilityIssuer, holder: tp.Server
) -> None:
    seen = {}
    for encrypt, request_id in ((False, 3), (True, 4)):
        with tp.Client("127.0.0.1", holder.port, SECRET, tls=TLS, encrypt=encrypt) as client:
            capture = _Capture()
            try:
                _write_and_read(client, issuer, request_id)
            finally:
                seen[encrypt] = capture.close()
    assert seen[False].count(MARK) > 1000  # appends and read replies, in the clear
    assert len(seen[True]) > 301 * RECORD_BYTES  # the same traffic went by
    assert MARK not in seen[True]
