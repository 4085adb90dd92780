"""lumen_core.auth: cluster secret files, the capability issuer, call signatures and assist
seals, with their wire bytes pinned (a changed label would break peers of another build)."""

import hashlib
import hmac
import json
import os
import stat

import pytest

from lumen_core import _native
from lumen_core.auth import (
    CallVerifier,
    CapabilityFields,
    CapabilityIssuer,
    Rights,
    check_secret,
    read_secret_file,
    seal,
    sign_call,
    unseal,
    verify_capability,
    write_secret_file,
)

pytestmark = pytest.mark.timeout(60)

SECRET = b"0123456789abcdef-cluster"
METHOD = "/lumen.gateway.v1.Gateway/Heartbeat"

# RFC 8032 section 7.1, test 1: the issuer's keys are plain Ed25519 keys.
RFC8032_SECRET_KEY = bytes.fromhex("9d61b19deffd5a60ba844af492ec2cc44449c5697b326919703bac031cae7f60")
RFC8032_PUBLIC_KEY = "d75a980182b10ab7d54bfed3c964073a0ee172f3daa62325af021a68f707511a"
# The capability that key issues for (123456789012, shard 3, epoch 7) on holder 9, write and
# read, expiring at 1.8e9 + 60 s: Ed25519 is deterministic, so these bytes are wire format.
KNOWN_CAPABILITY = (
    "6c756d656e636170141a99be1c000000030000000700000009000000000000000300000000000000603a5d18a301"
    "0000000000000000000000000000000000002ce98daf02f240e1c976b16790aa4be49af704b37da7f6b0b249a488"
    "90aaa24837ed388436771c3f63519f9ab1be4eed6c02625549b2428610f1564e54f56d01"
)


@pytest.mark.ucx
@pytest.mark.skipif(not _native.HAS_UCX, reason="native UCX transport not built")
def test_capability_bytes_are_pinned():
    issuer = CapabilityIssuer(RFC8032_SECRET_KEY, ttl_s=60.0)
    assert issuer.public_key.hex() == RFC8032_PUBLIC_KEY
    capability = issuer.issue(123456789012, 3, 7, holder_id=9, rights=Rights.WRITE | Rights.READ, now_s=1.8e9)
    assert capability.hex() == KNOWN_CAPABILITY
    assert verify_capability(issuer.public_key, capability) == CapabilityFields(
        123456789012, 3, 7, 9, Rights.WRITE | Rights.READ, 1_800_000_060_000
    )


@pytest.mark.ucx
@pytest.mark.skipif(not _native.HAS_UCX, reason="native UCX transport not built")
def test_capability_validation():
    issuer = CapabilityIssuer(RFC8032_SECRET_KEY)
    with pytest.raises(TypeError, match="`private_key` must be bytes, got str"):
        CapabilityIssuer("a-key")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="`request_id` must be an int, got float"):
        issuer.issue(1.0, 0, 1, holder_id=0)
    with pytest.raises(ValueError, match=r"`shard` must be in \[0, 4294967295\], got -1"):
        issuer.issue(1, -1, 1, holder_id=0)
    with pytest.raises(ValueError, match=r"`epoch` must be in \[0, 4294967295\], got 4294967296"):
        issuer.issue(1, 0, 2**32, holder_id=0)
    with pytest.raises(ValueError, match="`capability` must be 128 bytes, got 32"):
        verify_capability(issuer.public_key, bytes(32))
    with pytest.raises(TypeError, match="missing 1 required keyword-only argument: 'holder_id'"):
        issuer.issue(1, 0, 1)  # type: ignore[call-arg]


def test_secret_file_is_private_random_and_never_overwritten(tmp_path):
    path = tmp_path / "cluster.secret"
    secret = write_secret_file(path)
    assert len(secret) == 32 and stat.S_IMODE(path.stat().st_mode) == 0o600
    assert read_secret_file(path) == secret
    assert write_secret_file(tmp_path / "other.secret") != secret
    with pytest.raises(FileExistsError):
        write_secret_file(path)
    with pytest.raises(TypeError, match="`num_bytes` must be an int, got float"):
        write_secret_file(tmp_path / "float.secret", num_bytes=32.0)
    with pytest.raises(ValueError, match=r"`num_bytes` must be in \[16, 1048576\], got 8"):
        write_secret_file(tmp_path / "short.secret", num_bytes=8)


