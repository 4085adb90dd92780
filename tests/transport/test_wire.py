"""Wire header codec and Python-boundary validation (in process, no connection)."""

from __future__ import annotations

import struct

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lumen_core import _native
from lumen_core import transport as tp
from lumen_core.auth import CapabilityIssuer
from lumen_core.stream import HolderStore

pytestmark = [pytest.mark.ucx, pytest.mark.timeout(60)]

LIMITS = dict(max_tokens_per_message=1024, max_record_bytes=1 << 16, max_payload_bytes=1 << 24)
U32 = st.integers(0, 2**32 - 1)
U64 = st.integers(0, 2**64 - 1)

# Kind -> payload length it needs (num_tokens=4, record_bytes=16 where they matter).
KINDS = {1: 64, 2: 96, 3: 48, 4: 64, 5: 4 * (8 + 16), 6: 0, 7: 0, 8: 0, 9: 64 + 4 * 24, 10: 0}


def _native_module():
    return _native.require_ucx()


def _header(kind: int, **fields: int) -> bytes:
    values = dict(num_tokens=4, record_bytes=16, payload_bytes=KINDS[kind])
    if kind == 10:
        values["status"] = 1
    values.update(fields)
    return _native_module().encode_header(kind, **values)


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_valid_header_of_every_kind_decodes(kind: int) -> None:
    header = _header(kind, request_id=7, op_id=9, shard=2, epoch=3, start_pos=11)
    # The fields, their crc, then the seal (sequence number and MAC) every later message carries.
    assert len(header) == _native_module().HEADER_BYTES == 68 + tp.CAPABILITY_BYTES + 4 + 8 + 32 == 240
    decoded = _native_module().decode_header(header, KINDS[kind], **LIMITS)
    assert (decoded["kind"], decoded["request_id"], decoded["op_id"]) == (kind, 7, 9)
    assert (decoded["shard"], decoded["epoch"], decoded["start_pos"]) == (2, 3, 11)


@settings(max_examples=60, deadline=None)
@given(
    request_id=U64,
    op_id=U64,
    shard=U32,
    epoch=U32,
    start=st.integers(0, 2**63),
    num_tokens=st.integers(1, 1024),
    record_bytes=st.integers(1, 4096),
    capability=st.binary(min_size=128, max_size=128),
)
def test_append_header_round_trips_little_endian(
    request_id, op_id, shard, epoch, start, num_tokens, record_bytes, capability
):
    payload = num_tokens * (8 + record_bytes)
    header = _native_module().encode_header(
        5,
        request_id=request_id,
        op_id=op_id,
        shard=shard,
        epoch=epoch,
        start_pos=start,
        num_tokens=num_tokens,
        record_bytes=record_bytes,
        payload_bytes=payload,
        capability=capability,
    )
    # The layout is fixed little-endian (wire.h): check it byte by byte.
    assert struct.unpack_from("<IHHQQIIQIIQQI", header) == (
        0x4E4D554C,
        5,  # the version: worker identity in AUTH (4 sealed messages, 3 signed capabilities)
        5,
        request_id,
        op_id,
        shard,
        epoch,
        start,
        num_tokens,
        record_bytes,
        payload,
        0,
        0,
    )
    assert header[68:196] == capability
    assert header[200:240] == bytes(40)  # unsealed: the connection seals it as it sends
    decoded = _native_module().decode_header(header, payload, **LIMITS)
    assert (decoded["request_id"], decoded["num_tokens"], decoded["capability"]) == (
        request_id,
        num_tokens,
        capability,
    )


@settings(max_examples=200, deadline=None)
@given(position=st.integers(0, 199), flip=st.integers(1, 255))
def test_any_corrupted_byte_is_refused(position: int, flip: int) -> None:
    # Bytes [0, 200) are the fields and their crc; the seal after them is the session's to
    # check (tests/transport/test_seal.py).
    header = bytearray(_header(5))
    header[position] ^= flip
    with pytest.raises(ValueError, match="header must be valid"):
        _native_module().decode_header(bytes(header), KINDS[5], **LIMITS)


