"""lumen_core.auth: cluster secret files and capabilities, with their wire bytes pinned (a
changed label would break peers of another build). Call signatures, call keys and assist
seals: tests/test_auth_gateway.py."""

import os
import stat

import pytest

from lumen_core import _native
from lumen_core.auth import check_secret, issue_capability, read_secret_file, write_secret_file

pytestmark = pytest.mark.timeout(60)

SECRET = b"0123456789abcdef-cluster"

# Produced by the native transport (lumen_core.transport.issue_capability over OpenSSL).
KNOWN_CAPABILITIES = [
    ((SECRET, 123456789012, 3, 7), "da2158404feccd232bf8218b44f27ce020a3da9a76dc75319ebdd22925e0081c"),
    (
        (bytes(range(32)), 2**64 - 1, 2**32 - 1, 0),
        "331e3018a70cbefaa9b99377fbd0ec65b5b66696bb742555c9ba20eb4ff7751e",
    ),
]


@pytest.mark.parametrize(("args", "expected"), KNOWN_CAPABILITIES)
def test_capability_matches_the_native_transports_bytes(args, expected):
    assert issue_capability(*args).hex() == expected


@pytest.mark.ucx
@pytest.mark.skipif(not _native.HAS_UCX, reason="native UCX transport not built")
def test_capability_equals_the_native_one_over_many_keys():
    from lumen_core.transport import issue_capability as native_issue_capability

    for request_id, shard, epoch in [
        (0, 0, 0),
        (1, 0, 1),
        (2**40 + 5, 7, 123),
        (2**64 - 1, 2**32 - 1, 2**32 - 1),
    ]:
        assert issue_capability(SECRET, request_id, shard, epoch) == native_issue_capability(
            SECRET, request_id, shard, epoch
        )


def test_capability_binds_every_field():
    base = issue_capability(SECRET, 5, 0, 1)
    assert len(base) == 32
    others = {
        issue_capability(SECRET, 6, 0, 1),
        issue_capability(SECRET, 5, 1, 1),
        issue_capability(SECRET, 5, 0, 2),
    }
    others.add(issue_capability(SECRET + b"x", 5, 0, 1))
    assert base not in others and len(others) == 4


def test_capability_validation():
    with pytest.raises(ValueError, match="`secret` must be given, got None: there is no default"):
        issue_capability(None, 1, 0, 1)
    with pytest.raises(TypeError, match="`secret` must be bytes, got str"):
        issue_capability("secret-as-a-string", 1, 0, 1)
    with pytest.raises(ValueError, match="`secret` must be at least 16 bytes, got 3"):
        issue_capability(b"abc", 1, 0, 1)
    with pytest.raises(TypeError, match="`request_id` must be an int, got float"):
        issue_capability(SECRET, 1.0, 0, 1)
    with pytest.raises(ValueError, match=r"`shard` must be in \[0, 4294967295\], got -1"):
        issue_capability(SECRET, 1, -1, 1)
    with pytest.raises(ValueError, match=r"`epoch` must be in \[0, 4294967295\], got 4294967296"):
        issue_capability(SECRET, 1, 0, 2**32)


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
