"""``lumen agent`` beside real ``vllm serve`` processes, behind the gateway's front door: the
official ``openai`` client's streams survive a server's SIGKILL with every token once.

Two servers (CPU, the tiny Llama of engines.py, 1 GiB of KV each, each bound to its own
core by its agent). 16 concurrent streams (half greedy, half seeded at temperature 0.8) run
once without a failure, then again while the busiest server's process group is SIGKILLed
once every stream has 8 tokens: its agent reports the exit at once, the gateway moves each
interrupted request to the survivor (restored from the checkpoint the survivor's holder
kept, prompt + tokens already sent, ``max_tokens`` shrunk) and every stream goes on. Greedy
streams are the failure-free run's token for token; a moved seeded stream is marked
``resumed_inexact`` (vLLM's generator restarts), one that was not moved is unchanged. Each
agent registers its server's worker identity, so every capability is bound to a server.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from engines import build_model
from streams import (
    PROMPT_TOKENS,
    Stream,
    busiest_once_restorable,
    front_door_client,
    kill_group,
    run_streams,
    start_agents,
    start_gateway,
    temperature,
    undisturbed_streams,
)

from lumen_core.integrations.vllm import control
from lumen_core.policy.events import RecoveryAction

NUM_SERVERS = 2
NUM_STREAMS = 16
# Long enough that every stream is mid-way when the last one has 8 tokens and the holders'
# next heartbeats report each checkpoint (a stream ran at up to 250 tokens/s here).
MAX_TOKENS = 480
KILL_AFTER_TOKENS = 8


@pytest.mark.timeout(900)
def test_streams_survive_a_vllm_servers_sigkill_with_every_token_once(
    tmp_path: Path, secret: bytes, secret_file: Path, spawn: Callable[[list[str]], Any]
) -> None:
    model = build_model(tmp_path / "model")
    gateway = start_gateway(secret)
    registered: list[dict[str, Any]] = []
    try:
        agents, registered = start_agents(spawn, NUM_SERVERS, gateway.address, secret_file, model, tmp_path)
        with front_door_client(gateway) as client:
            reference = undisturbed_streams(client, NUM_STREAMS, MAX_TOKENS)

            coordinator = gateway.coordinator
            victims: list[int] = []

            def kill_the_busiest(streams: list[Stream]) -> None:
                victim = busiest_once_restorable(gateway, streams, KILL_AFTER_TOKENS)
                victims.append(victim)
                kill_group(registered[victim]["server_pid"])

            streams = run_streams(client, NUM_STREAMS, MAX_TOKENS, kill_the_busiest)
            with gateway.condition:
                moved = [coordinator.request_worker(s.request_id)[1] > 1 for s in streams]
            (victim,) = victims
            survivor = 1 - victim
            connector = control.ask(tmp_path / f"control-{survivor}.sock", "stats")
            with gateway.condition:  # each agent registered its server's identity
                bound = [coordinator._workers[w].bound for w in range(NUM_SERVERS)]  # noqa: SLF001
        stopped = agents[victim].read()  # the victim's agent reported the exit and ended
        failures = coordinator.failures
    finally:
        for r in registered:
            kill_group(r["server_pid"])
        gateway.stop(grace_s=0.1)
    assert [s.error for s in streams] == [""] * NUM_STREAMS
    # Every capability was bound to its server's identity: a holder took the victim's appends
    # and the survivor's restore reads only on connections that proved those identities.
    assert bound == [True] * NUM_SERVERS
    assert (stopped["event"], stopped["status"]) == ("stopped", 4)
    killed = next(f for f in failures if f.worker_ids == (victim,))
    assert "exited" in killed.cause and len(killed.reroutes) >= 2  # streams were cut mid-way
    assert all(len(s.token_ids) == MAX_TOKENS for s in reference + streams)
    assert [s.inexact_from for s in reference] == [-1] * NUM_STREAMS
    greedy = [i for i in range(NUM_STREAMS) if temperature(i) == 0.0]
    seeded = [i for i in range(NUM_STREAMS) if temperature(i) > 0.0]
    # none repeated, none missing, none changed
    assert [streams[i].token_ids for i in greedy] == [reference[i].token_ids for i in greedy]
    assert [streams[i].inexact_from for i in greedy] == [-1] * len(greedy)  # greedy resumes exactly
    assert any(moved[i] for i in greedy) and any(moved[i] for i in seeded)
    for i in seeded:
        stream, expected = streams[i], reference[i].token_ids
        if moved[i]:  # marked from the move on; what it had before is the failure-free run's
            assert stream.inexact_from >= KILL_AFTER_TOKENS
            assert stream.token_ids[:KILL_AFTER_TOKENS] == expected[:KILL_AFTER_TOKENS]
        else:
            assert (stream.inexact_from, stream.token_ids) == (-1, expected)
    for stream in streams:
        assert stream.finish_reasons == ["length"]
        (usage,) = stream.usages  # counted once, across the failover too
        assert (usage.prompt_tokens, usage.completion_tokens) == (PROMPT_TOKENS, MAX_TOKENS)
    # The gateway routed the moved requests to restore from the survivor's holder, and the
    # survivor restored (a prompt still in its prefix cache from the failure-free run is
    # served from there instead: vLLM asks the connector only past a local hit).
    assert all(r.route.action == RecoveryAction.RESTORE for r in killed.reroutes), [
        (r.route.request_id, r.route.action.name, r.route.restorable_tokens, r.route.reason)
        for r in killed.reroutes
    ]
    assert connector["worker"].get("restores", 0) >= 1
    assert connector["worker"].get("restored_tokens", 0) > 0
    # Each restoring request's way in, on the host's one clock: vLLM took it, its scheduler
    # had it, looked it up, the lookup answered; the restored ones matched tokens.
    lookups = connector["lookups"]
    assert {int(t["request_id"]) for t in lookups} <= {r.route.request_id for r in killed.reroutes}
    assert len({t["request_id"] for t in lookups}) == len(lookups)  # one each: its first plan
    assert lookups and any(t["matched"] > 0 for t in lookups)
    ordered = [t["arrived_s"] - 0.01 <= t["added_s"] <= t["asked_s"] <= t["planned_s"] for t in lookups]
    assert all(ordered), lookups
