"""One gateway request on one vLLM server: a RUN or RESUME directive as a streaming
``POST /v1/completions`` to the server's OpenAI endpoint (``aiohttp``: its C parser reads a
server-sent event in two thirds of the CPU time of httpx's stack, and the agent reads one
per token; bench/sse_reader.py), and the server's events as output tokens by position.

The body carries the request's ``kv_transfer_params["lumen"]`` (docs/vllm.md): the gateway's
request id and its u64 ``key`` (the gateway's capabilities are bound to it), the epoch, the
holders with the gateway's capabilities, and for a restoring RESUME the source holder. A
RESUME sends the prompt followed by the tokens the client already has and the ``max_tokens``
left, so the server's first output is the request's next position. ``ignore_eos``: the
server produces ``max_tokens`` (the front door ends a choice at EOS or a stop sequence, as
over the reference engine's workers). No vLLM import.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import aiohttp
import aiohttp.http_exceptions

from lumen_core.gateway.directives import HolderGrant, Renew, Resume, Run
from lumen_core.gateway.protocol import parse_address
from lumen_core.policy.events import RecoveryAction

__all__ = ["UpstreamError", "UpstreamTokens", "completion_body", "open_session", "stream_tokens"]

# Bound on one server-sent event: vLLM's first event of a request carries its prompt's token
# ids (7 bytes a token or so), and aiohttp refuses a line past its read buffer's high water.
_MAX_EVENT_BYTES = 8 << 20
_CONNECT_TIMEOUT_S = 5.0
# vLLM's server closes a connection idle for VLLM_HTTP_TIMEOUT_KEEP_ALIVE (5 s); aiohttp keeps
# one 15 s by default and may reuse it just as the server closes it. Closing first avoids that.
_KEEPALIVE_S = 2.0


class UpstreamError(RuntimeError):
    """The server answered the request with an error (``status``: the HTTP status of its
    answer, or the ``code`` of an error event in its stream) or broke its stream off
    (``status`` None)."""

    def __init__(self, message: str, *, status: int | None = None) -> None:
        super().__init__(message)
        self.status = status

    @property
    def refused(self) -> bool:
        """A 4xx: the server will not serve this request (a 5xx is the server's own failure)."""
        return self.status is not None and 400 <= self.status < 500

    @property
    def failed(self) -> bool:
        """Any other answered error (a 5xx, or an error event without a code): the server,
        alive, failed the request (vLLM's mid-stream internal error), which another server
        may serve."""
        return self.status is not None and not self.refused


def _event_error(error: Any) -> UpstreamError:
    """The UpstreamError of a stream's error event (vLLM: ``{"error": {"message", "type",
    "code", "param"}}``); without an integer ``code``, a 500."""
    code = error.get("code") if isinstance(error, dict) else None
    status = code if isinstance(code, int) and not isinstance(code, bool) else 500
    message = error.get("message", error) if isinstance(error, dict) else error
    return UpstreamError(f"the server's stream failed ({status}): {message}", status=status)


@dataclass(frozen=True)
class UpstreamTokens:
    """Output tokens ``start_position ..`` of a request (output positions: 0 is the first
    token after the prompt); ``finished``: the server ended the request."""

    start_position: int
    token_ids: tuple[int, ...]
    finished: bool


def _holder(grant: HolderGrant) -> dict[str, Any]:
    address, port = parse_address(grant.address)
    return {"address": address, "port": port, "holder_id": grant.worker_id}


def _lumen_params(directive: Run | Resume) -> dict[str, Any]:
    """The request's ``kv_transfer_params["lumen"]``: shard 0's capability of each holder (a
    server streams one shard)."""
    lumen: dict[str, Any] = {
        "request_id": str(directive.request_id),
        "key": directive.request_id,
        "epoch": directive.epoch,
        "holders": [_holder(h) for h in directive.holders],
        "capabilities": [h.capabilities[0].hex() for h in directive.holders],
    }
    restoring = isinstance(directive, Resume) and directive.action in (
        RecoveryAction.RESTORE,
        RecoveryAction.REMOTE_RESTORE,
    )
    if restoring and directive.source is not None and directive.source.capabilities:
        # Read at the new epoch: the read fences the dead incarnation's writers.
        source = directive.source
        lumen["restore"] = {
            **_holder(source),
            "epoch": directive.epoch,
            "capability": source.capabilities[0].hex(),
        }
    return lumen


def renew_args(directive: Renew) -> dict[str, Any]:
    """The connector's control ``renew`` arguments for a RENEW (shard 0's capabilities, as in
    ``kv_transfer_params``)."""
    return {
        "request_id": str(directive.request_id),
        "epoch": directive.epoch,
        "holders": [_holder(h) for h in directive.holders],
        "capabilities": [h.capabilities[0].hex() for h in directive.holders],
    }


def completion_body(directive: Run | Resume, model: str) -> tuple[dict[str, Any], int]:
    """(the JSON body for the server's ``/v1/completions``, the output position of its first
    token). ``max_tokens`` is what is left of the request's ``max_new_tokens``; ValueError
    when nothing is left (the caller reports the request finished instead)."""
    outputs = list(directive.output_token_ids) if isinstance(directive, Resume) else []
    left = directive.max_new_tokens - len(outputs)
    if left <= 0:
        raise ValueError(
            f"`max_new_tokens` must exceed the {len(outputs)} tokens sent, got {directive.max_new_tokens}"
        )
    body: dict[str, Any] = {
        "model": model,
        "prompt": [*directive.prompt_token_ids, *outputs],
        "max_tokens": left,
        "temperature": directive.sampling.temperature,
        "stream": True,
        "return_token_ids": True,
        "ignore_eos": True,
        "kv_transfer_params": {"lumen": _lumen_params(directive)},
    }
    if directive.sampling.temperature > 0:
        body["seed"] = directive.sampling.seed % 2**63  # vLLM takes a signed 64-bit seed
    return body, len(outputs)


async def open_session() -> aiohttp.ClientSession:
    """The session the agent's relays share (made on its event loop): one connection
    per concurrent stream, to the one server, never timed out mid-stream."""
    return aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=_KEEPALIVE_S),
        timeout=aiohttp.ClientTimeout(total=None, connect=_CONNECT_TIMEOUT_S),
        read_bufsize=_MAX_EVENT_BYTES // 2,  # a line may fill twice this (its high water)
    )


