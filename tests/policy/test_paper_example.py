"""The paper's 8-worker example: a worker serving 12 requests fails. Under FC all 12
checkpoints sit on its fixed neighbour, so all 12 requests land there; LUMEN placed them by
load, so they come back spread over the survivors."""

from __future__ import annotations

from collections import Counter

from lumen_core.policy import (
    CheckpointGrew,
    LoadConfig,
    LoadMonitor,
    RecoveryAction,
    RequestAdmitted,
    WorkerFailed,
    WorkerJoined,
    make_policy,
)

NUM_WORKERS = 8
REQUESTS_PER_WORKER = 12
FAILED = 3


def run(policy_name: str) -> tuple[LoadMonitor, list]:
    monitor = LoadMonitor(LoadConfig())
    policy = make_policy(policy_name)
    for worker_id in range(NUM_WORKERS):
        monitor.apply(WorkerJoined(0.0, worker_id, 64 * 2**30))
    # Steady state: every worker runs 12 requests; each is placed when its prefill is done.
    num_requests = NUM_WORKERS * REQUESTS_PER_WORKER
    prompts = [900 + 37 * (request_id % 11) for request_id in range(num_requests)]
    for request_id in range(num_requests):
        worker_id = request_id % NUM_WORKERS
        monitor.apply(RequestAdmitted(0.1, request_id, worker_id, prompts[request_id], 211))
    for request_id in range(num_requests):
        decision = policy.placement.place(monitor, request_id)
        for holder_id in decision.new_holder_ids:
            monitor.apply(CheckpointGrew(0.5, request_id, holder_id, prompts[request_id] + 50))
    monitor.apply(WorkerFailed(1.0, FAILED))
    decisions = policy.router.route(monitor, FAILED)
    return monitor, decisions


def test_fc_sends_all_twelve_to_one_neighbour():
    monitor, decisions = run("FC")
    assert len(decisions) == REQUESTS_PER_WORKER
    assert Counter(d.target_worker_id for d in decisions) == {FAILED + 1: 12}
    assert all(d.action is RecoveryAction.RESTORE for d in decisions)


def test_lumen_spreads_them():
    monitor, decisions = run("LUMEN")
    assert len(decisions) == REQUESTS_PER_WORKER
    per_target = Counter(d.target_worker_id for d in decisions)
    assert FAILED not in per_target
    assert len(per_target) >= 5 and max(per_target.values()) <= 3  # FC: 1 target, 12 requests
    assert all(d.action is RecoveryAction.RESTORE and d.restorable_tokens > 0 for d in decisions)
    fc_monitor, _ = run("FC")
    worst_lumen = max(monitor.load(w) for w in monitor.live_worker_ids())
    worst_fc = max(fc_monitor.load(w) for w in fc_monitor.live_worker_ids())
    assert worst_lumen < worst_fc


def test_sr_reprefills_on_the_least_loaded():
    monitor, decisions = run("S&R")
    per_target = Counter(d.target_worker_id for d in decisions)
    assert all(d.action is RecoveryAction.REPREFILL for d in decisions)
    assert max(per_target.values()) - min(per_target.values()) <= 1 and len(per_target) == 7
