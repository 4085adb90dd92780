"""CPU time of reading a vLLM server's server-sent events: the agent's reader (aiohttp) against
httpx's, in one run (issue 20: the agent reads one event per output token).

A uvicorn server in this process (its own thread and event loop) streams ``--streams``
concurrent responses of ``--events`` completion events each, shaped as vLLM's with
``return_token_ids`` (one token an event), one every ``--interval-s``. A client in another
process reads them, with each library in turn (``--repeats`` alternations), parsing each event
as the agent does, and reports its process CPU seconds. Rows ``metric`` / ``value``:
``us_per_event_httpx``, ``us_per_event_aiohttp`` (the means), ``ratio`` (aiohttp over httpx).

    python bench/sse_reader.py --streams 64 --events 256 --json sse_reader.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys
import threading
import time
from pathlib import Path

import aiohttp
import httpx

from lumen_core.worker.upstream import open_session, stream_tokens

_EVENT = {
    "id": "cmpl-0", "object": "text_completion", "created": 0, "model": "/models/tiny",
    "choices": [{"index": 0, "text": " a", "logprobs": None, "finish_reason": None, "stop_reason": None,
                 "token_ids": [42], "prompt_token_ids": None}],
    "usage": None,
}  # fmt: skip


def _serve(port: int, events: int, interval_s: float) -> threading.Thread:
    import uvicorn
    from starlette.applications import Starlette
    from starlette.responses import StreamingResponse
    from starlette.routing import Route

    line = ("data: " + json.dumps(_EVENT) + "\n\n").encode()
    last = {**_EVENT, "choices": [{**_EVENT["choices"][0], "finish_reason": "length"}]}  # type: ignore[index]
    end = ("data: " + json.dumps(last) + "\n\ndata: [DONE]\n\n").encode()

    async def completions(request: object) -> StreamingResponse:
        async def body():  # noqa: ANN202
            for _ in range(events - 1):
                yield line
                await asyncio.sleep(interval_s)
            yield end

        return StreamingResponse(body(), media_type="text/event-stream")

    app = Starlette(routes=[Route("/v1/completions", completions, methods=["POST"])])
    server = uvicorn.Server(uvicorn.Config(app, port=port, log_level="error"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.05)
    return thread


async def _read_httpx(url: str, streams: int) -> int:
    async def one(http: httpx.AsyncClient) -> int:
        count = 0
        async with http.stream("POST", url, json={}) as response:
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                count += len(json.loads(line.removeprefix("data: "))["choices"][0]["token_ids"])
        return count

    async with httpx.AsyncClient(timeout=60.0, limits=httpx.Limits(max_connections=None)) as http:
        return sum(await asyncio.gather(*(one(http) for _ in range(streams))))


async def _read_aiohttp(url: str, streams: int) -> int:
    """The agent's own reader (``lumen_core.worker.upstream``)."""

    async def one(http: aiohttp.ClientSession) -> int:
        return sum([len(p.token_ids) async for p in stream_tokens(http, url, {}, 0)])

    http = await open_session()
    try:
        return sum(await asyncio.gather(*(one(http) for _ in range(streams))))
    finally:
        await http.close()


def _client(kind: str, url: str, streams: int) -> dict:
    read = {"httpx": _read_httpx, "aiohttp": _read_aiohttp}[kind]
    cpu = time.process_time()  # the imports above are not counted
    tokens = asyncio.run(read(url, streams))
    return {"cpu_s": time.process_time() - cpu, "tokens": tokens}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--streams", type=int, default=64)
    parser.add_argument("--events", type=int, default=256)
    parser.add_argument("--interval-s", type=float, default=0.002)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--port", type=int, default=18765)
    parser.add_argument("--json", default=None, metavar="PATH")
    parser.add_argument("--client", default=None, help=argparse.SUPPRESS)  # the client process
    args = parser.parse_args()
    url = f"http://127.0.0.1:{args.port}/v1/completions"
    if args.client is not None:
        print(json.dumps(_client(args.client, url, args.streams)))
        return
    _serve(args.port, args.events, args.interval_s)
    cpu: dict[str, list[float]] = {"httpx": [], "aiohttp": []}
    events = args.streams * args.events
    for _ in range(args.repeats):
        for kind in cpu:
            argv = [sys.executable, __file__, "--client", kind, "--port", str(args.port),
                    "--streams", str(args.streams)]  # fmt: skip
            done = subprocess.run(argv, capture_output=True, text=True, timeout=600, check=True)
            result = json.loads(done.stdout)
            if result["tokens"] != args.streams * args.events:
                raise RuntimeError(
                    f"{kind}: {result['tokens']} tokens, expected {args.streams * args.events}"
                )
            cpu[kind].append(result["cpu_s"])
            print(f"{kind:8} {cpu[kind][-1]:.3f} CPU s", file=sys.stderr, flush=True)
    per_event = {kind: 1e6 * sum(v) / len(v) / events for kind, v in cpu.items()}
    rows = [
        {"metric": "us_per_event_httpx", "value": per_event["httpx"]},
        {"metric": "us_per_event_aiohttp", "value": per_event["aiohttp"]},
        {"metric": "ratio", "value": per_event["aiohttp"] / per_event["httpx"]},
        {"metric": "cpu_s_runs", "value": cpu},
        {"metric": "events", "value": events},
    ]
    for row in rows[:3]:
        print(f"{row['metric']:22} {row['value']:.3f}")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()
