"""Relay delay of the gateway's OpenAI front door (issue 20), measured in one run.

A gateway and its front door on loopback; worker 0 is played in this process through the
Coordinator calls a worker's token reports make: every ``--step-s`` each running request gets
one token, and the time the gateway accepted it (``report_tokens`` returned, under the
gateway's lock) is kept per (request, position). A client in another process opens
``--streams`` concurrent streaming completions (one connection each) and keeps the time each
token arrived. Both read CLOCK_MONOTONIC, one clock for the whole host: the relay delay of a
token is its client receive time minus its gateway accept time (the coordinator's
notification, the front door's wake-up, SSE framing, uvicorn and the loopback socket). The
client and the gateway share the machine's cores, as they would on one host.

``--client-kind``: ``socket`` (default) reads each connection's bytes with asyncio and stamps
each read as it returns, so the figure is the gateway's and the kernel's, not a client
library's, but for the client's own wake-ups (one per stream, one after another, for the 64
streams' events of a step); ``kernel`` stamps each read with the time the kernel received it
(``SO_TIMESTAMPNS``), which leaves those out; ``httpx`` stamps each event as an httpx client
parses it, which adds that client's own per-event cost (all 64 streams' events of a step
arrive at once and are parsed one after another). ``--server-stack pure`` serves with
asyncio's own event loop and uvicorn's pure-Python HTTP (h11) instead of what uvicorn picks
(uvloop and httptools, from the ``http`` extra): the baseline of what they give. Rows
``metric`` / ``value``: ``relay_p50_ms``, ``relay_p99_ms``, ``relay_mean_ms``, ``tokens``,
``streams``. ``--split-cores`` runs the gateway's process on the first CPU and the client on
the others, as when the clients are other machines (the figure is then the gateway's alone,
with a core to itself).

    python bench/front_door_relay.py --streams 64 --tokens 64 --json relay.json
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import os
import selectors
import socket
import struct
import subprocess
import sys
import threading
import time

import httpx
import numpy as np
import uvicorn

from lumen_core.gateway.config import GatewayConfig
from lumen_core.gateway.directives import Run
from lumen_core.gateway.http.config import FrontDoorConfig
from lumen_core.gateway.http.front_door import FrontDoor
from lumen_core.gateway.server import GatewayServer

SECRET = b"bench-secret-0123456789abcdef0123"
KEY = "bench-front-door-key-0123456789"
MODEL = "bench"
GIB = 1 << 30
# Linux's SO_TIMESTAMPNS (and SCM_TIMESTAMPNS, its control message), which Python does not name.
SO_TIMESTAMPNS = getattr(socket, "SO_TIMESTAMPNS", 35)


class _PlayedWorker:
    """Worker 0: one token per running request every ``step_s``; ``accepted[(request,
    position)]`` is when the gateway took it."""

    def __init__(self, gateway: GatewayServer, step_s: float) -> None:
        self.gateway = gateway
        self.step_s = step_s
        self.accepted: dict[tuple[int, int], float] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        running: dict[int, tuple[int, int, int]] = {}  # request id -> (epoch, position, max)
        coordinator = self.gateway.coordinator
        while not self._stop.wait(self.step_s):
            with self.gateway.condition:
                for directive in coordinator.take_directives(0):
                    if isinstance(directive, Run):
                        running[directive.request_id] = (directive.epoch, 0, directive.max_new_tokens)
                for request_id, (epoch, position, limit) in list(running.items()):
                    finished = position + 1 == limit
                    coordinator.report_tokens(
                        self.gateway.now_s(),
                        0,
                        1,
                        request_id,
                        epoch,
                        position,
                        [position % 200 + 1],
                        finished=finished,
                    )
                    self.accepted[(request_id, position)] = time.monotonic()
                    if finished:
                        del running[request_id]
                    else:
                        running[request_id] = (epoch, position + 1, limit)
                self.gateway.condition.notify_all()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5.0)


async def _httpx_client(url: str, num_streams: int, num_tokens: int) -> list[tuple[int, int, float]]:
    """(request id, position, receive time) of every token of ``num_streams`` streams."""
    received: list[tuple[int, int, float]] = []
    body = {"model": MODEL, "prompt": [1, 2, 3], "max_tokens": num_tokens, "stream": True}
    headers = {"Authorization": f"Bearer {KEY}"}
    limits = httpx.Limits(max_connections=num_streams)
    async with httpx.AsyncClient(timeout=60.0, limits=limits) as http:

        async def one() -> None:
            position = 0
            async with http.stream("POST", f"{url}/completions", json=body, headers=headers) as response:
                async for line in response.aiter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    now = time.monotonic()
                    event = json.loads(line[len("data: ") :])
                    request_id = int(event["id"].removeprefix("cmpl-"))
                    for _ in event["choices"][0]["token_ids"]:
                        received.append((request_id, position, now))
                        position += 1

        await asyncio.gather(*(one() for _ in range(num_streams)))
    return received


def _request(url: str, num_tokens: int) -> tuple[str, int, bytes]:
    """(host, port, the HTTP request) of one streaming completion of ``num_tokens``."""
    address = httpx.URL(url)
    body = json.dumps({"model": MODEL, "prompt": [1, 2, 3], "max_tokens": num_tokens, "stream": True})
    head = (
        f"POST {address.path}/completions HTTP/1.1\r\nHost: {address.host}:{address.port}\r\n"
        f"Authorization: Bearer {KEY}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    )
    assert address.host and address.port
    return address.host, address.port, (head + body).encode()


def _parse(streams: list[list[tuple[bytes, float]]]) -> list[tuple[int, int, float]]:
    """Each stream's stamped reads as (request id, position, stamp) per token: an SSE event
    ends with a blank line; its ``data:`` JSON carries the request id and token ids (the
    chunked encoding's size lines fall between events)."""
    received: list[tuple[int, int, float]] = []
    for reads in streams:
        position, pending = 0, b""
        for data, now in reads:
            *events, pending = (pending + data).split(b"\n\n")
            for event in events:
                _, found, text = event.partition(b"data: ")
                if not found or text == b"[DONE]":
                    continue
                parsed = json.loads(text)
                request_id = int(parsed["id"].removeprefix("cmpl-"))
                for _ in parsed["choices"][0]["token_ids"]:
                    received.append((request_id, position, now))
                    position += 1
    return received


async def _socket_client(url: str, num_streams: int, num_tokens: int) -> list[tuple[int, int, float]]:
    """As ``_httpx_client``, each read stamped as it returns (asyncio), parsed after the run."""
    host, port, request = _request(url, num_tokens)

    async def one() -> list[tuple[bytes, float]]:
        reader, writer = await asyncio.open_connection(host, port)
        writer.write(request)
        reads, tail = [], b""
        while b"data: [DONE]" not in tail:
            data = await reader.read(1 << 16)
            if not data:
                raise RuntimeError("the front door closed a stream before [DONE]")
            reads.append((data, time.monotonic()))
            tail = (tail + data)[-64:]
        writer.close()
        return reads

    return _parse(await asyncio.gather(*(one() for _ in range(num_streams))))


async def _kernel_client(url: str, num_streams: int, num_tokens: int) -> list[tuple[int, int, float]]:
    """As ``_socket_client``, each read stamped with the time the kernel received its last
    segment (``SO_TIMESTAMPNS``) rather than when this process got to it: the client's own
    wake-ups, one after another for the 64 streams of a burst, drop out of the figure."""
    return await asyncio.to_thread(_kernel_stamped_reads, url, num_streams, num_tokens)


def _kernel_stamped_reads(url: str, num_streams: int, num_tokens: int) -> list[tuple[int, int, float]]:
    host, port, request = _request(url, num_tokens)
    # The kernel stamps in CLOCK_REALTIME, the gateway in CLOCK_MONOTONIC: one offset, read here.
    offset = time.clock_gettime(time.CLOCK_REALTIME) - time.monotonic()
    selector = selectors.DefaultSelector()
    reads: dict[socket.socket, list[tuple[bytes, float]]] = {}
    for _ in range(num_streams):
        sock = socket.create_connection((host, port))
        sock.setsockopt(socket.SOL_SOCKET, SO_TIMESTAMPNS, 1)
        sock.sendall(request)
        sock.setblocking(False)
        selector.register(sock, selectors.EVENT_READ)
        reads[sock] = []
    tails = {sock: b"" for sock in reads}
    deadline = time.monotonic() + 300
    while selector.get_map() and time.monotonic() < deadline:
        for key, _ in selector.select(timeout=1.0):
            sock = key.fileobj
            assert isinstance(sock, socket.socket)
            data, ancillary, _, _ = sock.recvmsg(1 << 16, socket.CMSG_SPACE(16))
            if not data:
                raise RuntimeError("the front door closed a stream before [DONE]")
            stamp = next(
                (
                    seconds + nanoseconds * 1e-9 - offset
                    for level, kind, payload in ancillary
                    if level == socket.SOL_SOCKET and kind == SO_TIMESTAMPNS
                    for seconds, nanoseconds in [struct.unpack("qq", payload[:16])]
                ),
                None,
            )
            if stamp is None:
                raise RuntimeError("the kernel gave no receive time (SO_TIMESTAMPNS)")
            reads[sock].append((data, stamp))
            tails[sock] = (tails[sock] + data)[-64:]
            if b"data: [DONE]" in tails[sock]:
                selector.unregister(sock)
                sock.close()
    if selector.get_map():
        raise RuntimeError("streams not done within 300 s")
    return _parse(list(reads.values()))


CLIENTS = {"socket": _socket_client, "kernel": _kernel_client, "httpx": _httpx_client}


def measure(
    num_streams: int, num_tokens: int, step_s: float, client_kind: str = "socket", split_cores: bool = False
) -> list[dict[str, float | str]]:
    cpus = sorted(os.sched_getaffinity(0))
    client_cpus = cpus[1:] if split_cores else cpus
    if split_cores:
        if len(cpus) < 2:
            raise SystemExit("--split-cores needs at least 2 CPUs")
        os.sched_setaffinity(0, cpus[:1])  # before the gateway starts: its threads inherit it
    gateway = GatewayServer(GatewayConfig(policy="S&R"), SECRET, port=0, max_streams=num_streams + 8).start()
    with gateway.condition:
        gateway.coordinator.register(gateway.now_s(), 0, budget_bytes=GIB, holder_address="h")
    config = FrontDoorConfig(MODEL, 256, max_concurrent_requests=num_streams)
    worker = _PlayedWorker(gateway, step_s)
    try:
        with FrontDoor(gateway, config, frozenset([KEY])) as door:
            argv = [sys.executable, __file__, "--client", door.url, "--client-kind", client_kind,
                    "--streams", str(num_streams), "--tokens", str(num_tokens)]  # fmt: skip
            out = subprocess.run(
                argv,
                check=True,
                capture_output=True,
                text=True,
                timeout=300,
                preexec_fn=lambda: os.sched_setaffinity(0, client_cpus),
            ).stdout
    finally:
        worker.close()
        gateway.stop(grace_s=0.1)
    received = json.loads(out)
    delays_ms = np.array([(t - worker.accepted[(r, p)]) * 1e3 for r, p, t in received])
    if len(delays_ms) != num_streams * num_tokens:
        raise RuntimeError(f"the client got {len(delays_ms)} tokens, expected {num_streams * num_tokens}")
    return [
        {"metric": "relay_p50_ms", "value": float(np.percentile(delays_ms, 50))},
        {"metric": "relay_p99_ms", "value": float(np.percentile(delays_ms, 99))},
        {"metric": "relay_mean_ms", "value": float(delays_ms.mean())},
        {"metric": "tokens", "value": len(delays_ms)},
        {"metric": "streams", "value": num_streams},
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--streams", type=int, default=64)
    parser.add_argument("--tokens", type=int, default=64, help="output tokens of each stream")
    parser.add_argument("--step-s", type=float, default=0.02, help="the played worker's step")
    parser.add_argument("--json", default=None, metavar="PATH")
    parser.add_argument("--server-stack", choices=("auto", "pure"), default="auto")
    parser.add_argument("--client-kind", choices=tuple(CLIENTS), default="socket")
    parser.add_argument(
        "--split-cores", action="store_true", help="the gateway on the first CPU, the client on the rest"
    )
    parser.add_argument("--client", default=None, help=argparse.SUPPRESS)  # the client process
    args = parser.parse_args()
    if args.client is not None:
        print(json.dumps(asyncio.run(CLIENTS[args.client_kind](args.client, args.streams, args.tokens))))
        return
    if args.server_stack == "pure":  # this process serves nothing but the front door
        uvicorn.Config = functools.partial(uvicorn.Config, loop="asyncio", http="h11")  # type: ignore[misc]
    rows = measure(args.streams, args.tokens, args.step_s, args.client_kind, args.split_cores)
    for row in rows:
        print(f"{row['metric']:16} {row['value']:.3f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


# ---- pytest-benchmark (make bench): a small case, once --------------------------------------


def test_front_door_relay(benchmark) -> None:  # type: ignore[no-untyped-def]
    rows = benchmark.pedantic(measure, args=(8, 16, 0.02), rounds=1, iterations=1)
    assert {r["metric"]: r["value"] for r in rows}["tokens"] == 8 * 16


if __name__ == "__main__":
    main()
