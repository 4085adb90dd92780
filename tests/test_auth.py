"""lumen_core.auth: cluster secret files and the capability issuer, with their wire bytes pinned
(a changed label would break peers of another build). Call signatures, call keys and assist
seals: tests/test_auth_gateway.py."""

import os
import stat

import pytest

from lumen_core import _native
from lumen_core.auth import (
    CapabilityFields,
    CapabilityIssuer,
    CredentialFields,
    Rights,
    check_secret,
    read_secret_file,
    verify_capability,
    verify_credential,
    write_secret_file,
)

pytestmark = pytest.mark.timeout(60)

SECRET = b"0123456789abcdef-cluster"

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
# The same bound to worker 5 (flags 1 at offset 36, bearer 5 at offset 48).
KNOWN_BOUND_CAPABILITY = (
    "6c756d656e636170141a99be1c000000030000000700000009000000000000000300000001000000603a5d18a301"
    "00000500000000000000000000000000000064d2859db17c38808866e9091277572cde2070253d42a3ceb921aa97"
    "35206ae86aa3fbe76741a4f02439ed2a816b0d6b20e8d3c0077739937b772ae9a5db2506"
)
# The credential it issues to worker 5 at epoch 2 for the RFC 8032 public key.
KNOWN_CREDENTIAL = (
    "6c756d656e77696405000000000000000200000000000000d75a980182b10ab7d54bfed3c964073a0ee172f3daa6"
    "2325af021a68f707511a000000000000000060d99f2ea6c1ddaeb4d647b1c5bcd3a5ca79ac8d1029e1a5d5c79128"
    "bcee05a48f7de16506f6a794c219ff327a16d69d1180208ef522e1b82645dc0f8684fe0c"
)


@pytest.mark.ucx
@pytest.mark.skipif(not _native.HAS_UCX, reason="native UCX transport not built")
def test_capability_bytes_are_pinned():
    issuer = CapabilityIssuer(RFC8032_SECRET_KEY, ttl_s=60.0)
    assert issuer.public_key.hex() == RFC8032_PUBLIC_KEY
    capability = issuer.issue(123456789012, 3, 7, holder_id=9, rights=Rights.WRITE | Rights.READ, now_s=1.8e9)
    assert capability.hex() == KNOWN_CAPABILITY
    assert verify_capability(issuer.public_key, capability) == CapabilityFields(
        123456789012, 3, 7, 9, Rights.WRITE | Rights.READ, 1_800_000_060_000, None
    )
    bound = issuer.issue(
        123456789012, 3, 7, holder_id=9, rights=Rights.WRITE | Rights.READ, bearer=5, now_s=1.8e9
    )
    assert bound.hex() == KNOWN_BOUND_CAPABILITY
    assert verify_capability(issuer.public_key, bound).bearer == 5
    credential = issuer.issue_credential(5, 2, bytes.fromhex(RFC8032_PUBLIC_KEY))
    assert credential.hex() == KNOWN_CREDENTIAL
    assert verify_credential(issuer.public_key, credential) == CredentialFields(
        5, 2, bytes.fromhex(RFC8032_PUBLIC_KEY)
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


def test_secret_file_that_is_a_link_is_refused_even_to_a_private_file(tmp_path):
    target = tmp_path / "real.secret"
    write_secret_file(target)
    link = tmp_path / "link.secret"
    link.symlink_to(target)
    with pytest.raises(PermissionError, match="`path` must not be a symbolic link"):
        read_secret_file(link)
    fifo = tmp_path / "fifo.secret"
    os.mkfifo(fifo, 0o600)
    with pytest.raises(PermissionError, match="`path` must be a regular file"):
        read_secret_file(fifo)  # opened without blocking, refused on what was opened


def test_secret_file_in_a_directory_others_can_write_is_refused_unless_sticky(tmp_path):
    shared = tmp_path / "shared"
    shared.mkdir()
    write_secret_file(shared / "cluster.secret")
    for mode in (0o777, 0o770):
        os.chmod(shared, mode)
        with pytest.raises(PermissionError, match=f"cannot write to \\(or a sticky one\\), got {oct(mode)}"):
            read_secret_file(shared / "cluster.secret")
    os.chmod(shared, 0o1777)  # as /tmp: nobody else can rename or replace the file
    assert len(read_secret_file(shared / "cluster.secret")) == 32
    os.chmod(shared, 0o700)


@pytest.mark.skipif(os.geteuid() != 0, reason="making a file another user's owns takes root")
def test_secret_file_owned_by_another_user_is_refused(tmp_path):
    path = tmp_path / "theirs.secret"
    write_secret_file(path)
    os.chown(path, 65534, 65534)
    with pytest.raises(PermissionError, match="`path` must be owned by this user"):
        read_secret_file(path)
