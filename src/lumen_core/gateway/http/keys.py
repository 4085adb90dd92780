"""Client API keys: read from a file that only its owner may read, checked in constant time.

They are separate from the cluster secret: a client holding one can call ``/v1/*`` and nothing
else (no gRPC call, no checkpoint capability).
"""

from __future__ import annotations

import hmac
import os

from lumen_core.auth import read_secret_file

MIN_KEY_CHARS = 16


def read_api_key_file(path: str | os.PathLike[str]) -> frozenset[str]:
    """The keys in ``path``, one per line (blank lines and ``#`` comments skipped). The file is
    checked as the cluster secret's is (``auth.read_secret_file``: FileNotFoundError,
    PermissionError unless mode 0600). Raises ValueError for a key under 16 characters, one with
    whitespace or a non-ASCII character, or a file with no key."""
    keys = set()
    for number, line in enumerate(read_secret_file(path).decode("utf-8", "replace").splitlines(), 1):
        key = line.strip()
        if not key or key.startswith("#"):
            continue
        if len(key) < MIN_KEY_CHARS or not key.isascii() or any(c.isspace() for c in key):
            raise ValueError(
                f"line {number} of the API key file must be one key of >= {MIN_KEY_CHARS} ASCII characters "
                f"without spaces, got {len(key)} characters"
            )
        keys.add(key)
    if not keys:
        raise ValueError(f"the API key file must hold at least one key, got none in {os.fspath(path)!r}")
    return frozenset(keys)


def key_matches(keys: frozenset[str], authorization: str | None) -> bool:
    """Whether an ``Authorization`` header value is ``Bearer <one of keys>`` (every key is
    compared, in constant time, so the timing says nothing about which one was close)."""
    if authorization is None or not authorization.startswith("Bearer "):
        return False
    given = authorization[len("Bearer ") :].strip().encode()
    matched = False
    for key in keys:
        matched |= hmac.compare_digest(given, key.encode())
    return matched
