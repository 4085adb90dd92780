"""The front door over a live cluster of reference-engine workers, with the official ``openai``
client on real sockets: streams that survive a worker's SIGKILL, and a client that leaves."""

import json
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest

from lumen_core import _native
from lumen_core.engine import Engine, SamplingParams, load_model
from lumen_core.gateway.http.text import Tokenizer, write_byte_tokenizer
from lumen_core.worker.cluster import MODEL_NAME, LocalCluster

pytestmark = [
    pytest.mark.ucx,
    pytest.mark.skipif(not _native.HAS_UCX, reason="lumen_core._C_ucx is not built (LUMEN_UCX=ON)"),
    pytest.mark.timeout(240),
]

NUM_STREAMS = 16
MAX_TOKENS = 320  # long enough that every stream is mid-way when the last one has 8 tokens
KILL_AFTER_TOKENS = 8


def _prompt(i: int) -> list[int]:
    return [(7 * i + 3 * j + 1) % 256 for j in range(40)]


def _reference(
    model_path: Path, prompts: list[list[int]], samplings: list[SamplingParams]
) -> list[list[int]]:
    """The failure-free outputs: one engine, one batch (float64 logits and position-keyed draws
    do not depend on the batch)."""
    return Engine(load_model(model_path)).generate(prompts, samplings)


class _Stream:
    def __init__(self) -> None:
        self.token_ids: list[int] = []
        self.text = ""
        self.finish_reasons: list[str] = []
        self.usages: list[object] = []
        self.error = ""


def _sampling(i: int) -> SamplingParams:
    """Even streams greedy, odd ones seeded sampling (drawn by position: a resume repeats it)."""
    if i % 2 == 0:
        return SamplingParams(max_tokens=MAX_TOKENS)
    return SamplingParams(max_tokens=MAX_TOKENS, temperature=0.8, seed=1000 + i)


def _consume(client: openai.OpenAI, prompt: list[int], sampling: SamplingParams, stream: _Stream) -> None:
    try:
        events = client.completions.create(
            model=MODEL_NAME,
            prompt=prompt,
            max_tokens=MAX_TOKENS,
            temperature=sampling.temperature,
            seed=sampling.seed,
            stream=True,
            stream_options={"include_usage": True},
        )
        for chunk in events:
            if chunk.usage is not None:
                stream.usages.append(chunk.usage)
            for choice in chunk.choices:
                stream.token_ids.extend(choice.token_ids)
                stream.text += choice.text
                if choice.finish_reason is not None:
                    stream.finish_reasons.append(choice.finish_reason)
    except Exception as exc:  # noqa: BLE001 - the test asserts on it
        stream.error = f"{type(exc).__name__}: {exc}"


def test_sixteen_streams_greedy_and_seeded_survive_a_sigkill_with_every_token_once(tmp_path: Path) -> None:
    tokenizer = Tokenizer(write_byte_tokenizer(tmp_path / "tokenizer"))
    prompts = [_prompt(i) for i in range(NUM_STREAMS)]
    with LocalCluster(tmp_path, policy="FC", num_workers=3, tokenizer=tokenizer) as cluster:
        cluster.start()
        client = openai.OpenAI(
            base_url=cluster.door.url, api_key=cluster.api_key, max_retries=0, timeout=120.0
        )
        streams = [_Stream() for _ in prompts]
        threads = [
            threading.Thread(target=_consume, args=(client, p, _sampling(i), s))
            for i, (p, s) in enumerate(zip(prompts, streams))
        ]
        for thread in threads:
            thread.start()
        deadline = time.monotonic() + 120.0
        while min(len(s.token_ids) for s in streams) < KILL_AFTER_TOKENS:
            assert time.monotonic() < deadline and not any(s.error for s in streams)
            time.sleep(0.002)
        coordinator = cluster.gateway.coordinator
        with cluster.gateway.condition:
            running = {
                w: len(coordinator.monitor.running_on(w)) for w in coordinator.monitor.live_worker_ids()
            }
        victim = max(running, key=lambda w: running[w])
        cluster.kill(victim)
        for thread in threads:
            thread.join(timeout=120.0)
        assert not any(t.is_alive() for t in threads)
        failures = coordinator.failures  # a lease run out on a starved machine may add one
        causes = [(f.worker_ids, f.cause) for f in failures]
    assert [s.error for s in streams] == [""] * NUM_STREAMS
    killed = next(f for f in failures if f.worker_ids == (victim,))
    assert len(killed.reroutes) >= 2, causes  # streams were cut mid-way
    reference = _reference(cluster.model_path, prompts, [_sampling(i) for i in range(NUM_STREAMS)])
    assert [s.token_ids for s in streams] == reference  # none repeated, none missing, none changed
    assert [s.text for s in streams] == [tokenizer.decode(ids) for ids in reference]
    for stream in streams:
        assert stream.finish_reasons == ["length"]
        (usage,) = stream.usages  # counted once, across the failover too
        assert (usage.prompt_tokens, usage.completion_tokens, usage.total_tokens) == (
            40,
            MAX_TOKENS,
            40 + MAX_TOKENS,
        )


def test_a_client_that_disconnects_mid_stream_is_cancelled_on_its_worker(tmp_path: Path) -> None:
    max_tokens = 3000  # far more than it gets to before the client leaves
    with LocalCluster(tmp_path, policy="FC", num_workers=2) as cluster:
        cluster.start()
        body = {"model": MODEL_NAME, "prompt": _prompt(1), "max_tokens": max_tokens, "stream": True}
        headers = {"Authorization": f"Bearer {cluster.api_key}"}
        with (
            httpx.Client(timeout=30.0) as http,
            http.stream("POST", f"{cluster.door.url}/completions", json=body, headers=headers) as response,
        ):
            assert response.status_code == 200
            first = next(line for line in response.iter_lines() if line.startswith("data: "))
        # the client is gone (the connection closed) with the request far from done
        request_id = int(json.loads(first.removeprefix("data: "))["id"].removeprefix("cmpl-"))
        coordinator = cluster.gateway.coordinator
        deadline = time.monotonic() + 30.0
        while True:  # the front door notices the closed socket at its next send
            with cluster.gateway.condition:
                tokens, finished, _ = coordinator.tokens(request_id)
                held = coordinator.monitor.has_request(request_id)
            if finished:
                break
            assert time.monotonic() < deadline, "the request was not cancelled"
            time.sleep(0.02)
        assert len(tokens) < max_tokens and not held  # ended early; its checkpoint released
        time.sleep(1.0)  # the worker applies the CANCEL at its next step
        with cluster.gateway.condition:
            assert len(coordinator.tokens(request_id)[0]) < max_tokens
    assert sum(int(s["cancelled"]) for s in cluster.worker_stats()) == 1
