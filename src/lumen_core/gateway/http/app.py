"""The FastAPI app of the front door: routes, checks, and the relay of a request's tokens.

A request is checked in this order, and nothing reaches a worker before every check passed:
the API key (401), the body (400: size, JSON, fields and their types, unknown fields), the
model (404), what the workers cannot honour (400: ``n`` > 1, ``top_p`` < 1, text or ``stop``
without a tokenizer), the bounds (400: token ids below the vocabulary, prompt +
``max_tokens`` within ``max_model_len``), capacity (429), then admission (503 when no worker
serves). A stream then reads the request's tokens from the coordinator by position until it
finishes; a failover in between re-sends nothing, so the client sees each token once. A
streamed response names its resume token (header ``x-lumen-resume-token``): with it,
``POST /v1/resume`` continues the stream from the client's position, also on a restarted
gateway that adopted the request from its worker.
"""

from __future__ import annotations

import json
import secrets
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any, TypeVar

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from fastapi.sse import EventSourceResponse, format_sse_event
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, generate_latest
from pydantic import BaseModel, ValidationError

from lumen_core.gateway.coordinator import NoWorkerError
from lumen_core.gateway.directives import GREEDY, Sampling
from lumen_core.gateway.http.bridge import CoordinatorBridge
from lumen_core.gateway.http.config import FrontDoorConfig
from lumen_core.gateway.http.errors import (
    APIError,
    bad_request,
    forbidden,
    model_not_found,
    not_found,
    over_capacity,
    unauthorized,
    unavailable,
)
from lumen_core.gateway.http.keys import key_matches
from lumen_core.gateway.http.output import Output
from lumen_core.gateway.http.resume import HEADER as RESUME_HEADER
from lumen_core.gateway.http.resume import ResumeTokens
from lumen_core.gateway.http.schemas import ChatCompletionRequest, CompletionRequest, ResumeRequest, _Sampling
from lumen_core.gateway.http.text import Tokenizer

B = TypeVar("B", bound=BaseModel)
DEFAULT_COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions


@dataclass
class _Admitted:
    """A request admitted on the cluster, as one endpoint serves it."""

    request_id: int
    kind: str  # "completion" | "chat"
    num_prompt_tokens: int
    output: Output
    include_usage: bool
    marks_moves: bool  # a move changes its draws (seeded, on workers whose draws restart)
    resumed_inexact: bool = False  # moved since admission, with marks_moves
    start: int = 0  # the output position the stream starts at (> 0: resumed by the client)