async def _post(http: aiohttp.ClientSession, url: str, body: dict[str, Any]) -> aiohttp.ClientResponse:
    """The server's answer to ``body``. A pooled connection the server closed as the request
    went out (its keep-alive ran out) ends before any answer: the request is sent once more,
    on another connection. A server that is gone fails that too (``aiohttp.ClientError``)."""
    try:
        return await http.post(url, json=body)
    except aiohttp.ServerDisconnectedError:
        return await http.post(url, json=body)


async def _lines(response: aiohttp.ClientResponse) -> AsyncIterator[bytes]:
    """The lines of a server's stream; an over-long one is a refusal (the request cannot be
    relayed, and would not be by another server either)."""
    try:
        async for line in response.content:
            yield line
    except (ValueError, aiohttp.http_exceptions.LineTooLong) as exc:  # ValueError: aiohttp < 3.11
        raise UpstreamError(
            f"an event of the server's stream is over {_MAX_EVENT_BYTES} bytes", status=400
        ) from exc


def _tokens(data: bytes) -> list[tuple[tuple[int, ...], bool]]:
    """(token ids, finished) of each choice of one event; UpstreamError for an error event
    (its status) or one that is not vLLM's shape (502: the live server failed the request)."""
    try:
        event = json.loads(data)
        if "error" in event:
            raise _event_error(event["error"])
        return [
            (tuple(int(t) for t in choice.get("token_ids") or ()), choice.get("finish_reason") is not None)
            for choice in event.get("choices", ())
        ]
    except (ValueError, TypeError, AttributeError) as exc:
        raise UpstreamError(f"the server sent an event that is not a completion: {exc}", status=502) from exc


async def stream_tokens(
    http: aiohttp.ClientSession, url: str, body: dict[str, Any], start_position: int
) -> AsyncIterator[UpstreamTokens]:
    """POST ``body`` to ``url`` (the server's ``/v1/completions``) and yield its tokens by
    output position as they arrive, the last with ``finished``. Raises UpstreamError for an
    error answer or an error event (with its ``status`` and the server's error message), an
    event over 8 MiB (400) or not a completion's (502), or a stream that ends unfinished;
    ``aiohttp.ClientError`` when the server cannot be reached or goes away."""
    position = start_position
    async with await _post(http, url, body) as response:
        if response.status != 200:
            detail = (await response.read()).decode(errors="replace")[:500]
            raise UpstreamError(f"the server answered {response.status}: {detail}", status=response.status)
        async for line in _lines(response):
            if not line.startswith(b"data: "):
                continue
            data = line[6:].rstrip(b"\r\n")
            if data == b"[DONE]":
                break
            for tokens, finished in _tokens(data):
                if tokens or finished:
                    yield UpstreamTokens(position, tokens, finished)
                    position += len(tokens)
                if finished:
                    return
    raise UpstreamError(f"the server's stream ended at output position {position} without a finish")
