"""Placement: Algorithm 1 (LoadAware), FixedNeighbour, NoCheckpoint; budgets, replicas,
domains, refusals and re-placement after a holder dies."""

from __future__ import annotations

import pytest

from lumen_core.policy import (
    CheckpointRefused,
    FixedNeighbour,
    Heartbeat,
    LoadAware,
    LoadMonitor,
    NoCheckpoint,
    PlacementConfig,
    RequestAdmitted,
    RequestFinished,
    WorkerFailed,
    WorkerRecovering,
)


def admit(monitor: LoadMonitor, request_id: int, worker_id: int, prompt: int = 60, output: int = 40) -> None:
    monitor.apply(RequestAdmitted(0.0, request_id, worker_id, prompt, output))


def set_queues(monitor: LoadMonitor, queues: list[int]) -> None:
    for worker_id, depth in enumerate(queues):
        monitor.apply(Heartbeat(0.0, worker_id, depth, 0))


def test_load_aware_picks_argmin_other_than_serving(make_cluster):
    monitor = make_cluster(4)
    set_queues(monitor, [0, 3, 1, 2])
    admit(monitor, 1, 0)
    decision = LoadAware().place(monitor, 1)
    assert decision.holder_ids == (2,) and decision.new_holder_ids == (2,)
    assert decision.reserved_bytes == 100  # (60 + 40) tokens * 1 byte
    assert decision.serving_worker_id == 0
    assert "least-loaded worker 2" in decision.reason
    assert monitor.worker(2).reserved_bytes == 100 and monitor.held_by(2) == [1]


def test_load_aware_updates_load_after_each_placement(make_cluster):
    monitor = make_cluster(4)
    placement = LoadAware()
    holders = []
    for request_id in range(6):
        admit(monitor, request_id, 0, prompt=100, output=0)
        holders.append(placement.place(monitor, request_id).holder_ids[0])
    assert holders == [1, 2, 3, 1, 2, 3]


def test_load_aware_tie_break_lowest_id(make_cluster):
    monitor = make_cluster(5)
    set_queues(monitor, [1, 2, 1, 1, 1])
    admit(monitor, 1, 2)  # worker 2 serves it; 0, 3 and 4 tie at L=1
    assert LoadAware().place(monitor, 1).holder_ids == (0,)


def test_budget_exhaustion_moves_on_then_degrades(make_cluster):
    monitor = make_cluster(3, budget_bytes=150)
    placement = LoadAware()
    decisions = []
    for request_id in range(5):
        admit(monitor, request_id, 0)
        decisions.append(placement.place(monitor, request_id))
    assert [d.holder_ids for d in decisions] == [(1,), (2,), (), (), ()]
    assert decisions[2].reserved_bytes == 0
    assert "has 100 bytes free (largest free: 50)" in decisions[2].reason
    assert "not checkpointed, re-prefill on failure" in decisions[2].reason
    for worker_id in (1, 2):
        assert monitor.worker(worker_id).reserved_bytes <= monitor.worker(worker_id).budget_bytes


def test_replicas_are_distinct_and_partial_when_short(make_cluster):
    monitor = make_cluster(4, budget_bytes=100)
    placement = LoadAware(PlacementConfig(replicas=2))
    admit(monitor, 1, 0)
    first = placement.place(monitor, 1)
    assert first.holder_ids == (1, 2)
    admit(monitor, 2, 0)
    second = placement.place(monitor, 2)
    assert second.holder_ids == (3,)  # only one candidate left with room
    assert "copy not kept" in second.reason
    again = placement.place(monitor, 1)
    assert again.holder_ids == (1, 2) and again.new_holder_ids == ()
    assert "already has 2 of 2 holders" in again.reason


def test_domains_avoid_the_serving_rack(make_cluster):
    monitor = make_cluster(4, domains=["a", "a", "b", "b"])
    set_queues(monitor, [0, 0, 5, 5])
    admit(monitor, 1, 0)
    decision = LoadAware().place(monitor, 1)
    assert decision.holder_ids == (2,)  # worker 1 is less loaded but shares rack "a"
    unconstrained = LoadAware(PlacementConfig(respect_domains=False))
    admit(monitor, 2, 0)
    assert unconstrained.place(monitor, 2).holder_ids == (1,)


def test_domains_fall_back_and_say_so(make_cluster):
    monitor = make_cluster(3, budget_bytes=100, domains=["a", "a", "b"])
    admit(monitor, 1, 0)
    admit(monitor, 2, 0)
    placement = LoadAware()
    assert placement.place(monitor, 1).holder_ids == (2,)
    decision = placement.place(monitor, 2)  # rack b is full: rack a is the only choice
    assert decision.holder_ids == (1,)
    assert "shares domain 'a' with serving worker 0" in decision.reason


def test_never_places_on_dead_or_recovering_workers(make_cluster):
    monitor = make_cluster(4)
    monitor.apply(WorkerFailed(0.0, 1))
    monitor.apply(WorkerFailed(0.0, 2))
    monitor.apply(WorkerRecovering(1.0, 2))
    admit(monitor, 1, 0)
    assert LoadAware(PlacementConfig(replicas=3)).place(monitor, 1).holder_ids == (3,)


def test_refusing_holder_is_skipped_next_time(make_cluster):
    monitor = make_cluster(3)
    admit(monitor, 1, 0)
    placement = LoadAware()
    assert placement.place(monitor, 1).holder_ids == (1,)
    monitor.apply(CheckpointRefused(0.1, 1, 1))
    assert placement.place(monitor, 1).holder_ids == (2,)


