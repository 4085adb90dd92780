"""The cluster secret: one definition for the gateway, the transport and the holders.

There is no default secret (DESIGN.md section 3.3): ``write_secret_file`` writes random bytes
to a new 0600 file, ``read_secret_file`` refuses a file others can access and a secret under
``MIN_SECRET_BYTES``.
"""

from __future__ import annotations

import os
import secrets
import stat
from pathlib import Path

MIN_SECRET_BYTES = 16
SECRET_FILE_BYTES = 32


def check_secret(secret: object) -> bytes:
    """The secret as bytes. Raises ValueError for None (no default) or under 16 bytes,
    TypeError for anything but bytes."""
    if secret is None:
        raise ValueError("secret must be given: there is no default cluster secret")
    if not isinstance(secret, (bytes, bytearray)):
        raise TypeError(f"secret must be bytes, got {type(secret).__name__}")
    if len(secret) < MIN_SECRET_BYTES:
        raise ValueError(f"secret must be at least {MIN_SECRET_BYTES} bytes, got {len(secret)}")
    return bytes(secret)


def write_secret_file(path: str | os.PathLike[str], *, num_bytes: int = SECRET_FILE_BYTES) -> bytes:
    """Create ``path`` (0600, must not exist) holding ``num_bytes`` random bytes; return them.
    Raises FileExistsError rather than overwrite a secret other processes may be using."""
    if isinstance(num_bytes, bool) or not isinstance(num_bytes, int):
        raise TypeError(f"num_bytes must be an int, got {type(num_bytes).__name__}")
    if num_bytes < MIN_SECRET_BYTES:
        raise ValueError(f"num_bytes must be >= {MIN_SECRET_BYTES}, got {num_bytes}")
    if num_bytes > 1 << 20:
        raise ValueError(f"num_bytes must be <= {1 << 20}, got {num_bytes}")
    secret = secrets.token_bytes(num_bytes)
    fd = os.open(os.fspath(path), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as handle:
        handle.write(secret)
    return secret


def read_secret_file(path: str | os.PathLike[str]) -> bytes:
    """The cluster secret stored in ``path``. Raises FileNotFoundError, PermissionError for a
    file its group or others can access, ValueError for a secret under 16 bytes."""
    file = Path(path)
    mode = file.stat().st_mode
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise PermissionError(
            f"secret file must be accessible by its owner only (0600), got {oct(mode & 0o777)}"
        )
    return check_secret(file.read_bytes())