@pytest.mark.parametrize(
    "header_fields,payload,why",
    [
        (dict(kind=5, version=2), KINDS[5], "unsupported version"),  # the 104-byte header's
        (dict(kind=11), 0, "unknown kind"),
        (dict(kind=0), 0, "unknown kind"),
        (dict(kind=5), KINDS[5] - 1, "payload is"),
        (dict(kind=5, payload_bytes=KINDS[5] + 8), KINDS[5] + 8, "needs"),
        (dict(kind=5, num_tokens=2048, payload_bytes=2048 * 24), 2048 * 24, "num_tokens over"),
        (
            dict(kind=5, record_bytes=1 << 17, num_tokens=1, payload_bytes=(1 << 17) + 8),
            (1 << 17) + 8,
            "record_bytes over",
        ),
        (
            dict(kind=5, num_tokens=1024, record_bytes=1 << 16, payload_bytes=1024 * ((1 << 16) + 8)),
            1024 * ((1 << 16) + 8),
            "payload over",
        ),
        (dict(kind=5, num_tokens=0, payload_bytes=0), 0, "empty append"),
        (dict(kind=5, start_pos=2**64 - 2), KINDS[5], "overflows"),
        (dict(kind=4, record_bytes=0), 64, "record_bytes 0"),
        (dict(kind=7, num_tokens=0), 0, "read of 0 tokens"),
        (dict(kind=10, status=0), 0, "error reply with status"),
        (dict(kind=10, status=99), 0, "error reply with status"),
        (dict(kind=6, status=3), 0, "non-zero status"),
    ],
)
def test_invalid_field_is_refused_with_its_reason(header_fields, payload, why) -> None:
    fields = dict(header_fields)
    kind = fields.pop("kind")
    header = _header(kind, **fields) if kind in KINDS else _native_module().encode_header(kind)
    with pytest.raises(ValueError, match=why):
        _native_module().decode_header(header, payload, **LIMITS)


@settings(max_examples=100, deadline=None)
@given(data=st.binary(min_size=0, max_size=200), payload=st.integers(0, 1 << 20))
def test_random_bytes_are_refused(data: bytes, payload: int) -> None:
    with pytest.raises(ValueError, match="header must be valid"):
        _native_module().decode_header(data, payload, **LIMITS)


@pytest.mark.parametrize(
    "secret,error,match",
    [
        (None, ValueError, "no default cluster secret"),
        (b"", ValueError, "at least 16 bytes, got 0"),
        (b"x" * 15, ValueError, "at least 16 bytes, got 15"),
        ("a-string-secret-of-32-characters", TypeError, "`secret` must be bytes, got str"),
    ],
)
def test_no_default_or_short_secret(issuer: CapabilityIssuer, secret, error, match) -> None:
    with pytest.raises(error, match=match):
        tp.Server(secret, issuer_public_key=issuer.public_key, store=HolderStore())
    with pytest.raises(error, match=match):
        tp.Client("127.0.0.1", 1, secret)


def test_native_server_refuses_short_secret() -> None:
    with pytest.raises(ValueError, match="at least 16 bytes"):
        native = _native_module()
        store = native.HolderStore(budget_bytes=1 << 20, policy=0, chunk_bytes=1 << 21, pinned=False)
        options = native.ServerOptions(
            secret=b"short",
            holder_id=0,
            issuer_public_key=None,
            address="127.0.0.1",
            port=0,
            tls="tcp",
            verify_records=True,
            handshake_timeout_s=10.0,
            max_unauthenticated=64,
            receive_timeout_s=30.0,
            **LIMITS,
        )
        native.serve_holder_store(store, options)


@pytest.mark.parametrize(
    "field,value,error,match",
    [
        ("max_tokens_per_message", 0, ValueError, r"`max_tokens_per_message` must be in \[1, "),
        ("max_record_bytes", 2**32, ValueError, r"`max_record_bytes` must be in \[1, "),
        ("max_payload_bytes", 1.5, TypeError, "`max_payload_bytes` must be an int, got float"),
    ],
)
def test_wire_limits_validation(field, value, error, match) -> None:
    with pytest.raises(error, match=match):
        tp.WireLimits(**{field: value})


def test_server_argument_validation(issuer: CapabilityIssuer) -> None:
    secret = b"k" * 32
    with pytest.raises(TypeError, match="address must be a str, got int"):
        tp.Server(secret, issuer_public_key=issuer.public_key, store=HolderStore(), address=1)
    with pytest.raises(ValueError, match=r"`port` must be in \[0, 65535\], got 70000"):
        tp.Server(secret, issuer_public_key=issuer.public_key, store=HolderStore(), port=70000)
    with pytest.raises(TypeError, match="tls must be a str, got NoneType"):
        tp.Server(secret, issuer_public_key=issuer.public_key, store=HolderStore(), tls=None)
    with pytest.raises(TypeError, match="limits must be a WireLimits, got dict"):
        tp.Server(secret, issuer_public_key=issuer.public_key, store=HolderStore(), limits={})
    with pytest.raises(ValueError, match="address must be a host name or IP address"):
        tp.Server(
            secret, issuer_public_key=issuer.public_key, store=HolderStore(), address="no such host.invalid"
        )
    with pytest.raises(ValueError, match=r"`handshake_timeout_s` must be in \(0, 1000000.0\] seconds, got 0"):
        tp.Server(secret, issuer_public_key=issuer.public_key, store=HolderStore(), handshake_timeout_s=0)
    with pytest.raises(TypeError, match="`handshake_timeout_s` must be a number, got str"):
        tp.Server(secret, issuer_public_key=issuer.public_key, store=HolderStore(), handshake_timeout_s="1")


