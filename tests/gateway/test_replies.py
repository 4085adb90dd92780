"""Sealed replies on the gateway plane: a real gateway and client on loopback with a TCP proxy
between them that rewrites bytes of the gateway's answers in flight (what an active party on
the path can do); the client refuses what the gateway did not send. Seal, index and call
binding at the unit level in tests/test_auth_gateway.py."""

import socket
import threading
from types import TracebackType

import grpc
import pytest

from lumen_core.gateway.client import GatewayClient
from lumen_core.gateway.config import GatewayConfig
from lumen_core.gateway.errors import GatewayError

pytestmark = pytest.mark.timeout(60)

SECRET = b"gateway-tests-secret-0123456789abcdef"  # as conftest.py
GIB = 1 << 30


class RewritingProxy:
    """Forwards TCP connections on loopback to ``target``; in what comes back, every
    ``needle`` becomes ``replacement`` (same length: HTTP/2 frame lengths stay right).
    ``rewrites`` counts them."""

    def __init__(self, target: str, needle: bytes, replacement: bytes) -> None:
        assert len(needle) == len(replacement)
        host, port = target.rsplit(":", 1)
        self.target = (host, int(port))
        self.needle, self.replacement = needle, replacement
        self.rewrites = 0
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.address = f"127.0.0.1:{self._listener.getsockname()[1]}"
        self._sockets: list[socket.socket] = [self._listener]
        self._threads = [threading.Thread(target=self._accept, daemon=True)]

    def __enter__(self) -> "RewritingProxy":
        self._threads[0].start()
        return self

    def __exit__(self, *exc: type[BaseException] | BaseException | TracebackType | None) -> None:
        for sock in self._sockets:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            sock.close()
        for thread in self._threads:
            thread.join(5.0)

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return  # closed
            upstream = socket.create_connection(self.target)
            self._sockets += [client, upstream]
            for source, sink, rewrite in ((client, upstream, False), (upstream, client, True)):
                thread = threading.Thread(target=self._pump, args=(source, sink, rewrite), daemon=True)
                self._threads.append(thread)
                thread.start()

    def _pump(self, source: socket.socket, sink: socket.socket, rewrite: bool) -> None:
        held = b""  # a tail that may begin a needle split across reads, sent with the next
        try:
            while data := source.recv(65536):
                data, held = held + data, b""
                if rewrite:
                    self.rewrites += data.count(self.needle)
                    data = data.replace(self.needle, self.replacement)
                    cut = next(
                        (n for n in range(len(self.needle) - 1, 0, -1) if data.endswith(self.needle[:n])), 0
                    )
                    data, held = data[: len(data) - cut], data[len(data) - cut :]
                sink.sendall(data)
            sink.sendall(held)
        except OSError:
            pass
        finally:
            try:
                sink.shutdown(socket.SHUT_WR)
            except OSError:
                pass


def test_a_registration_reply_rewritten_in_flight_is_refused(start_gateway) -> None:
    """The attack: swap the issuer public key in the reply for the attacker's own, so the
    worker's holder would accept capabilities the attacker signs. The reply's seal no longer
    verifies: the registration fails (DATA_LOSS) and the key is never handed on."""
    server = start_gateway(GatewayConfig(policy="S&R"))
    genuine = server.coordinator.issuer_public_key
    forged = bytes(b ^ 0xFF for b in genuine)
    trusted: list[bytes] = []
    with RewritingProxy(server.address, genuine, forged) as proxy:
        client = GatewayClient(proxy.address, SECRET, on_issuer_key=trusted.append)
        try:
            with pytest.raises(GatewayError) as info:
                client.register(0, budget_bytes=GIB)
        finally:
            client.close()
        assert proxy.rewrites == 1
    assert info.value.code == grpc.StatusCode.DATA_LOSS and "Register" in info.value.details
    assert trusted == [] and server.coordinator.worker_ids() == [0]  # the gateway did register it

    # The same path rewriting nothing: the sealed reply verifies and the key is trusted.
    with RewritingProxy(server.address, forged, forged) as proxy:
        client = GatewayClient(proxy.address, SECRET, on_issuer_key=trusted.append)
        try:
            assert client.register(1, budget_bytes=GIB).epoch == 1
        finally:
            client.close()
    assert trusted == [genuine]


def test_a_token_stream_rewritten_in_flight_ends_at_the_forged_chunk(start_gateway, connect) -> None:
    """A client's Submit stream: the proxy turns the worker's tokens into others. The client
    gets the admission chunk (not rewritten) and then DATA_LOSS, never a forged token."""
    server = start_gateway(GatewayConfig(policy="S&R"))
    worker = connect(server)
    worker.register(0, budget_bytes=GIB)
    tokens = [301, 302, 303, 304]
    # The TokenChunk's packed token ids (field 3): tag, length, then 2-byte varints.
    packed = b"".join(bytes([t & 0x7F | 0x80, t >> 7]) for t in tokens)
    forged = b"".join(bytes([t & 0x7F | 0x80, t >> 7]) for t in (401, 402, 403, 404))
    with RewritingProxy(server.address, packed, forged) as proxy:
        client = GatewayClient(proxy.address, SECRET)
        try:
            stream = client.submit([1, 2, 3], 4)
            admitted = next(stream)
            assert admitted.token_ids == ()
            directive = worker.heartbeat().directives
            assert directive, "the request was not routed to the worker"
            assert worker.report_tokens(admitted.request_id, 1, 0, tokens, finished=True)
            with pytest.raises(GatewayError) as info:
                list(stream)
        finally:
            client.close()
        assert proxy.rewrites >= 1
    assert info.value.code == grpc.StatusCode.DATA_LOSS and "Submit" in info.value.details
