"""The agent's reader of a vLLM server's stream (``worker.upstream.stream_tokens``) against a
real HTTP server on loopback: vLLM's first event carries the prompt's token ids, so an event
may be far longer than an HTTP client's default line limit; a stream cut off mid-way, an
event past the reader's bound or not a completion's is an error, never a short answer."""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import aiohttp
import pytest

from lumen_core.worker.upstream import UpstreamError, UpstreamTokens, open_session, stream_tokens

PROMPT_TOKENS = 200_000  # a first event of about 1.4 MB, 20x aiohttp's default line limit


def _event(token_ids: list[int], *, prompt: list[int] | None = None, finish: str | None = None) -> bytes:
    choice = {
        "index": 0,
        "text": "",
        "token_ids": token_ids,
        "prompt_token_ids": prompt,
        "finish_reason": finish,
    }
    return b"data: " + json.dumps({"id": "cmpl-1", "choices": [choice]}).encode() + b"\n\n"


class _Server(BaseHTTPRequestHandler):
    """``/whole``: a long first event, two more tokens, the finish, ``[DONE]``; ``/cut``: one
    token, then the connection closes mid-stream; ``/garbled``: one token, then an event
    whose token id is not a number; ``/huge``: one event of 9 MiB."""

    protocol_version = "HTTP/1.1"

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers["Content-Length"]))
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        if self.path == "/whole":
            first = _event([5], prompt=list(range(PROMPT_TOKENS)))
            events = [first, _event([6, 7]), _event([], finish="length"), b"data: [DONE]\n\n"]
        elif self.path == "/cut":
            events = [_event([5])]
        elif self.path == "/garbled":
            events = [_event([5]), b'data: {"choices": [{"token_ids": ["x"]}]}\n\n']
        else:
            events = [b"data: " + b"x" * (9 << 20) + b"\n\n"]
        for event in events:
            self.wfile.write(b"%x\r\n%s\r\n" % (len(event), event))
        if self.path != "/cut":
            self.wfile.write(b"0\r\n\r\n")
        self.wfile.flush()
        self.close_connection = True

    def log_message(self, *args: object) -> None:
        pass


class _KeepAliveServer(BaseHTTPRequestHandler):
    """Keeps a connection open after its first answer, and closes it without answering the
    next request on it: a server whose keep-alive ran out as that request went out."""

    protocol_version = "HTTP/1.1"
    connections = 0

    def setup(self) -> None:
        super().setup()
        type(self).connections += 1
        self.answered = 0

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers["Content-Length"]))
        if self.answered:
            self.close_connection = True
            return
        self.answered += 1
        body = _event([5], finish="length") + b"data: [DONE]\n\n"
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)
        self.wfile.flush()

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def url() -> Iterator[str]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Server)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def _read(url: str) -> list[UpstreamTokens]:
    async def read() -> list[UpstreamTokens]:
        http = await open_session()
        try:
            return [piece async for piece in stream_tokens(http, url, {}, 3)]
        finally:
            await http.close()

    return asyncio.run(read())


def test_a_first_event_with_a_long_prompt_is_read_whole(url: str) -> None:
    assert _read(f"{url}/whole") == [
        UpstreamTokens(3, (5,), False),
        UpstreamTokens(4, (6, 7), False),
        UpstreamTokens(6, (), True),
    ]


def test_a_stream_cut_off_mid_way_is_an_error(url: str) -> None:
    with pytest.raises((aiohttp.ClientError, UpstreamError)):
        _read(f"{url}/cut")


def test_an_event_past_the_bound_is_refused(url: str) -> None:
    with pytest.raises(UpstreamError, match="over 8388608 bytes") as refused:
        _read(f"{url}/huge")
    assert refused.value.refused  # the request ends at its client: no server would relay it


def test_an_event_that_is_not_a_completion_fails_the_request(url: str) -> None:
    with pytest.raises(UpstreamError, match="not a completion") as failed:
        _read(f"{url}/garbled")
    assert failed.value.failed  # the live server failed it: the gateway moves it


def test_a_connection_the_server_closed_as_the_request_went_out_is_not_a_failure() -> None:
    """The agent's session reuses its connection to the server; one the server closes as the
    next request goes out (its keep-alive ran out) ends before any answer. The request goes
    once more on a new connection: it is not a failure (the agent would leave it to the
    supervisor, which sees a live server)."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), _KeepAliveServer)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{server.server_address[1]}/v1/completions"

    async def read_twice() -> list[list[UpstreamTokens]]:
        http = await open_session()
        try:
            reads = []
            for _ in range(2):
                reads.append([piece async for piece in stream_tokens(http, url, {}, 0)])
            return reads
        finally:
            await http.close()

    try:
        first, second = asyncio.run(read_twice())
    finally:
        server.shutdown()
        server.server_close()
    assert first == second == [UpstreamTokens(0, (5,), True)]
    assert _KeepAliveServer.connections == 2  # the second request's first connection was refused