def test_client_argument_validation() -> None:
    secret = b"k" * 32
    with pytest.raises(ValueError, match=r"`port` must be in \[1, 65535\], got 0"):
        tp.Client("127.0.0.1", 0, secret)
    with pytest.raises(ValueError, match=r"`connect_timeout_s` must be in \(0, 1000000.0\] seconds, got 0"):
        tp.Client("127.0.0.1", 1, secret, connect_timeout_s=0)
    with pytest.raises(TypeError, match="limits must be a WireLimits, got int"):
        tp.Client("127.0.0.1", 1, secret, limits=3)
    with pytest.raises(TypeError, match="address must be a str, got bytes"):
        tp.Client(b"127.0.0.1", 1, secret)


def test_connect_to_nothing_is_peer_gone_or_timeout() -> None:
    with tp.Server(b"k" * 32, store=HolderStore(), tls="tcp") as server:
        port = server.port
    with pytest.raises((tp.PeerGone, tp.Timeout)):
        tp.Client("127.0.0.1", port, b"k" * 32, tls="tcp", connect_timeout_s=3.0)


def test_invalid_arguments_never_reach_native(issuer: CapabilityIssuer) -> None:
    secret = b"k" * 32
    with (
        tp.Server(secret, issuer_public_key=issuer.public_key, store=HolderStore(), tls="tcp") as server,
        tp.Client("127.0.0.1", server.port, secret, tls="tcp") as client,
    ):
        cap = issuer.issue(1, 0, 0, holder_id=0)
        records = np.zeros((4, 16), dtype=np.uint8)
        ids = np.zeros(4, dtype=np.uint32)
        cases = [
            (dict(records=records.astype(np.int8)), ValueError, "records must have dtype uint8"),
            (dict(records=records[:, ::2]), ValueError, "records must be C-contiguous"),
            (dict(records=records.ravel()), ValueError, "records must have 2 dimension"),
            (
                dict(records=np.zeros((0, 16), np.uint8), token_ids=ids[:0], crcs=ids[:0]),
                ValueError,
                "records must hold 1 to",
            ),
            (dict(records=[[0]]), TypeError, "records must be a numpy.ndarray, got list"),
            (dict(token_ids=ids.astype(np.int64)), ValueError, "token_ids must have dtype uint32"),
            (dict(crcs=ids[:3]), ValueError, "crcs must have 4 entries, got 3"),
            (dict(capability=cap[:31]), ValueError, "`capability` must be 128 bytes, got 31"),
            (dict(request_id=-1), ValueError, r"`request_id` must be in \[0, "),
            (dict(shard=2**32), ValueError, r"`shard` must be in \[0, "),
            (dict(epoch="1"), TypeError, "`epoch` must be an int, got str"),
            (dict(start_pos=True), TypeError, "`start_pos` must be an int, got bool"),
        ]
        for override, error, match in cases:
            args = dict(
                request_id=1,
                shard=0,
                epoch=0,
                start_pos=0,
                token_ids=ids,
                crcs=ids,
                records=records,
                capability=cap,
            )
            args.update(override)
            with pytest.raises(error, match=match):
                client.start_append(**args)
        with pytest.raises(ValueError, match="`layout_fingerprint` must be 32 bytes, got 3"):
            client.open(1, 0, 0, 16, b"abc", bytes(32), cap)
        with pytest.raises(ValueError, match=r"`record_bytes` must be in \[1, "):
            client.open(1, 0, 0, 0, bytes(32), bytes(32), cap)
        with pytest.raises(ValueError, match=r"`timeout_s` must be in \(0, 1000000.0\] seconds, got -1"):
            client.release(1, 0, 0, cap, timeout_s=-1)
        with pytest.raises(ValueError, match=r"out must have shape \(4, 16\), got \(4, 8\)"):
            client.read(1, 0, 0, 0, 4, 16, cap, out=np.zeros((4, 8), np.uint8))
        with pytest.raises(ValueError, match=r"`max_tokens` must be in \[1, "):
            client.read(1, 0, 0, 0, 0, 16, cap)
        with pytest.raises(ValueError, match="op_id must be a started, unwaited append"):
            client.wait(12345)
        assert client.connected
