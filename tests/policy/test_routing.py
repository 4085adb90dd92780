"""Routing: Algorithm 2 (LocalityAware), AllToHolder, Rebalance; theta/tau, holder-also-dead,
missing/stale/empty checkpoints, the remote-restore branch, L updated after each decision."""

from __future__ import annotations

import pytest

from lumen_core.policy import (
    AllToHolder,
    CheckpointEvicted,
    CheckpointGrew,
    Heartbeat,
    LoadMonitor,
    LocalityAware,
    Rebalance,
    RecoveryAction,
    RequestAdmitted,
    RouterConfig,
    WorkerFailed,
    WorkerRecovering,
)

RESTORE = RecoveryAction.RESTORE
REPREFILL = RecoveryAction.REPREFILL
REMOTE = RecoveryAction.REMOTE_RESTORE


def admit(
    monitor: LoadMonitor, request_id: int, worker_id: int, holders: tuple[int, ...] = (), durable: int = 0
) -> None:
    monitor.apply(RequestAdmitted(0.0, request_id, worker_id, 50, 50))
    if holders:
        monitor.reserve(request_id, holders, 100)
    for holder_id in holders:
        if durable:
            monitor.apply(CheckpointGrew(0.0, request_id, holder_id, durable))


def set_queues(monitor: LoadMonitor, queues: list[int]) -> None:
    for worker_id, depth in enumerate(queues):
        monitor.apply(Heartbeat(0.0, worker_id, depth, 0))


def summary(decisions):
    return [
        (d.request_id, d.target_worker_id, d.action, d.source_holder_id, d.restorable_tokens)
        for d in decisions
    ]


def test_locality_aware_theta_and_tau(make_cluster):
    # Before the failure: Q = [3, 1, 5, 1] and holders' prefixes add load; theta = 2 * mean L.
    monitor = make_cluster(4)
    set_queues(monitor, [0, 1, 5, 1])
    admit(monitor, 10, 0, holders=(1,), durable=100)  # short prefix, holder 1 cool: restore
    admit(monitor, 11, 0, holders=(2,), durable=100)  # short prefix, holder 2 hot: re-prefill
    admit(monitor, 12, 0, holders=(2,), durable=600)  # long prefix, holder 2 hot: restore anyway
    # L = [3, 1 + 1, 5 + 7, 1]: worker 2 holds 700 tokens (7 mean requests).
    assert [monitor.load(w) for w in range(4)] == [3.0, 2.0, 12.0, 1.0]
    monitor.apply(WorkerFailed(1.0, 0))
    decisions = LocalityAware().route(monitor, 0)
    theta = 2.0 * 18.0 / 4
    assert summary(decisions) == [
        (10, 1, RESTORE, 1, 100),
        (11, 3, REPREFILL, None, 0),
        (12, 2, RESTORE, 2, 600),
    ]
    assert f"<= theta={theta:.3f}" in decisions[0].reason
    assert "prefix short (100 <= tau=512 tokens): checkpoint dropped" in decisions[1].reason
    assert "|C_r|=600 > tau=512" in decisions[2].reason
    assert monitor.request(11).holder_ids == ()  # dropped on re-prefill
    assert monitor.running_on(0) == []


def test_every_router_updates_load_after_each_decision(make_cluster):
    for router in (Rebalance(), AllToHolder(), LocalityAware()):
        monitor = make_cluster(3)
        for request_id in range(4):
            admit(monitor, request_id, 0)
        monitor.apply(WorkerFailed(1.0, 0))
        targets = [d.target_worker_id for d in router.route(monitor, 0)]
        assert targets == [1, 2, 1, 2], router.name
        assert (monitor.load(1), monitor.load(2)) == (2.0, 2.0)


def test_theta_spreads_a_hot_holder(make_cluster):
    # One holder holds every short checkpoint (50 tokens = 0.5 each): each restore turns
    # 0.5 held into 1 queued, so it takes requests until it passes theta.
    monitor = make_cluster(4)
    set_queues(monitor, [0, 1, 1, 1])
    for request_id in range(6):
        admit(monitor, request_id, 0, holders=(1,), durable=50)
    assert [monitor.load(w) for w in range(4)] == [6.0, 4.0, 1.0, 1.0]  # theta = 2 * 3 = 6
    monitor.apply(WorkerFailed(1.0, 0))
    decisions = LocalityAware().route(monitor, 0)
    assert [(d.target_worker_id, d.action) for d in decisions] == [(1, RESTORE)] * 5 + [(2, REPREFILL)]
    assert "L=6.500 > theta=6.000" in decisions[5].reason
    fc = make_cluster(4)
    set_queues(fc, [0, 1, 1, 1])
    for request_id in range(6):
        admit(fc, request_id, 0, holders=(1,), durable=50)
    fc.apply(WorkerFailed(1.0, 0))
    assert {d.target_worker_id for d in AllToHolder().route(fc, 0)} == {1}