class _Metrics:
    """The front door's counters, in the gateway's registry (beside its gauges)."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.requests = Counter(
            "lumen_http_requests",
            "Front-door requests by endpoint and status (200: admitted)",
            ["endpoint", "status"],
            registry=registry,
        )
        self.tokens = Counter(
            "lumen_http_output_tokens", "Output tokens relayed to clients", registry=registry
        )
        self.cancelled = Counter(
            "lumen_http_cancelled",
            "Requests cancelled on their worker (client gone or a stop)",
            ["reason"],
            registry=registry,
        )


class _FrontDoor:
    def __init__(
        self,
        config: FrontDoorConfig,
        bridge: CoordinatorBridge,
        api_keys: frozenset[str],
        tokenizer: Tokenizer | None,
        metrics: _Metrics,
        resume_tokens: ResumeTokens,
    ) -> None:
        self.config = config
        self.bridge = bridge
        self.api_keys = api_keys
        self.tokenizer = tokenizer
        self.metrics = metrics
        self.resume_tokens = resume_tokens
        self.num_in_flight = 0

    # ---- checks --------------------------------------------------------------------------
    def authorize(self, request: Request) -> None:
        if not key_matches(self.api_keys, request.headers.get("authorization")):
            raise unauthorized()

    async def parse(self, request: Request, model: type[B]) -> B:
        declared = request.headers.get("content-length")
        limit = self.config.max_body_bytes
        if declared is not None and declared.isdigit() and int(declared) > limit:
            raise bad_request(f"the request body must be at most {limit} bytes, got {declared}")
        body = bytearray()
        async for chunk in request.stream():
            body += chunk
            if len(body) > limit:
                raise bad_request(f"the request body must be at most {limit} bytes, got more")
        try:
            data = json.loads(body)
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise bad_request(f"the request body must be JSON, got invalid JSON ({exc})") from None
        if not isinstance(data, dict):
            raise bad_request(f"the request body must be a JSON object, got {type(data).__name__}")
        try:
            return model.model_validate(data)
        except ValidationError as exc:
            error = exc.errors()[0]
            param = ".".join(str(p) for p in error["loc"]) or None
            raise bad_request(f"`{param}`: {error['msg']}", param) from None

    def check_sampling(self, body: _Sampling) -> tuple[str, ...]:
        """What the workers cannot honour; returns the stop sequences."""
        if body.model != self.config.model_name:
            raise model_not_found(body.model, self.config.model_name)
        if body.n != 1:
            raise bad_request(f"`n` must be 1 (one choice per request), got {body.n}", "n")
        if body.top_p not in (None, 1.0):
            raise bad_request(
                f"`top_p` must be 1: the workers sample the whole distribution, got {body.top_p}", "top_p"
            )
        if body.stream_options is not None and not body.stream:
            raise bad_request("`stream_options` must be set only with `stream: true`", "stream_options")
        try:
            stops = body.stop_sequences()
        except ValueError as exc:
            raise bad_request(str(exc), "stop") from None
        if stops and self.tokenizer is None:
            raise bad_request("`stop` needs a tokenizer (start the gateway with --tokenizer)", "stop")
        return stops

    def check_prompt(self, token_ids: list[int], param: str) -> None:
        if not token_ids:
            raise bad_request(f"`{param}` must not be empty, got 0 tokens", param)
        vocab = self.config.vocab_size
        bad = next((t for t in token_ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise bad_request(f"`{param}` must hold token ids in [0, {vocab}), got {bad}", param)
        limit = self.config.max_model_len
        if len(token_ids) >= limit:
            raise bad_request(
                f"`{param}` must be under max_model_len={limit} tokens, got {len(token_ids)}", param
            )

    def max_tokens(self, requested: int | None, default: int, num_prompt_tokens: int) -> int:
        room = self.config.max_model_len - num_prompt_tokens
        if requested is None:
            return min(default, room)
        if requested > room:
            raise bad_request(
                f"`max_tokens` must be <= {room} (max_model_len={self.config.max_model_len} minus "
                f"{num_prompt_tokens} prompt tokens), got {requested}",
                "max_tokens",
            )
        return requested

    # ---- admission -----------------------------------------------------------------------
    def admit(
        self, kind: str, body: _Sampling, prompt: list[int], max_tokens: int, stops: tuple[str, ...]
    ) -> _Admitted:
        """Admit on the cluster (counts against capacity until ``release``)."""
        if self.num_in_flight >= self.config.max_concurrent_requests:
            raise over_capacity(self.config.max_concurrent_requests)
        sampling = _sampling(body)
        now_s = self.bridge.now_s
        try:
            admission = self.bridge.call(lambda c: c.admit(now_s, prompt, max_tokens, sampling=sampling))
        except NoWorkerError as exc:
            raise unavailable(str(exc)) from None
        self.num_in_flight += 1
        include_usage = body.stream_options is not None and body.stream_options.include_usage
        marks_moves = sampling.temperature > 0 and self.config.engine == "vllm"
        return _Admitted(
            admission.request_id, kind, len(prompt), Output(self.tokenizer, stops), include_usage, marks_moves
        )

    def resume(self, body: ResumeRequest) -> _Admitted:
        """A stream its client continues from ``body.position`` (counts against capacity until
        ``release``). Its stop sequences and sampling are not known here (a restarted gateway
        learnt the request from its worker): the output is the request's tokens, detokenized
        from its first one so text continues whole across the resume point."""
        prefix, _, number = body.id.partition("-")
        request_id = int(number)
        if not self.resume_tokens.matches(request_id, body.resume_token):
            raise forbidden(f"`resume_token` is not the token of {body.id}", "resume_token")
        if self.num_in_flight >= self.config.max_concurrent_requests:
            raise over_capacity(self.config.max_concurrent_requests)

        def known(c: Any) -> tuple[tuple[int, ...], int] | None:
            if not c.has_request(request_id):
                return None
            return c.tokens(request_id)[0], c.num_prompt_tokens(request_id)

        state = self.bridge.read(known)
        if state is None:
            raise not_found(f"`id` must name a request this gateway serves, got {body.id!r}", "id")
        tokens, num_prompt_tokens = state
        if body.position > len(tokens):
            raise bad_request(
                f"`position` must be <= {len(tokens)} (the tokens {body.id} has), got {body.position}",
                "position",
            )
        output = Output(self.tokenizer)
        output.add(tokens[: body.position])  # what the client has: its text is not sent again
        self.num_in_flight += 1
        include_usage = body.stream_options is not None and body.stream_options.include_usage
        kind = "chat" if prefix == "chatcmpl" else "completion"
        return _Admitted(
            request_id, kind, num_prompt_tokens, output, include_usage, False, start=body.position
        )

    def release(self, admitted: _Admitted, reason: str) -> None:
        """The client is done with the request: end it on the cluster if it still runs (not
        when the gateway is stopping: its workers keep serving for a restarted gateway)."""
        self.num_in_flight -= 1
        if self.bridge.stopping:
            return
        request_id = admitted.request_id
        now_s = self.bridge.now_s
        cancelled = self.bridge.call(
            lambda c: c.has_request(request_id) and c.cancel(now_s, request_id, reason)
        )
        if cancelled:
            self.metrics.cancelled.labels(reason).inc()

    async def pieces(self, admitted: _Admitted) -> AsyncIterator[tuple[list[int], str]]:
        """(token ids, text) pieces of the output until it ends (``admitted.output``'s
        ``finish_reason`` is then set). Raises APIError when the request is lost or the
        gateway stops."""
        output = admitted.output
        position = admitted.start
        wake = 0
        while True:
            tokens, finished, lost, epoch, wake = await self.bridge.wait_tokens(
                admitted.request_id, position, wake
            )
            # Moved since admission (epoch 1). Read with the tokens: a move seen now may have
            # come after some of them, so a mark errs early, never late.
            if admitted.marks_moves and epoch > 1:
                admitted.resumed_inexact = True
            if lost:
                reason, refused = self.bridge.read(
                    lambda c: (c.lost_reason(admitted.request_id), c.refused(admitted.request_id))
                )
                message = f"request {admitted.request_id} lost: {reason}"
                # A refusal is the request's own: 400, which the openai client does not retry.
                raise bad_request(message) if refused else unavailable(message)
            if not (tokens or finished):
                raise unavailable("the gateway is stopping")
            position += len(tokens)
            taken, text = output.add(tokens)
            if output.finish_reason is None and finished:
                text += output.finish()
            self.metrics.tokens.inc(len(taken))
            if taken or text:
                yield taken, text
            if output.finish_reason is not None:
                return

    # ---- responses -----------------------------------------------------------------------
    def usage(self, admitted: _Admitted) -> dict[str, int]:
        completion = len(admitted.output.token_ids)
        return {
            "prompt_tokens": admitted.num_prompt_tokens,
            "completion_tokens": completion,
            "total_tokens": admitted.num_prompt_tokens + completion,
        }

    def chunk(
        self, admitted: _Admitted, token_ids: list[int], text: str, finish_reason: str | None, created: int
    ) -> dict[str, Any]:
        choice: dict[str, Any] = {"index": 0, "finish_reason": finish_reason, "token_ids": token_ids}
        if admitted.resumed_inexact:
            choice["resumed_inexact"] = True
        if admitted.kind == "chat":
            choice["delta"] = {"content": text} if text or finish_reason is None else {}
            choice["logprobs"] = None
            obj = "chat.completion.chunk"
        else:
            choice.update(text=text, logprobs=None)
            obj = "text_completion"
        return self._envelope(admitted, obj, [choice], created)

    def _envelope(self, admitted: _Admitted, obj: str, choices: list[Any], created: int) -> dict[str, Any]:
        prefix = "chatcmpl" if admitted.kind == "chat" else "cmpl"
        return {
            "id": f"{prefix}-{admitted.request_id}",
            "object": obj,
            "created": created,
            "model": self.config.model_name,
            "choices": choices,
        }

    async def stream(self, admitted: _Admitted) -> AsyncIterator[bytes]:
        """The SSE events of a streamed request. Its first event is a comment (clients skip
        it) that ``serve`` takes before the response starts: a generator that has started is
        closed by asyncio when dropped, so ``release`` runs even if the client left before the
        body was sent."""
        created = int(time.time())
        reason = "client disconnected"
        try:
            yield format_sse_event(comment=f"lumen request {admitted.request_id}")
            if admitted.kind == "chat":
                first = self.chunk(admitted, [], "", None, created)
                first["choices"][0]["delta"] = {"role": "assistant", "content": ""}
                yield _event(first)
            try:
                async for token_ids, text in self.pieces(admitted):
                    finish = admitted.output.finish_reason
                    yield _event(self.chunk(admitted, token_ids, text, finish, created))
            except APIError as exc:
                reason = "stream failed"
                yield _event(exc.body())
                return
            reason = "stop"
            if admitted.include_usage:
                final = self._envelope(admitted, _object(admitted, stream=True), [], created)
                final["usage"] = self.usage(admitted)
                yield _event(final)
            yield format_sse_event(data_str="[DONE]")
        finally:
            self.release(admitted, reason)

    async def respond(self, admitted: _Admitted) -> dict[str, Any]:
        reason = "client disconnected"
        try:
            async for _ in self.pieces(admitted):
                pass
            reason = "stop"
        finally:
            self.release(admitted, reason)
        output = admitted.output
        choice: dict[str, Any] = {
            "index": 0,
            "finish_reason": output.finish_reason,
            "logprobs": None,
            "token_ids": output.token_ids,
        }
        if admitted.resumed_inexact:
            choice["resumed_inexact"] = True
        if admitted.kind == "chat":
            choice["message"] = {"role": "assistant", "content": output.text}
        else:
            choice["text"] = output.text
        body = self._envelope(admitted, _object(admitted, stream=False), [choice], int(time.time()))
        body["usage"] = self.usage(admitted)
        return body


def _sampling(body: _Sampling) -> Sampling:
    """Greedy unless ``temperature`` > 0 (OpenAI's default of 1 is not assumed: a request that
    names no temperature is decoded greedily). Without a ``seed`` a random one is drawn here,
    once: the request carries it to every worker it is moved to, so its tokens do not change."""
    temperature = body.temperature or 0.0
    if temperature == 0.0:
        return GREEDY
    return Sampling(temperature, secrets.randbits(63) if body.seed is None else body.seed)


def _object(admitted: _Admitted, *, stream: bool) -> str:
    if admitted.kind == "chat":
        return "chat.completion.chunk" if stream else "chat.completion"
    return "text_completion"


async def _prepend(first: bytes, rest: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
    yield first
    async for event in rest:
        yield event


def _event(data: dict[str, Any]) -> bytes:
    return format_sse_event(data_str=json.dumps(data, separators=(",", ":")))


def build_app(
    config: FrontDoorConfig,
    bridge: CoordinatorBridge,
    api_keys: frozenset[str],
    registry: CollectorRegistry,
    resume_tokens: ResumeTokens,
    *,
    tokenizer: Tokenizer | None = None,
) -> FastAPI:
    """The app (module docstring). ``registry``: the gateway's Prometheus registry, which its
    counters join and ``/metrics`` serves. ``bridge`` is started and stopped with the app.
    ``resume_tokens``: the tokens streamed responses carry and ``/v1/resume`` checks."""
    if not isinstance(config, FrontDoorConfig):
        raise TypeError(f"config must be a FrontDoorConfig, got {type(config).__name__}")
    if not api_keys:
        raise ValueError("api_keys must hold at least one key, got none")
    if tokenizer is not None and tokenizer.vocab_size > config.vocab_size:
        raise ValueError(
            f"config.vocab_size must be >= the tokenizer's {tokenizer.vocab_size}, got {config.vocab_size}"
        )
    try:
        counters = _Metrics(registry)
    except ValueError as exc:  # prometheus_client: duplicated timeseries
        raise ValueError(
            f"registry must not hold a front door's counters yet (one per gateway), got {exc}"
        ) from None
    door = _FrontDoor(config, bridge, api_keys, tokenizer, counters, resume_tokens)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        bridge.start()
        try:
            yield
        finally:
            bridge.stop()

    app = FastAPI(title="lumen gateway", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)

    @app.exception_handler(APIError)
    async def api_error(request: Request, exc: APIError) -> JSONResponse:
        door.metrics.requests.labels(request.url.path, str(exc.status)).inc()
        return JSONResponse(exc.body(), status_code=exc.status)

    @app.get("/health")
    async def health() -> JSONResponse:
        if bridge.stopping:
            return JSONResponse({"status": "stopping"}, status_code=503)
        return JSONResponse({"status": "ok"})

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models(request: Request) -> JSONResponse:
        door.authorize(request)
        model = {"id": config.model_name, "object": "model", "created": 0, "owned_by": "lumen"}
        model["max_model_len"] = config.max_model_len
        return JSONResponse({"object": "list", "data": [model]})

    async def serve(request: Request, admitted: _Admitted, stream: bool) -> Any:
        door.metrics.requests.labels(request.url.path, "200").inc()
        if stream:
            events = door.stream(admitted)
            first = await anext(events)  # started: from here on its cleanup runs (door.stream)
            headers = {RESUME_HEADER: door.resume_tokens.token(admitted.request_id)}
            return EventSourceResponse(_prepend(first, events), headers=headers)
        return JSONResponse(await door.respond(admitted))

    @app.post("/v1/completions")
    async def completions(request: Request) -> Any:
        door.authorize(request)
        body = await door.parse(request, CompletionRequest)
        stops = door.check_sampling(body)
        if isinstance(body.prompt, str):
            if door.tokenizer is None:
                raise bad_request(
                    "`prompt` must be token ids: this gateway has no tokenizer (start it with --tokenizer)",
                    "prompt",
                )
            prompt = door.tokenizer.encode(body.prompt)
        else:
            prompt = list(body.prompt)
        door.check_prompt(prompt, "prompt")
        max_tokens = door.max_tokens(body.max_tokens, DEFAULT_COMPLETION_MAX_TOKENS, len(prompt))
        return await serve(request, door.admit("completion", body, prompt, max_tokens, stops), body.stream)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Any:
        door.authorize(request)
        body = await door.parse(request, ChatCompletionRequest)
        stops = door.check_sampling(body)
        if door.tokenizer is None or not door.tokenizer.has_chat_template:
            raise bad_request(
                "chat needs a tokenizer with a chat template (start the gateway with --tokenizer)", "messages"
            )
        if body.max_tokens is not None and body.max_completion_tokens is not None:
            raise bad_request(
                "give `max_tokens` or `max_completion_tokens`, not both", "max_completion_tokens"
            )
        prompt = door.tokenizer.encode_chat([m.model_dump() for m in body.messages])
        door.check_prompt(prompt, "messages")
        requested = body.max_tokens if body.max_tokens is not None else body.max_completion_tokens
        max_tokens = door.max_tokens(requested, config.max_model_len, len(prompt))
        return await serve(request, door.admit("chat", body, prompt, max_tokens, stops), body.stream)

    @app.post("/v1/resume")
    async def resume(request: Request) -> Any:
        door.authorize(request)
        body = await door.parse(request, ResumeRequest)
        return await serve(request, door.resume(body), True)

    return app
