"""Hypothesis invariants over random event sequences, for every policy: placement never picks
the serving worker or a dead one and never exceeds a budget; every interrupted request gets
exactly one decision, to a serving worker; the incremental accounting equals a recount from
scratch; the same sequence gives the same decisions."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lumen_core.policy import (
    CheckpointEvicted,
    CheckpointGrew,
    CheckpointRefused,
    Heartbeat,
    LoadConfig,
    LoadMonitor,
    PlacementConfig,
    RecoveryAction,
    RequestAdmitted,
    RequestFinished,
    RouterConfig,
    WorkerFailed,
    WorkerJoined,
    WorkerRecovering,
    make_policy,
)

CONFIG = LoadConfig(alpha=1.0, beta=1.0, mean_request_tokens=100.0, kv_bytes_per_token=1)
NUM_WORKERS = 6
BUDGET_BYTES = 600  # a few checkpoints per holder, so budgets run out
KINDS = (
    "admit",
    "admit",
    "grow",
    "grow",
    "grow",
    "finish",
    "heartbeat",
    "fail",
    "recover",
    "rejoin",
    "evict",
    "refuse",
)

ops_strategy = st.lists(
    st.tuples(st.sampled_from(KINDS), st.integers(0, 2**16), st.integers(0, 2**16), st.integers(0, 2**16)),
    max_size=60,
)


def check_accounting(monitor: LoadMonitor) -> None:
    held = {w: 0 for w in monitor.worker_ids()}
    reserved = {w: 0 for w in monitor.worker_ids()}
    for request_id in monitor.request_ids():
        request = monitor.request(request_id)
        assert monitor.worker(request.worker_id).state in ("serving", "failed", "recovering")
        for holder_id, durable in request.durable_tokens:
            assert holder_id != request.worker_id
            assert monitor.worker(holder_id).state == "serving"
            held[holder_id] += max(durable, request.prompt_tokens)
            reserved[holder_id] += (
                request.prompt_tokens + request.expected_output_tokens
            ) * CONFIG.kv_bytes_per_token
    for worker_id in monitor.worker_ids():
        view = monitor.worker(worker_id)
        assert view.held_tokens == held[worker_id]
        assert view.reserved_bytes == reserved[worker_id] <= view.budget_bytes
        if view.state == "serving":
            queue = view.num_running + view.num_waiting
            assert monitor.load(worker_id) == pytest.approx(held[worker_id] / 100.0 + queue)


def drive(ops, policy_name: str, placement_config: PlacementConfig, domains: bool) -> list:
    monitor = LoadMonitor(CONFIG)
    policy = make_policy(
        policy_name,
        placement_config=placement_config,
        router_config=RouterConfig(
            tau_tokens=60, remote_restore=True, pull_bytes_per_s=1000.0, reprefill_tokens_per_s=100.0
        ),
    )
    for worker_id in range(NUM_WORKERS):
        monitor.apply(WorkerJoined(0.0, worker_id, BUDGET_BYTES, f"rack{worker_id // 2}" if domains else ""))
    log: list = []
    next_request_id = 0
    for step, (kind, a, b, c) in enumerate(ops):
        time_s = float(step)
        live = monitor.live_worker_ids()
        requests = monitor.request_ids()
        states = {w: monitor.worker(w).state for w in monitor.worker_ids()}
        if kind == "admit" and live:
            worker_id = live[a % len(live)]
            monitor.apply(RequestAdmitted(time_s, next_request_id, worker_id, b % 200 + 1, c % 100))
            decision = policy.placement.place(monitor, next_request_id)
            refused = monitor.refused_by(next_request_id)
            assert decision.request_id == next_request_id and decision.serving_worker_id == worker_id
            assert len(set(decision.holder_ids)) == len(decision.holder_ids) <= placement_config.replicas
            for holder_id in decision.new_holder_ids:
                assert holder_id != worker_id and holder_id in live and holder_id not in refused
            assert decision.reason
            log.append(decision)
            next_request_id += 1
        elif kind in ("grow", "evict", "refuse", "finish") and requests:
            request = monitor.request(requests[a % len(requests)])
            if kind == "finish":
                monitor.apply(RequestFinished(time_s, request.request_id))
            elif request.durable_tokens:
                holder_id, durable = request.durable_tokens[b % len(request.durable_tokens)]
                if kind == "grow":
                    size = request.prompt_tokens + request.expected_output_tokens
                    monitor.apply(
                        CheckpointGrew(time_s, request.request_id, holder_id, min(size, durable + c % 80))
                    )
                elif kind == "evict":
                    monitor.apply(CheckpointEvicted(time_s, request.request_id, holder_id))
                else:
                    monitor.apply(CheckpointRefused(time_s, request.request_id, holder_id))
        elif kind == "heartbeat" and live:
            monitor.apply(Heartbeat(time_s, live[a % len(live)], b % 8, c % 4))
        elif kind == "fail" and len(live) > 1:
            failed_id = live[a % len(live)]
            interrupted = set(monitor.running_on(failed_id))
            monitor.apply(WorkerFailed(time_s, failed_id))
            decisions = policy.router.route(monitor, failed_id)
            assert [d.request_id for d in decisions] == sorted(interrupted)
            survivors = monitor.live_worker_ids()
            for decision in decisions:
                assert decision.target_worker_id in survivors and decision.reason
                if decision.action is RecoveryAction.REPREFILL:
                    assert decision.restorable_tokens == 0 and decision.source_holder_id is None
                else:
                    assert decision.restorable_tokens > 0 and decision.source_holder_id in survivors
                assert monitor.request(decision.request_id).worker_id == decision.target_worker_id
            assert monitor.running_on(failed_id) == []
            replaced = policy.placement.replace(monitor, failed_id)
            for decision in replaced:
                assert failed_id not in decision.holder_ids
                assert decision.serving_worker_id not in decision.holder_ids
            log += decisions + replaced
        elif kind == "recover":
            failed = [w for w, s in states.items() if s == "failed"]
            if failed:
                monitor.apply(WorkerRecovering(time_s, failed[a % len(failed)]))
        elif kind == "rejoin":
            down = [w for w, s in states.items() if s == "recovering"]
            if down:
                monitor.apply(WorkerJoined(time_s, down[a % len(down)], BUDGET_BYTES, ""))
        check_accounting(monitor)
    return log


@pytest.mark.parametrize("policy_name", ["S&R", "FC", "LUMEN"])
@pytest.mark.parametrize("replicas,domains", [(1, False), (2, True)])
@settings(max_examples=40, deadline=None)
@given(ops=ops_strategy)
def test_invariants_and_determinism(ops, policy_name, replicas, domains):
    config = PlacementConfig(replicas=replicas)
    first = drive(ops, policy_name, config, domains)
    assert drive(ops, policy_name, config, domains) == first