def test_secret_file_refused_when_others_can_read_it_or_it_is_short(tmp_path):
    path = tmp_path / "open.secret"
    path.write_bytes(SECRET)
    os.chmod(path, 0o644)
    with pytest.raises(PermissionError, match=r"owner only \(0600\), got 0o644"):
        read_secret_file(path)
    short = tmp_path / "short.secret"
    short.write_bytes(b"tiny")
    os.chmod(short, 0o600)
    with pytest.raises(ValueError, match="at least 16 bytes, got 4"):
        read_secret_file(short)
    with pytest.raises(FileNotFoundError):
        read_secret_file(tmp_path / "missing.secret")
    assert check_secret(bytearray(SECRET)) == SECRET


def test_call_signature_accepted_once_and_only_with_the_secret():
    verifier = CallVerifier(SECRET, max_skew_s=30.0)
    value = sign_call(SECRET, METHOD, now_s=1000.0)
    assert verifier.verify(METHOD, value, now_s=1010.0) is None
    assert verifier.verify(METHOD, value, now_s=1010.0) == "nonce replayed"
    assert verifier.verify(
        "/lumen.gateway.v1.Gateway/Register", sign_call(SECRET, METHOD, now_s=1000.0), now_s=1000.0
    ) == ("bad MAC: the caller does not hold the cluster secret")  # signed for another method
    forged = sign_call(b"some-other-secret-entirely", METHOD, now_s=1000.0)
    assert verifier.verify(METHOD, forged, now_s=1000.0).startswith("bad MAC")
    late = sign_call(SECRET, METHOD, now_s=1000.0)
    assert "more than 30.0 s from now" in verifier.verify(METHOD, late, now_s=1031.0)
    assert verifier.verify(METHOD, None) == "missing lumen-auth-v1 metadata"
    assert verifier.verify(METHOD, "a.b.c") == "malformed lumen-auth-v1 metadata"
    assert verifier.num_refused == 6


def test_call_verifier_forgets_old_nonces_but_still_refuses_old_calls():
    verifier = CallVerifier(SECRET, max_skew_s=1.0)
    first = sign_call(SECRET, METHOD, now_s=0.0)
    assert verifier.verify(METHOD, first, now_s=0.0) is None
    for _ in range(4100):
        assert verifier.verify(METHOD, sign_call(SECRET, METHOD, now_s=10.0), now_s=10.0) is None
    assert verifier.num_nonces < 4200
    assert verifier.verify(METHOD, first, now_s=10.0).startswith("timestamp")
    with pytest.raises(ValueError, match="`max_skew_s` must be > 0, got 0"):
        CallVerifier(SECRET, max_skew_s=0)
    with pytest.raises(TypeError, match="`max_skew_s` must be a number, got str"):
        CallVerifier(SECRET, max_skew_s="30")


def test_call_mac_covers_the_label_method_time_and_nonce():
    value = sign_call(SECRET, METHOD, now_s=1234.5)
    seconds, fraction, nonce, mac = value.split(".")
    timestamp = f"{seconds}.{fraction}"
    message = b"lumen-gateway-v1|" + METHOD.encode() + b"|" + timestamp.encode() + b"|" + nonce.encode()
    assert timestamp == "1234.500000" and len(nonce) == 32
    assert mac == hmac.new(SECRET, message, hashlib.sha256).hexdigest()


def test_seal_is_the_mac_of_the_label_and_payload_then_the_payload():
    message = {"r": [[1, 0, [5, 6], 0, 0]], "f": []}
    sealed = seal(SECRET, message)
    payload = json.dumps(message).encode()
    assert sealed == hmac.new(SECRET, b"lumen-assist-v1|" + payload, hashlib.sha256).digest() + payload


def test_seal_round_trip_and_refusals():
    message = {"r": [[1, 0, [5, 6], 0, 0]], "f": []}
    sealed = seal(SECRET, message)
    assert unseal(SECRET, sealed) == message
    assert unseal(b"another-cluster-secret-000000", sealed) is None
    tampered = sealed[:-2] + b"9]"
    assert unseal(SECRET, tampered) is None
    assert unseal(SECRET, sealed[:10]) is None
    assert unseal(SECRET, seal(SECRET, {"r": []})[:32] + b"not json") is None
    assert unseal(SECRET, seal(SECRET, {"r": []})[:32] + b"[1, 2]") is None  # MAC'd but no object