def test_holder_also_dead_missing_empty_and_evicted(make_cluster):
    monitor = make_cluster(5)
    admit(monitor, 1, 0, holders=(1,), durable=100)  # holder dies too
    admit(monitor, 2, 0)  # never checkpointed
    admit(monitor, 3, 0, holders=(2,), durable=0)  # reserved, nothing durable yet
    admit(monitor, 4, 0, holders=(3,), durable=100)  # evicted by its holder
    monitor.apply(CheckpointEvicted(0.5, 4, 3))
    monitor.apply(CheckpointGrew(0.6, 4, 3, 200))  # stale report after the eviction
    monitor.apply(WorkerFailed(1.0, 1))
    monitor.apply(WorkerFailed(1.0, 0))
    for router in (LocalityAware(), AllToHolder()):
        replay = make_cluster(5)
        admit(replay, 1, 0, holders=(1,), durable=100)
        admit(replay, 2, 0)
        admit(replay, 3, 0, holders=(2,), durable=0)
        admit(replay, 4, 0, holders=(3,), durable=100)
        replay.apply(CheckpointEvicted(0.5, 4, 3))
        replay.apply(CheckpointGrew(0.6, 4, 3, 200))
        replay.apply(WorkerFailed(1.0, 1))
        replay.apply(WorkerFailed(1.0, 0))
        decisions = router.route(replay, 0)
        assert all(d.action is REPREFILL and d.restorable_tokens == 0 for d in decisions)
        assert "no checkpoint: holders [1] died with it" in decisions[0].reason
        assert "no checkpoint (not placed, released, evicted or refused)" in decisions[1].reason
        assert "checkpoint empty" in decisions[2].reason
        assert "no checkpoint (not placed" in decisions[3].reason  # evicted; later report stale
        assert replay.request(1).lost_holder_ids == (1,)


def test_recovering_holder_is_not_usable(make_cluster):
    monitor = make_cluster(3)
    admit(monitor, 1, 0, holders=(1, 2), durable=100)
    monitor.apply(WorkerFailed(0.5, 1))
    monitor.apply(WorkerRecovering(0.6, 1))
    monitor.apply(WorkerFailed(1.0, 0))
    decision = LocalityAware().route(monitor, 0)[0]
    assert (decision.target_worker_id, decision.action) == (2, RESTORE)


def test_replicas_prefer_the_cool_holder_then_the_longest(make_cluster):
    monitor = make_cluster(4)
    set_queues(monitor, [0, 9, 0, 0])
    admit(monitor, 1, 0, holders=(1, 2))
    monitor.apply(CheckpointGrew(0.0, 1, 1, 300))
    monitor.apply(CheckpointGrew(0.0, 1, 2, 200))
    monitor.apply(WorkerFailed(1.0, 0))
    decision = LocalityAware().route(monitor, 0)[0]
    assert summary([decision]) == [(1, 2, RESTORE, 2, 200)]
    assert monitor.request(1).holder_ids == (1,)  # the other replica still protects it
    fc = make_cluster(4)
    set_queues(fc, [0, 9, 0, 0])
    admit(fc, 1, 0, holders=(1, 2))
    fc.apply(CheckpointGrew(0.0, 1, 1, 300))
    fc.apply(CheckpointGrew(0.0, 1, 2, 200))
    fc.apply(WorkerFailed(1.0, 0))
    assert summary(AllToHolder().route(fc, 0)) == [(1, 1, RESTORE, 1, 300)]


def test_rebalance_reprefills_everything(make_cluster):
    monitor = make_cluster(3)
    set_queues(monitor, [0, 2, 0])
    admit(monitor, 1, 0, holders=(1,), durable=300)
    monitor.apply(WorkerFailed(1.0, 0))
    decisions = Rebalance().route(monitor, 0)
    assert summary(decisions) == [(1, 2, REPREFILL, None, 0)]
    assert "S&R" in decisions[0].reason and monitor.request(1).holder_ids == ()


def hot_holder_cluster(make_cluster, durable: int) -> LoadMonitor:
    monitor = make_cluster(3)
    set_queues(monitor, [0, 8, 0])
    admit(monitor, 1, 0, holders=(1,), durable=durable)
    monitor.apply(WorkerFailed(1.0, 0))
    return monitor


