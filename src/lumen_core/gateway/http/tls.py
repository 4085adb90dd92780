"""The front door's TLS: a certificate chain and its private key, checked before uvicorn
serves them.

The key file is checked as the cluster secret's is (``auth.read_secret_file``: a regular file
of this user, mode 0600, no symbolic link): a private key others can read is refused, not
served. The pair is loaded once here so that a wrong or mismatched file is a clear error at
start, not a failed handshake for every client.
"""

from __future__ import annotations

import os
import ssl
from dataclasses import dataclass

from lumen_core.auth import read_secret_file


@dataclass(frozen=True)
class TLSFiles:
    """``cert_file``: the server's certificate chain (PEM); ``key_file``: its private key (PEM,
    0600). Raises FileNotFoundError, PermissionError for a key file others can access, and
    ValueError for files that are not a certificate and its key."""

    cert_file: str
    key_file: str

    def __post_init__(self) -> None:
        for name in ("cert_file", "key_file"):
            value = getattr(self, name)
            if not isinstance(value, (str, os.PathLike)):
                raise TypeError(f"`{name}` must be a path, got {type(value).__name__}")
            object.__setattr__(self, name, os.fspath(value))
        read_secret_file(self.key_file)  # the permission checks; its bytes are ssl's to read
        if not os.path.isfile(self.cert_file):
            raise FileNotFoundError(f"`cert_file` must be a file, got {self.cert_file!r}")
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        try:
            context.load_cert_chain(self.cert_file, self.key_file)
        except ssl.SSLError as exc:
            raise ValueError(
                f"`cert_file` and `key_file` must be a PEM certificate chain and its private key, "
                f"got {self.cert_file!r} and {self.key_file!r}: {exc.reason or exc}"
            ) from None
