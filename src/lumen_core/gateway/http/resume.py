"""Resume tokens: what lets a client continue its stream, and only its own, after the gateway
restarted (``POST /v1/resume``, docs/front_door.md).

A streamed response carries its token in the ``x-lumen-resume-token`` header:
HMAC-SHA256 over the request id under a key derived from the cluster secret
(``GatewayServer.derive_key``), so a restarted gateway (same secret, no state) can check it,
and a client holding another request's token, or an API key alone, cannot read a stream that
is not its own.
"""

from __future__ import annotations

import hashlib
import hmac

HEADER = "x-lumen-resume-token"
KEY_LABEL = b"lumen-front-door-resume-v1"  # what the key is derived for (derive_key's label)


class ResumeTokens:
    """Makes and checks resume tokens under ``key`` (32 bytes derived for KEY_LABEL)."""

    def __init__(self, key: bytes) -> None:
        if not isinstance(key, bytes) or len(key) != 32:
            raise ValueError("`key` must be 32 bytes (GatewayServer.derive_key)")
        self._key = key

    def token(self, request_id: int) -> str:
        return hmac.new(self._key, b"request|%d" % request_id, hashlib.sha256).hexdigest()

    def matches(self, request_id: int, token: str) -> bool:
        """Whether ``token`` is ``request_id``'s (compared in constant time)."""
        return hmac.compare_digest(self.token(request_id).encode(), token.encode())