def test_remote_restore_when_pull_is_cheaper(make_cluster):
    # SMALL: 1 byte per token; pulling at 1 KB/s vs re-prefilling 100 tokens/s.
    config = RouterConfig(remote_restore=True, pull_bytes_per_s=1000.0, reprefill_tokens_per_s=100.0)
    monitor = hot_holder_cluster(make_cluster, 600)
    decision = LocalityAware(config).route(monitor, 0)[0]
    assert summary([decision]) == [(1, 2, REMOTE, 1, 600)]
    assert "pulls 600 tokens from holder 1 in 0.600 s < re-prefill 6.000 s" in decision.reason
    assert monitor.request(1).holder_ids == (1,)  # the holder keeps its copy
    slow_pull = RouterConfig(remote_restore=True, pull_bytes_per_s=10.0, reprefill_tokens_per_s=100.0)
    monitor = hot_holder_cluster(make_cluster, 600)
    assert LocalityAware(slow_pull).route(monitor, 0)[0].action is RESTORE
    monitor = hot_holder_cluster(make_cluster, 600)
    assert LocalityAware().route(monitor, 0)[0].action is RESTORE  # branch off by default


def test_remote_restore_not_to_a_busier_worker(make_cluster):
    config = RouterConfig(remote_restore=True, pull_bytes_per_s=1000.0, reprefill_tokens_per_s=100.0)
    monitor = make_cluster(2)
    set_queues(monitor, [0, 8])
    admit(monitor, 1, 0, holders=(1,), durable=600)
    monitor.apply(WorkerFailed(1.0, 0))
    assert LocalityAware(config).route(monitor, 0)[0].action is RESTORE


def test_no_requests_and_validation(make_cluster):
    monitor = make_cluster(2)
    with pytest.raises(ValueError, match=r"`failed_worker_id` must be a failed worker, got 0 \(serving\)"):
        Rebalance().route(monitor, 0)
    with pytest.raises(TypeError, match="`monitor` must be a LoadMonitor, got int"):
        Rebalance().route(3, 0)
    with pytest.raises(TypeError, match="`failed_worker_id` must be an int, got str"):
        Rebalance().route(monitor, "0")
    with pytest.raises(IndexError, match="worker_id 4 is not a known worker"):
        Rebalance().route(monitor, 4)
    monitor.apply(WorkerFailed(0.0, 0))
    assert LocalityAware().route(monitor, 0) == []
    admit(monitor, 1, 1)
    monitor.apply(WorkerFailed(0.0, 1))
    with pytest.raises(
        ValueError, match="`monitor` must have a serving worker to route 1 requests to, got none"
    ):
        LocalityAware().route(monitor, 1)
    with pytest.raises(ValueError, match="`theta_multiple` must be >= 0, got -1"):
        RouterConfig(theta_multiple=-1)
    with pytest.raises(TypeError, match="`tau_tokens` must be an int, got float"):
        RouterConfig(tau_tokens=1.5)
    with pytest.raises(ValueError, match="`tau_tokens` must be >= 0, got -1"):
        RouterConfig(tau_tokens=-1)
    with pytest.raises(TypeError, match="`remote_restore` must be a bool, got str"):
        RouterConfig(remote_restore="yes")
    with pytest.raises(ValueError, match="`reprefill_tokens_per_s` must be > 0, got 0"):
        RouterConfig(reprefill_tokens_per_s=0)
    with pytest.raises(ValueError, match="`pull_bytes_per_s` must be > 0, got -1.0"):
        RouterConfig(pull_bytes_per_s=-1.0)
    with pytest.raises(TypeError, match="`config` must be a RouterConfig, got NoneType"):
        LocalityAware(None)


def test_remote_restore_needs_a_worker_that_is_not_a_holder(make_cluster):
    config = RouterConfig(
        theta_multiple=0.5, remote_restore=True, pull_bytes_per_s=1000.0, reprefill_tokens_per_s=100.0
    )
    monitor = make_cluster(3)
    set_queues(monitor, [0, 8, 9])
    admit(monitor, 1, 0, holders=(1, 2), durable=600)
    assert [monitor.load(w) for w in range(3)] == [1.0, 14.0, 15.0]  # theta = 0.5 * 10 = 5
    monitor.apply(WorkerFailed(1.0, 0))
    decision = LocalityAware(config).route(monitor, 0)[0]
    assert summary([decision]) == [(1, 1, RESTORE, 1, 600)]  # every survivor holds a copy
    assert "L=14.000 > theta=5.000" in decision.reason
