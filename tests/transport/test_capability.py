"""Data-plane capabilities (docs/security.md): only the issuer's signature opens, appends to,
reads, releases or fences a checkpoint. The peer here is a compromised worker: it holds the
cluster secret (it connects and authenticates), so every refusal below comes from the
capability alone."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from checkpoint_records import RECORD_BYTES, SECRET, TLS, trusting_holder, well_formed

from lumen_core import transport as tp
from lumen_core.auth import (
    CapabilityIssuer,
    Rights,
    read_issuer_key_file,
    read_issuer_public_key_file,
    verify_capability,
    write_issuer_key_file,
    write_issuer_public_key_file,
)
from lumen_core.stream import HolderStore

pytestmark = [pytest.mark.ucx, pytest.mark.timeout(60)]

HOLDER_ID = 3
FP = bytes(32)


@pytest.fixture
def holder(issuer: CapabilityIssuer) -> Iterator[tp.Server]:
    with trusting_holder(issuer, HOLDER_ID) as server:
        yield server


@pytest.fixture
def worker(holder: tp.Server) -> Iterator[tp.Client]:
    """A connection of a worker holding the cluster secret."""
    with tp.Client("127.0.0.1", holder.port, SECRET, tls=TLS) as client:
        yield client


def _refused_everything(client: tp.Client, request_id: int, epoch: int, cap: bytes) -> None:
    ids, crcs, records = well_formed(0, 4, 7)
    with pytest.raises(tp.Rejected):
        client.open(request_id, 0, epoch, RECORD_BYTES, FP, FP, cap)
    with pytest.raises(tp.Rejected):
        client.append(request_id, 0, epoch, 0, ids, crcs, records, cap)
    out = np.zeros((4, RECORD_BYTES), np.uint8)
    with pytest.raises(tp.Rejected):
        client.read(request_id, 0, epoch, 0, 4, RECORD_BYTES, cap, out=out)
    with pytest.raises(tp.Rejected):
        client.release(request_id, 0, epoch, cap)
    assert not out.any()  # a refused read receives nothing


def test_capability_names_its_fields_and_any_changed_byte_breaks_it(issuer: CapabilityIssuer) -> None:
    cap = issuer.issue(2**64 - 1, 7, 2**32 - 1, holder_id=2**64 - 2, rights=Rights.READ, now_s=1000.0)
    assert len(cap) == tp.CAPABILITY_BYTES == 128
    fields = verify_capability(issuer.public_key, cap)
    assert (fields.request_id, fields.shard, fields.epoch) == (2**64 - 1, 7, 2**32 - 1)
    assert (fields.holder_id, fields.rights) == (2**64 - 2, Rights.READ)
    assert fields.expires_at_ms == int((1000.0 + issuer.ttl_s) * 1000)
    for i in range(len(cap)):
        tampered = bytearray(cap)
        tampered[i] ^= 0x01
        with pytest.raises(ValueError, match="capability must be signed by the issuer"):
            verify_capability(issuer.public_key, bytes(tampered))
    with pytest.raises(ValueError, match="bad signature"):
        verify_capability(CapabilityIssuer.generate().public_key, cap)


def test_issue_refuses_bad_arguments(issuer: CapabilityIssuer) -> None:
    with pytest.raises(ValueError, match=r"`rights` must be a non-empty combination"):
        issuer.issue(1, 0, 0, holder_id=0, rights=0)
    with pytest.raises(ValueError, match=r"`rights` must be a non-empty combination"):
        issuer.issue(1, 0, 0, holder_id=0, rights=4)
    with pytest.raises(TypeError, match=r"`rights` must be a Rights, got bool"):
        issuer.issue(1, 0, 0, holder_id=0, rights=True)
    with pytest.raises(ValueError, match=r"`epoch` must be in \[0, "):
        issuer.issue(1, 0, 2**32, holder_id=0)
    with pytest.raises(ValueError, match=r"`holder_id` must be in \[0, "):
        issuer.issue(1, 0, 0, holder_id=-1)
    with pytest.raises(ValueError, match=r"`private_key` must be 32 bytes, got 31"):
        CapabilityIssuer(bytes(31))
    with pytest.raises(ValueError, match=r"`ttl_s` must be"):
        CapabilityIssuer(bytes(32), ttl_s=0)


def test_issuer_key_files(tmp_path: Path) -> None:
    key = write_issuer_key_file(tmp_path / "issuer.key")
    assert read_issuer_key_file(tmp_path / "issuer.key") == key
    with pytest.raises(FileExistsError):
        write_issuer_key_file(tmp_path / "issuer.key")
    (tmp_path / "issuer.key").chmod(0o644)
    with pytest.raises(PermissionError, match=r"owner only"):
        read_issuer_key_file(tmp_path / "issuer.key")
    public_key = CapabilityIssuer(key).public_key
    write_issuer_public_key_file(tmp_path / "issuer.pub", public_key)
    assert read_issuer_public_key_file(tmp_path / "issuer.pub") == public_key
    (tmp_path / "bad.pub").write_text("not hex\n")
    with pytest.raises(ValueError, match=r"must hold 64 hex digits"):
        read_issuer_public_key_file(tmp_path / "bad.pub")


def test_a_worker_with_the_secret_cannot_use_a_checkpoint_it_was_not_granted(
    issuer: CapabilityIssuer, holder: tp.Server, worker: tp.Client
) -> None:
    request_id = 5
    cap = issuer.issue(request_id, 0, 1, holder_id=HOLDER_ID)
    assert worker.open(request_id, 0, 1, RECORD_BYTES, FP, FP, cap) == 0
    assert worker.append(request_id, 0, 1, 0, *well_formed(0, 4, 1), cap) == 4
    own_key = CapabilityIssuer.generate()  # what a worker can sign with: a key of its own
    unsigned = [
        own_key.issue(request_id, 0, 1, holder_id=HOLDER_ID),  # minted by the worker
        bytes(tp.CAPABILITY_BYTES),
        bytes(cap[:20]) + bytes([cap[20] ^ 1]) + bytes(cap[21:]),  # the epoch field moved
    ]
    not_granted = [
        issuer.issue(request_id, 0, 1, holder_id=HOLDER_ID + 1),  # valid on another holder only
        issuer.issue(request_id + 1, 0, 1, holder_id=HOLDER_ID),  # another request's
        issuer.issue(request_id, 1, 1, holder_id=HOLDER_ID),  # another shard's
        issuer.issue(request_id, 0, 1, holder_id=HOLDER_ID, now_s=time.time() - 2 * issuer.ttl_s),  # expired
    ]
    for bad in unsigned + not_granted:
        _refused_everything(worker, request_id, 1, bad)
    stats = holder.stats()
    # open, read, release verify the signature; each refused append was never granted
    assert stats["bad_capability"] == 3 * len(unsigned)
    assert stats["capability_refused"] == len(unsigned) + 4 * len(not_granted)
    assert stats["tokens_committed"] == 4 and stats["releases"] == 0
    out = np.zeros((8, RECORD_BYTES), np.uint8)
    assert worker.read(request_id, 0, 1, 0, 8, RECORD_BYTES, cap, out=out).records.shape[0] == 4
    assert (out[:4] == 1).all()


def test_rights_are_enforced_per_operation(issuer: CapabilityIssuer, worker: tp.Client) -> None:
    request_id = 6
    write = issuer.issue(request_id, 0, 1, holder_id=HOLDER_ID, rights=Rights.WRITE)
    read = issuer.issue(request_id, 0, 1, holder_id=HOLDER_ID, rights=Rights.READ)
    with pytest.raises(tp.Rejected):
        worker.open(request_id, 0, 1, RECORD_BYTES, FP, FP, read)
    worker.open(request_id, 0, 1, RECORD_BYTES, FP, FP, write)
    assert worker.append(request_id, 0, 1, 0, *well_formed(0, 2, 3), write) == 2
    with pytest.raises(tp.Rejected):  # an append must present what its open verified
        worker.append(request_id, 0, 1, 2, *well_formed(2, 2, 3), read)
    with pytest.raises(tp.Rejected):
        worker.read(request_id, 0, 1, 0, 2, RECORD_BYTES, write)
    assert worker.read(request_id, 0, 1, 0, 2, RECORD_BYTES, read).records.shape[0] == 2
    with pytest.raises(tp.Rejected):
        worker.release(request_id, 0, 1, read)
    worker.release(request_id, 0, 1, write)


def test_a_copied_capability_does_not_let_another_connection_append_without_opening(
    issuer: CapabilityIssuer, holder: tp.Server, worker: tp.Client
) -> None:
    cap = issuer.issue(7, 0, 1, holder_id=HOLDER_ID)
    worker.open(7, 0, 1, RECORD_BYTES, FP, FP, cap)
    with tp.Client("127.0.0.1", holder.port, SECRET, tls=TLS) as other, pytest.raises(tp.Rejected):
        other.append(7, 0, 1, 0, *well_formed(0, 2, 9), cap)
    assert holder.stats()["tokens_committed"] == 0


def test_a_worker_cannot_fence_the_writer_or_plant_records_a_restore_accepts(
    issuer: CapabilityIssuer, holder: tp.Server, worker: tp.Client
) -> None:
    request_id = 8
    cap = issuer.issue(request_id, 0, 1, holder_id=HOLDER_ID)
    worker.open(request_id, 0, 1, RECORD_BYTES, FP, FP, cap)
    assert worker.append(request_id, 0, 1, 0, *well_formed(0, 4, 1), cap) == 4
    rogue_key = CapabilityIssuer.generate()
    with tp.Client("127.0.0.1", holder.port, SECRET, tls=TLS) as rogue:
        for epoch in (2, 2**32 - 1):  # a newer epoch would fence the writer
            minted = rogue_key.issue(request_id, 0, epoch, holder_id=HOLDER_ID)
            with pytest.raises(tp.Rejected):
                rogue.open(request_id, 0, epoch, RECORD_BYTES, FP, FP, minted)
            with pytest.raises(tp.Rejected):  # the right token ids and crcs, other records
                rogue.append(request_id, 0, epoch, 0, *well_formed(0, 8, 0xEE), minted)
            with pytest.raises(tp.Rejected):
                rogue.read(request_id, 0, epoch, 0, 1, RECORD_BYTES, minted)
    # Not fenced: the writer goes on at epoch 1, and the issuer's reader at epoch 2 (which
    # fences it now, as a re-route does) gets exactly what the writer wrote.
    assert worker.append(request_id, 0, 1, 4, *well_formed(4, 4, 2), cap) == 8
    reader = issuer.issue(request_id, 0, 2, holder_id=HOLDER_ID, rights=Rights.READ)
    out = np.zeros((8, RECORD_BYTES), np.uint8)
    result = worker.read(request_id, 0, 2, 0, 8, RECORD_BYTES, reader, out=out)
    assert result.records.shape[0] == 8 and (out[:4] == 1).all() and (out[4:] == 2).all()
    np.testing.assert_array_equal(result.token_ids, np.arange(8, dtype=np.uint32))
    with pytest.raises(tp.StaleEpoch):
        worker.append(request_id, 0, 1, 8, *well_formed(8, 1, 2), cap)


def test_reopening_with_a_fresh_capability_renews_the_grant(
    issuer: CapabilityIssuer, worker: tp.Client
) -> None:
    short = CapabilityIssuer(bytes(range(32)), ttl_s=1.0)
    with (
        tp.Server(
            SECRET, store=HolderStore(), holder_id=0, issuer_public_key=short.public_key, tls=TLS
        ) as server,
        tp.Client("127.0.0.1", server.port, SECRET, tls=TLS) as client,
    ):
        first = short.issue(9, 0, 1, holder_id=0)
        client.open(9, 0, 1, RECORD_BYTES, FP, FP, first)
        assert client.append(9, 0, 1, 0, *well_formed(0, 2, 1), first) == 2
        renewed = short.issue(9, 0, 1, holder_id=0, now_s=time.time() + 1.0)
        assert client.open(9, 0, 1, RECORD_BYTES, FP, FP, renewed) == 2  # same epoch: renewal
        time.sleep(1.2)  # the first has expired, the renewed one has not
        assert client.append(9, 0, 1, 2, *well_formed(2, 2, 1), renewed) == 4
        with pytest.raises(tp.Rejected):
            client.append(9, 0, 1, 4, *well_formed(4, 2, 1), first)
        time.sleep(1.0)  # now the renewed one has expired too: appends stop
        with pytest.raises(tp.Rejected):
            client.append(9, 0, 1, 4, *well_formed(4, 2, 1), renewed)


def test_a_holder_trusts_only_the_issuer_it_was_given(issuer: CapabilityIssuer) -> None:
    with tp.Server(SECRET, store=HolderStore(), holder_id=0, tls=TLS) as server:
        with tp.Client("127.0.0.1", server.port, SECRET, tls=TLS) as client:
            cap = issuer.issue(10, 0, 1, holder_id=0)
            with pytest.raises(tp.Rejected):  # no issuer yet: nothing is granted
                client.open(10, 0, 1, RECORD_BYTES, FP, FP, cap)
            server.trust_issuer(issuer.public_key)
            client.open(10, 0, 1, RECORD_BYTES, FP, FP, cap)
            restarted = CapabilityIssuer.generate()  # a restarted gateway's new key
            server.trust_issuer(restarted.public_key)
            with pytest.raises(tp.Rejected):
                client.read(10, 0, 1, 0, 1, RECORD_BYTES, issuer.issue(10, 0, 1, holder_id=0))
            client.read(10, 0, 1, 0, 1, RECORD_BYTES, restarted.issue(10, 0, 1, holder_id=0))
            assert server.stats()["bad_capability"] == 2
        with pytest.raises(ValueError, match=r"`public_key` must be 32 bytes, got 3"):
            server.trust_issuer(b"abc")
