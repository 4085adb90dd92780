"""Concurrent streaming completions through the gateway's front door with the official
``openai`` client, and ``lumen agent`` processes beside real vLLM servers: what the failover
and drain tests of a vLLM cluster share."""

from __future__ import annotations

import contextlib
import math
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import openai
from engines import TLS, record_bytes

from lumen_core.gateway.config import GatewayConfig
from lumen_core.gateway.http.config import FrontDoorConfig
from lumen_core.gateway.http.front_door import FrontDoor
from lumen_core.gateway.server import GatewayServer
from lumen_core.policy.load import LoadConfig
from lumen_core.policy.routing import RouterConfig
from lumen_core.worker.vllm_demo import ready_victim

MODEL = "tiny"
KEY = "vllm-cluster-test-key-0123456789"  # the front door's one client API key
PROMPT_TOKENS = 40
SERVER_ARGS = "--skip-tokenizer-init --enforce-eager --max-model-len 1024 --seed 0"
# Not the default 10 s: beside two busy loops and other jobs (a run queue of up to 42 on 2
# cores), an agent's heartbeats were once 8.5 s apart, the gateway's process stalled 6.5 s
# at the same moment. A server's failure must come from its agent's exit report, not from a
# lease that ran out.
LEASE_S = 30.0


def prompt(i: int) -> list[int]:
    return [(7 * i + 3 * j + 1) % 500 + 5 for j in range(PROMPT_TOKENS)]


def temperature(i: int) -> float:
    """Greedy and seeded in pairs: whichever way the streams split over the servers, each has both."""
    return 0.0 if i % 4 < 2 else 0.8


class Stream:
    def __init__(self) -> None:
        self.request_id = 0
        self.inexact_from = -1  # output position of the first token marked resumed_inexact
        self.token_ids: list[int] = []
        self.finish_reasons: list[str] = []
        self.usages: list[Any] = []
        self.error = ""
        self.ended_s = math.nan  # time.monotonic() when the stream ended


def _consume(client: openai.OpenAI, i: int, max_tokens: int, stream: Stream) -> None:
    try:
        events = client.completions.create(
            model=MODEL,
            prompt=prompt(i),
            max_tokens=max_tokens,
            temperature=temperature(i),
            seed=1000 + i,
            stream=True,
            stream_options={"include_usage": True},
        )
        for chunk in events:
            stream.request_id = int(chunk.id.removeprefix("cmpl-"))
            if chunk.usage is not None:
                stream.usages.append(chunk.usage)
            for choice in chunk.choices:
                if (choice.model_extra or {}).get("resumed_inexact") and stream.inexact_from < 0:
                    stream.inexact_from = len(stream.token_ids)
                stream.token_ids.extend(choice.token_ids)
                if choice.finish_reason is not None:
                    stream.finish_reasons.append(choice.finish_reason)
    except Exception as exc:  # noqa: BLE001 - the test asserts on it
        stream.error = f"{type(exc).__name__}: {exc}"
    finally:
        stream.ended_s = time.monotonic()


def run_streams(
    client: openai.OpenAI,
    num_streams: int,
    max_tokens: int,
    on_progress: Callable[[list[Stream]], None] | None = None,
) -> list[Stream]:
    """``num_streams`` concurrent streams (stream i: ``prompt(i)``, ``temperature(i)``, seed
    1000 + i); ``on_progress`` runs on this thread while they stream."""
    streams = [Stream() for _ in range(num_streams)]
    threads = [
        threading.Thread(target=_consume, args=(client, i, max_tokens, s)) for i, s in enumerate(streams)
    ]
    for thread in threads:
        thread.start()
    if on_progress is not None:
        on_progress(streams)
    for thread in threads:
        thread.join(timeout=300.0)
    assert not any(t.is_alive() for t in threads)
    return streams


def start_gateway(secret: bytes) -> GatewayServer:
    """A LUMEN gateway on loopback for the tests' model (its KV bytes per token), lease LEASE_S.
    Every checkpoint is restored on its holder (tau 0): with two servers the one survivor holds
    the copies, and the rule that re-prefills a short prefix when its holder is over theta
    would only trade its restore for a prefill on that same server; on two loaded cores the
    reroutes' own load crossed theta in 2 of 5 runs."""
    config = GatewayConfig(
        policy="LUMEN",
        lease_s=LEASE_S,
        load_config=LoadConfig(kv_bytes_per_token=record_bytes()),
        router_config=RouterConfig(tau_tokens=0),
    )
    return GatewayServer(config, secret, port=0, max_streams=256).start()


def start_agents(
    spawn: Callable[[list[str]], Any],
    num_servers: int,
    gateway: str,
    secret_file: Path,
    model: Path,
    workdir: Path,
    server_args: str = SERVER_ARGS,
) -> tuple[list[Any], list[dict[str, Any]]]:
    """``lumen agent`` processes, worker ids 0.., each starting its vLLM server (1 GiB of KV,
    ``server_args``); their processes and their ``registered`` lines (the servers start side
    by side)."""
    agents = []
    for worker_id in range(num_servers):
        argv = [
            sys.executable, "-m", "lumen_core.cli", "agent", "--worker-id", str(worker_id),
            "--gateway", gateway, "--secret-file", str(secret_file), "--model", str(model),
            "--workdir", str(workdir), "--tls", TLS, "--kv-space-gib", "1", "--server-args", server_args,
            "--start-timeout-s", "400",
        ]  # fmt: skip
        agents.append(spawn(argv))
    registered = [agent.read() for agent in agents]
    assert [r["event"] for r in registered] == ["registered"] * num_servers
    return agents, registered


def busiest_once_restorable(gateway: GatewayServer, streams: list[Stream], min_tokens: int) -> int:
    """Wait (at most 300 s, no stream failing) for the demo's failure rule, ``ready_victim``:
    the worker running the most requests, at least 2, once each of them has ``min_tokens``
    tokens and its prompt durable as its holders last reported (what the router needs to
    restore it rather than re-prefill)."""
    deadline = time.monotonic() + 300.0
    while (victim := ready_victim(gateway, min_tokens, PROMPT_TOKENS)) is None:
        assert time.monotonic() < deadline and not any(s.error for s in streams)
        time.sleep(0.002)
    return victim


def kill_group(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


@contextlib.contextmanager
def front_door_client(gateway: GatewayServer) -> Iterator[openai.OpenAI]:
    """The gateway's front door for the tiny model, and an ``openai`` client of it."""
    config = FrontDoorConfig(MODEL, vocab_size=512, max_model_len=1024, engine="vllm")
    with FrontDoor(gateway, config, frozenset([KEY])) as door:
        yield openai.OpenAI(base_url=door.url, api_key=KEY, max_retries=0, timeout=300.0)


def undisturbed_streams(client: openai.OpenAI, num_streams: int, max_tokens: int) -> list[Stream]:
    """The reference run: the same streams with nothing done to the cluster, none failing."""
    reference = run_streams(client, num_streams, max_tokens)
    assert [s.error for s in reference] == [""] * num_streams
    return reference