def test_replace_after_holder_loss(make_cluster):
    monitor = make_cluster(4)
    set_queues(monitor, [0, 0, 2, 1])
    placement = LoadAware()
    for request_id in (1, 2):
        admit(monitor, request_id, 0)
        assert placement.place(monitor, request_id).holder_ids == (1,)
    monitor.apply(WorkerFailed(1.0, 1))
    assert monitor.request(1).holder_ids == ()
    decisions = placement.replace(monitor, 1)
    assert [(d.request_id, d.holder_ids) for d in decisions] == [(1, (3,)), (2, (3,))]
    assert placement.replace(monitor, 1) == []  # already re-placed
    monitor.apply(WorkerFailed(2.0, 3))  # the new holder dies too
    monitor.apply(RequestFinished(2.1, 1))
    decisions = placement.replace(monitor, 3)  # 1 finished: only 2 needs a holder
    assert [(d.request_id, d.new_holder_ids) for d in decisions] == [(2, (2,))]
    assert monitor.request(2).lost_holder_ids == (1, 3)


def test_fixed_neighbour_ring(make_cluster):
    monitor = make_cluster(4)
    placement = FixedNeighbour()
    for request_id, worker_id in enumerate([0, 1, 3]):
        admit(monitor, request_id, worker_id)
    assert [placement.place(monitor, r).holder_ids for r in range(3)] == [(1,), (2,), (0,)]
    monitor.apply(WorkerFailed(1.0, 1))
    admit(monitor, 10, 0)
    assert placement.place(monitor, 10).holder_ids == (2,)  # next live worker
    admit(monitor, 11, 3)
    assert FixedNeighbour(PlacementConfig(replicas=2)).place(monitor, 11).holder_ids == (0, 2)


def test_fixed_neighbour_is_fixed_when_full(make_cluster):
    monitor = make_cluster(3, budget_bytes=150)
    placement = FixedNeighbour()
    admit(monitor, 1, 0)
    admit(monitor, 2, 0)
    assert placement.place(monitor, 1).holder_ids == (1,)
    decision = placement.place(monitor, 2)
    assert decision.holder_ids == ()  # worker 2 has room, but FC does not look there
    assert "neighbour 1 is full (50 of 100 bytes free)" in decision.reason


def test_fixed_neighbour_domains(make_cluster):
    monitor = make_cluster(4, domains=["a", "a", "b", "b"])
    admit(monitor, 1, 0)
    admit(monitor, 2, 2)
    placement = FixedNeighbour()
    assert placement.place(monitor, 1).holder_ids == (2,)
    assert placement.place(monitor, 2).holder_ids == (0,)
    monitor.apply(WorkerFailed(0.0, 2))
    monitor.apply(WorkerFailed(0.0, 3))
    admit(monitor, 3, 0)
    decision = placement.place(monitor, 3)
    assert decision.holder_ids == (1,) and "shares domain 'a'" in decision.reason


def test_no_live_neighbour(make_cluster):
    monitor = make_cluster(2)
    monitor.apply(WorkerFailed(0.0, 1))
    admit(monitor, 1, 0)
    assert FixedNeighbour().place(monitor, 1).holder_ids == ()
    assert "no live neighbour of worker 0" in FixedNeighbour().place(monitor, 1).reason
    assert LoadAware().place(monitor, 1).holder_ids == ()


def test_no_checkpoint(make_cluster):
    monitor = make_cluster(3)
    admit(monitor, 1, 0)
    decision = NoCheckpoint().place(monitor, 1)
    assert decision.holder_ids == () and decision.reserved_bytes == 0
    assert "stop-and-restart" in decision.reason
    monitor.apply(WorkerFailed(0.0, 1))
    assert NoCheckpoint().replace(monitor, 1) == []


def test_validation(make_cluster):
    monitor = make_cluster(3)
    admit(monitor, 1, 0)
    with pytest.raises(ValueError, match="`replicas` must be >= 1, got 0"):
        PlacementConfig(replicas=0)
    with pytest.raises(TypeError, match="`respect_domains` must be a bool, got int"):
        PlacementConfig(respect_domains=1)
    with pytest.raises(TypeError, match="`config` must be a PlacementConfig, got dict"):
        LoadAware({})
    with pytest.raises(TypeError, match="`monitor` must be a LoadMonitor, got NoneType"):
        LoadAware().place(None, 1)
    with pytest.raises(TypeError, match="`request_id` must be an int, got float"):
        LoadAware().place(monitor, 1.0)
    with pytest.raises(IndexError, match="request_id 2 is not a tracked request"):
        LoadAware().place(monitor, 2)
    with pytest.raises(ValueError, match=r"`lost_holder_id` must be a failed worker, got 1 \(serving\)"):
        LoadAware().replace(monitor, 1)
    with pytest.raises(IndexError, match="worker_id 5 is not a known worker"):
        NoCheckpoint().replace(monitor, 5)
    monitor.apply(WorkerFailed(0.0, 0))
    with pytest.raises(
        ValueError, match=r"`request_id` must be a request on a serving worker, got 1 on worker 0 \(failed\)"
    ):
        LoadAware().place(monitor, 1)


def test_two_replicas_both_outside_the_serving_rack(make_cluster):
    monitor = make_cluster(5, domains=["a", "a", "b", "b", "c"])
    set_queues(monitor, [0, 0, 3, 1, 2])
    admit(monitor, 1, 0)
    decision = LoadAware(PlacementConfig(replicas=2)).place(monitor, 1)
    assert decision.holder_ids == (3, 4)  # worker 1 is idle but in rack "a"
    assert "shares domain" not in decision.reason
