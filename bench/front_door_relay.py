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
library's; ``httpx`` stamps each event as an httpx client parses it, which adds that client's
own per-event cost (all 64 streams' events of a step arrive at once and are parsed one after
another). ``--server-stack pure`` serves with asyncio's own event loop and uvicorn's
pure-Python HTTP (h11) instead of what uvicorn picks (uvloop and httptools, from the ``http``
extra): the baseline of what they give. Rows ``metric`` / ``value``: ``relay_p50_ms``,
``relay_p99_ms``, ``relay_mean_ms``, ``tokens``, ``streams``.

    python bench/front_door_relay.py --streams 64 --tokens 64 --json relay.json
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
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


async def _socket_client(url: str, num_streams: int, num_tokens: int) -> list[tuple[int, int, float]]:
    """As ``_httpx_client``, each read stamped as it returns and parsed after the run: an SSE
    event ends with a blank line; its ``data:`` JSON carries the request id and token ids
    (the chunked encoding's size lines fall between events)."""
    address = httpx.URL(url)
    body = json.dumps({"model": MODEL, "prompt": [1, 2, 3], "max_tokens": num_tokens, "stream": True})
    head = (
        f"POST {address.path}/completions HTTP/1.1\r\nHost: {address.host}:{address.port}\r\n"
        f"Authorization: Bearer {KEY}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    )

    async def one() -> list[tuple[bytes, float]]:
        reader, writer = await asyncio.open_connection(address.host, address.port)
        writer.write((head + body).encode())
        reads, tail = [], b""
        while b"data: [DONE]" not in tail:
            data = await reader.read(1 << 16)
            if not data:
                raise RuntimeError("the front door closed a stream before [DONE]")
            reads.append((data, time.monotonic()))
            tail = (tail + data)[-64:]
        writer.close()
        return reads

    received: list[tuple[int, int, float]] = []
    for reads in await asyncio.gather(*(one() for _ in range(num_streams))):
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


CLIENTS = {"socket": _socket_client, "httpx": _httpx_client}


def measure(
    num_streams: int, num_tokens: int, step_s: float, client_kind: str = "socket"
) -> list[dict[str, float | str]]:
    gateway = GatewayServer(GatewayConfig(policy="S&R"), SECRET, port=0, max_streams=num_streams + 8).start()
    with gateway.condition:
        gateway.coordinator.register(gateway.now_s(), 0, budget_bytes=GIB, holder_address="h")
    config = FrontDoorConfig(MODEL, 256, max_concurrent_requests=num_streams)
    worker = _PlayedWorker(gateway, step_s)
    try:
        with FrontDoor(gateway, config, frozenset([KEY])) as door:
            argv = [sys.executable, __file__, "--client", door.url, "--client-kind", client_kind,
                    "--streams", str(num_streams), "--tokens", str(num_tokens)]  # fmt: skip
            out = subprocess.run(argv, check=True, capture_output=True, text=True, timeout=300).stdout
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
    parser.add_argument("--client", default=None, help=argparse.SUPPRESS)  # the client process
    args = parser.parse_args()
    if args.client is not None:
        print(json.dumps(asyncio.run(CLIENTS[args.client_kind](args.client, args.streams, args.tokens))))
        return
    if args.server_stack == "pure":  # this process serves nothing but the front door
        uvicorn.Config = functools.partial(uvicorn.Config, loop="asyncio", http="h11")  # type: ignore[misc]
    rows = measure(args.streams, args.tokens, args.step_s, args.client_kind)
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
