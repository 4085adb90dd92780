"""What a gateway call can fail with, raised in process by the Coordinator and, for a call
over gRPC, by GatewayClient: one class per failure, whichever side raises it."""

from __future__ import annotations

import grpc


class GatewayError(RuntimeError):
    """A call the gateway refused or that could not reach it; ``code`` is the gRPC status,
    ``details`` the gateway's message."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(f"{code.name}: {details}")
        self.code = code
        self.details = details


class AuthError(GatewayError):
    """UNAUTHENTICATED: the caller does not hold the cluster secret."""


class StaleEpochError(GatewayError):
    """FAILED_PRECONDITION: a report from an incarnation (worker epoch) or request epoch the
    gateway has fenced."""

    def __init__(self, details: str) -> None:
        super().__init__(grpc.StatusCode.FAILED_PRECONDITION, details)
