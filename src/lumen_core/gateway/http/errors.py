"""Errors in OpenAI's shape: ``{"error": {"message", "type", "param", "code"}}`` with its status."""

from __future__ import annotations

from typing import Any


class APIError(Exception):
    """A request the front door refuses: ``status`` is the HTTP status; ``type`` and ``code``
    follow OpenAI's names (``invalid_request_error``, ``model_not_found``, ...)."""

    def __init__(
        self, status: int, message: str, *, type: str, param: str | None = None, code: str | None = None
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def bad_request(message: str, param: str | None = None) -> APIError:
    return APIError(400, message, type="invalid_request_error", param=param)


def unauthorized() -> APIError:
    return APIError(
        401,
        "a valid API key must be given as `Authorization: Bearer <key>`",
        type="authentication_error",
        code="invalid_api_key",
    )


def forbidden(message: str, param: str | None = None) -> APIError:
    return APIError(403, message, type="permission_error", param=param)


def not_found(message: str, param: str | None = None) -> APIError:
    return APIError(404, message, type="invalid_request_error", param=param, code="not_found")


def model_not_found(model: str, served: str) -> APIError:
    return APIError(
        404,
        f"`model` must be {served!r} (the model this gateway serves), got {model!r}",
        type="invalid_request_error",
        param="model",
        code="model_not_found",
    )


def over_capacity(limit: int) -> APIError:
    return APIError(
        429,
        f"{limit} requests are in flight (max_concurrent_requests): retry later",
        type="rate_limit_error",
        code="rate_limit_exceeded",
    )


def unavailable(message: str) -> APIError:
    return APIError(503, message, type="server_error", code="service_unavailable")
