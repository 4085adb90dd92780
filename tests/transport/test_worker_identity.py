"""Worker identity on the data plane (docs/security.md, "Worker identity"): a capability the
issuer bound to a worker serves only connections that prove that worker's credential. The
peers here hold the cluster secret and capabilities copied off the network; what refuses them
is the identity alone."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest
from checkpoint_records import RECORD_BYTES, SECRET, TLS, trusting_holder, well_formed

from lumen_core import _native
from lumen_core import transport as tp
from lumen_core.auth import CapabilityIssuer, WorkerIdentity, verify_capability, verify_credential
from lumen_core.stream import HolderStore

pytestmark = [pytest.mark.ucx, pytest.mark.timeout(60)]

HOLDER_ID = 4
FP = bytes(32)
WRITER, OTHER = 1, 2


def _identity(issuer: CapabilityIssuer, worker_id: int) -> WorkerIdentity:
    identity = WorkerIdentity()
    identity.accept(issuer.issue_credential(worker_id, 1, identity.public_key), issuer.public_key, worker_id)
    return identity


@pytest.fixture
def holder(issuer: CapabilityIssuer) -> Iterator[tp.Server]:
    with trusting_holder(issuer, HOLDER_ID) as server:
        yield server


def _connect(holder: tp.Server, identity: WorkerIdentity | None = None) -> tp.Client:
    return tp.Client("127.0.0.1", holder.port, SECRET, tls=TLS, identity=identity)


def test_a_bound_capability_serves_only_the_connections_of_its_worker(
    issuer: CapabilityIssuer, holder: tp.Server
) -> None:
    request_id = 11
    cap = issuer.issue(request_id, 0, 1, holder_id=HOLDER_ID, bearer=WRITER)
    assert verify_capability(issuer.public_key, cap).bearer == WRITER
    with (
        _connect(holder, _identity(issuer, WRITER)) as writer,
        _connect(holder, _identity(issuer, OTHER)) as other,
        _connect(holder) as anonymous,
    ):
        assert writer.open(request_id, 0, 1, RECORD_BYTES, FP, FP, cap) == 0
        assert writer.append(request_id, 0, 1, 0, *well_formed(0, 4, 1), cap) == 4
        # Another worker with its own valid credential, and a connection that proves only
        # the secret, both holding the writer's capability copied off the network.
        for rogue in (other, anonymous):
            with pytest.raises(tp.Rejected):
                rogue.open(request_id, 0, 1, RECORD_BYTES, FP, FP, cap)
            with pytest.raises(tp.Rejected):  # the right ids and crcs, other records
                rogue.append(request_id, 0, 1, 4, *well_formed(4, 4, 0xEE), cap)
            with pytest.raises(tp.Rejected):
                rogue.read(request_id, 0, 1, 0, 4, RECORD_BYTES, cap)
            with pytest.raises(tp.Rejected):
                rogue.release(request_id, 0, 1, cap)
        out = np.zeros((8, RECORD_BYTES), np.uint8)
        result = writer.read(request_id, 0, 1, 0, 8, RECORD_BYTES, cap, out=out)
        assert result.records.shape[0] == 4 and (out[:4] == 1).all() and not out[4:].any()
    stats = holder.stats()
    assert stats["identified"] == 2 and stats["bad_credentials"] == 0
    assert stats["capability_refused"] == 2 * 4 and stats["tokens_committed"] == 4
    # An unbound capability (a gateway-less issuer's) still serves any authenticated peer.
    with _connect(holder) as anonymous:
        anonymous.open(
            request_id + 1,
            0,
            1,
            RECORD_BYTES,
            FP,
            FP,
            issuer.issue(request_id + 1, 0, 1, holder_id=HOLDER_ID),
        )


def _native_client(holder: tp.Server, credential: bytes, identity_key: bytes) -> object:
    """A connection that claims ``credential`` and signs its proof with ``identity_key``,
    whatever they are (``WorkerIdentity`` refuses a pair that does not match)."""
    return _native.require_ucx().Client(
        address="127.0.0.1",
        port=holder.port,
        secret=SECRET,
        tls=TLS,
        connect_timeout_s=5.0,
        max_tokens_per_message=1 << 16,
        max_record_bytes=1 << 24,
        max_payload_bytes=1 << 30,
        credential=credential,
        identity_key=identity_key,
    )


def test_a_credential_identifies_only_the_holder_of_its_key(
    issuer: CapabilityIssuer, holder: tp.Server
) -> None:
    writer = WorkerIdentity()
    credential = issuer.issue_credential(WRITER, 1, writer.public_key)
    rogue_key = bytes(_native.require_ucx().generate_ed25519_key())
    minted = CapabilityIssuer.generate().issue_credential(
        WRITER, 1, bytes(_native.require_ucx().ed25519_public_key(rogue_key))
    )
    for claimed, key in ((credential, rogue_key), (minted, rogue_key)):  # copied, self-signed
        with pytest.raises(tp.Rejected):
            _native_client(holder, claimed, key)
    stats = holder.stats()
    assert stats["bad_credentials"] == 2 and stats["identified"] == 0 and stats["handshakes_ok"] == 0


def test_a_holder_without_an_issuer_refuses_every_identity(issuer: CapabilityIssuer) -> None:
    with tp.Server(SECRET, store=HolderStore(), holder_id=0, tls=TLS) as server:
        with pytest.raises(tp.Rejected):
            _connect(server, _identity(issuer, WRITER))
        assert server.stats()["bad_credentials"] == 1


def test_worker_identity_takes_only_its_own_credential(issuer: CapabilityIssuer) -> None:
    identity = WorkerIdentity()
    assert identity.credential is None and identity.native_kwargs() == {}
    other = WorkerIdentity()
    for credential, worker_id in (
        (issuer.issue_credential(WRITER, 1, other.public_key), WRITER),  # another key's
        (issuer.issue_credential(OTHER, 1, identity.public_key), WRITER),  # another worker's
    ):
        with pytest.raises(ValueError, match="names worker"):
            identity.accept(credential, issuer.public_key, worker_id)
    with pytest.raises(ValueError, match="signed by the issuer"):
        identity.accept(
            CapabilityIssuer.generate().issue_credential(WRITER, 1, identity.public_key),
            issuer.public_key,
            WRITER,
        )
    with pytest.raises(ValueError, match="label"):  # a capability is never a credential
        verify_credential(issuer.public_key, issuer.issue(1, 0, 1, holder_id=0))
    assert identity.credential is None
    assert "private" not in repr(identity) and identity.public_key.hex()[:16] in repr(identity)
