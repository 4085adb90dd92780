"""LoadMonitor: L in queue-equivalents, accounting of every event, and its validation."""

from __future__ import annotations

import numpy as np
import pytest

from lumen_core.policy import (
    CheckpointEvicted,
    CheckpointGrew,
    CheckpointRefused,
    CheckpointReleased,
    CheckpointReserved,
    Heartbeat,
    LoadAware,
    LoadConfig,
    LoadMonitor,
    PlacementConfig,
    RequestAdmitted,
    RequestFinished,
    WorkerFailed,
    WorkerJoined,
    WorkerRecovering,
    WorkerState,
)


def admit(monitor: LoadMonitor, request_id: int, worker_id: int, prompt: int = 50, output: int = 50) -> None:
    monitor.apply(RequestAdmitted(0.0, request_id, worker_id, prompt, output))


def test_load_formula_in_queue_equivalents(make_cluster):
    monitor = make_cluster(3)
    admit(monitor, 1, 0, prompt=60, output=40)
    monitor.reserve(1, (2,), 100)
    monitor.apply(Heartbeat(0.1, 1, 3, 2))
    assert monitor.load(0) == 1.0  # one running request
    assert monitor.load(1) == 5.0  # 3 running + 2 waiting
    assert monitor.load(2) == 0.6  # holds the 60-token prompt of a 100-token mean request
    monitor.apply(CheckpointGrew(0.2, 1, 2, 150))
    assert monitor.load(2) == 1.5
    assert monitor.worker(2).held_tokens == 150
    assert monitor.mean_load() == pytest.approx((1.0 + 5.0 + 1.5) / 3)


def test_alpha_beta_weights():
    monitor = LoadMonitor(LoadConfig(alpha=2.0, beta=0.5, mean_request_tokens=10.0, kv_bytes_per_token=1))
    for w in range(2):
        monitor.apply(WorkerJoined(0.0, w, 1000))
    admit(monitor, 7, 0, prompt=5, output=5)
    monitor.reserve(7, [1], 10)
    assert monitor.load(0) == 0.5
    assert monitor.load(1) == 2.0 * 5 / 10.0


def test_heartbeat_overrides_and_decisions_adjust_between(make_cluster):
    monitor = make_cluster(2)
    monitor.apply(Heartbeat(0.0, 0, 4, 1))
    admit(monitor, 1, 0)
    assert monitor.worker(0).num_running == 5
    monitor.apply(RequestFinished(0.1, 1))
    assert (monitor.worker(0).num_running, monitor.worker(0).num_waiting) == (4, 1)
    monitor.apply(Heartbeat(0.2, 0, 0, 1))
    admit(monitor, 2, 0)
    monitor.apply(RequestFinished(0.3, 2))
    assert monitor.load(0) == 1.0


def test_finish_takes_from_waiting_when_running_is_zero(make_cluster):
    monitor = make_cluster(1)
    admit(monitor, 1, 0)
    monitor.apply(Heartbeat(0.0, 0, 0, 2))
    monitor.apply(RequestFinished(0.1, 1))
    assert (monitor.worker(0).num_running, monitor.worker(0).num_waiting) == (0, 1)


def test_request_view_and_release(make_cluster):
    monitor = make_cluster(3)
    admit(monitor, 5, 0, prompt=30, output=20)
    monitor.reserve(5, (1, 2), 50)
    monitor.apply(CheckpointGrew(0.0, 5, 2, 40))
    view = monitor.request(5)
    assert view.worker_id == 0 and view.holder_ids == (1, 2)
    assert view.durable_tokens == ((1, 0), (2, 40))
    assert monitor.held_by(1) == [5] and monitor.running_on(0) == [5]
    assert monitor.request_footprint(5) == (0, 50, (1, 2))
    assert monitor.state(1) == "serving" and monitor.has_request(5) and monitor.request_ids() == [5]
    assert monitor.worker(1).reserved_bytes == 50 and monitor.free_bytes(1) == 10**9 - 50
    monitor.apply(CheckpointReleased(0.1, 5))
    assert monitor.request(5).holder_ids == ()
    assert monitor.worker(1).reserved_bytes == 0 and monitor.load(2) == 0.0


def test_growth_past_the_reservation_raises_it(make_cluster):
    monitor = make_cluster(2)
    admit(monitor, 1, 0, prompt=10, output=10)
    monitor.reserve(1, (1,), 20)
    monitor.apply(CheckpointGrew(0.0, 1, 1, 35))
    assert monitor.worker(1).reserved_bytes == 35
    monitor.apply(CheckpointGrew(0.0, 1, 1, 30))  # out of order report: lengths only grow
    assert monitor.request(1).durable_tokens == ((1, 35),)


def test_finish_releases_everything(make_cluster):
    monitor = make_cluster(2)
    admit(monitor, 1, 0)
    monitor.reserve(1, (1,), 100)
    monitor.apply(RequestFinished(1.0, 1))
    assert not monitor.has_request(1)
    assert monitor.worker(1).reserved_bytes == 0 and monitor.worker(1).held_tokens == 0
    assert monitor.load(0) == 0.0 and monitor.running_on(0) == []


def test_eviction_refusal_and_stale_reports(make_cluster):
    monitor = make_cluster(3)
    admit(monitor, 1, 0)
    monitor.reserve(1, (1, 2), 100)
    monitor.apply(CheckpointEvicted(0.0, 1, 1))
    monitor.apply(CheckpointRefused(0.0, 1, 2))
    assert monitor.request(1).holder_ids == ()
    assert monitor.refused_by(1) == frozenset({2})
    # A growth report for a copy that is gone is stale and ignored.
    monitor.apply(CheckpointGrew(0.1, 1, 1, 80))
    assert monitor.worker(1).held_tokens == 0 and monitor.request(1).durable_tokens == ()
    # Reports about a finished request are ignored too.
    monitor.apply(RequestFinished(0.2, 1))
    for event in (CheckpointGrew(0.3, 1, 1, 5), CheckpointReleased(0.3, 1), CheckpointEvicted(0.3, 1, 1)):
        monitor.apply(event)


def test_failure_drops_held_copies_and_keeps_interrupted_requests(make_cluster):
    monitor = make_cluster(4)
    admit(monitor, 1, 0)
    admit(monitor, 2, 1)
    monitor.reserve(1, (1,), 100)
    monitor.reserve(2, (2, 3), 100)
    monitor.apply(Heartbeat(0.0, 3, 3, 0))
    before = monitor.mean_load()
    monitor.apply(WorkerFailed(1.0, 1))
    assert monitor.mean_load_before_failure(1) == before
    assert monitor.live_worker_ids() == [0, 2, 3]
    assert monitor.worker(1).state == "failed"
    assert monitor.request(1).holder_ids == ()  # its holder died
    assert monitor.running_on(1) == [2]  # interrupted, still recorded on 1
    assert monitor.request(2).holder_ids == (2, 3)
    assert monitor.affected_by(1) == [1, 2]
    monitor.apply(WorkerFailed(1.1, 1))  # a second detection is a no-op
    assert monitor.affected_by(1) == [1, 2]


def test_recovery_and_rejoin_start_empty(make_cluster):
    monitor = make_cluster(2)
    monitor.apply(Heartbeat(0.0, 1, 5, 5))
    monitor.apply(WorkerFailed(1.0, 1))
    monitor.apply(WorkerRecovering(2.0, 1))
    assert monitor.worker(1).state == "recovering" and monitor.live_worker_ids() == [0]
    monitor.apply(Heartbeat(2.5, 1, 9, 9))  # not serving: ignored
    monitor.apply(WorkerJoined(3.0, 1, 500, "rack-b"))
    view = monitor.worker(1)
    assert (view.state, view.domain, view.budget_bytes, view.num_running) == ("serving", "rack-b", 500, 0)
    assert monitor.load(1) == 0.0 and monitor.affected_by(1) == []


def test_assign_moves_queue_and_consumes_the_targets_copy(make_cluster):
    monitor = make_cluster(3)
    admit(monitor, 1, 0)
    monitor.reserve(1, (1, 2), 100)
    monitor.apply(WorkerFailed(1.0, 0))
    monitor.assign(1, 1)
    assert monitor.request(1).worker_id == 1 and monitor.request(1).holder_ids == (2,)
    assert monitor.running_on(0) == [] and monitor.running_on(1) == [1]
    assert monitor.load(1) == 1.0 and monitor.worker(1).reserved_bytes == 0
    monitor.assign(1, 1)  # already there: no change
    assert monitor.load(1) == 1.0


def test_readmission_after_reroute_is_idempotent(make_cluster):
    monitor = make_cluster(2)
    admit(monitor, 1, 0)
    monitor.apply(WorkerFailed(1.0, 0))
    monitor.assign(1, 1)
    admit(monitor, 1, 1)
    assert monitor.load(1) == 1.0
    monitor.apply(WorkerJoined(2.0, 0, 100))
    admit(monitor, 1, 0)  # re-admitted elsewhere: moved
    assert monitor.running_on(0) == [1] and monitor.load(1) == 0.0


def test_workers_joining_out_of_order_keep_id_order():
    monitor = LoadMonitor()
    for w in (5, 2, 9, 0):
        monitor.apply(WorkerJoined(0.0, w, 10, "r" if w % 2 else ""))
    assert monitor.live_worker_ids() == [0, 2, 5, 9] and monitor.worker_ids() == [0, 2, 5, 9]
    admit(monitor, 1, 0)
    monitor.apply(Heartbeat(0.0, 2, 1, 0))
    assert monitor.least_loaded() == 5
    assert monitor.shares_domain(5, 9) and not monitor.shares_domain(0, 2)
    assert not monitor.shares_domain(5, 5)
    for w in range(10, 30):  # growth beyond the initial capacity
        monitor.apply(WorkerJoined(0.0, w, 10))
    assert monitor.worker(9).domain == "r" and monitor.worker(2).num_running == 1


def test_least_loaded_filters(make_cluster):
    monitor = make_cluster(4, domains=["a", "a", "b", "b"])
    monitor.apply(Heartbeat(0.0, 0, 0, 0))
    monitor.apply(Heartbeat(0.0, 1, 1, 0))
    monitor.apply(Heartbeat(0.0, 2, 2, 0))
    monitor.apply(Heartbeat(0.0, 3, 2, 0))
    assert monitor.least_loaded() == 0
    assert monitor.least_loaded(exclude=[0]) == 1
    assert monitor.least_loaded(exclude=[0], avoid_domains_of=[0]) == 2
    assert monitor.least_loaded(exclude=[2, 3], avoid_domains_of=[0]) == 0  # fallback
    assert monitor.least_loaded(exclude=[0], avoid_domains_of=[0, 3]) == 1  # every rack avoided
    admit(monitor, 1, 3)
    monitor.reserve(1, (2,), 10**9)
    assert monitor.least_loaded(exclude=[0, 1], min_free_bytes=1) == 3
    assert monitor.least_loaded(exclude=[0, 1, 3], min_free_bytes=1) is None
    assert monitor.max_free_bytes(exclude=[0, 1, 3]) == 0
    assert LoadMonitor().least_loaded() is None
    assert LoadMonitor().mean_load() == 0.0


def test_ties_break_by_lowest_id(make_cluster):
    monitor = make_cluster(5)
    for w in (4, 3, 1):
        monitor.apply(Heartbeat(0.0, w, 0, 0))
    monitor.apply(Heartbeat(0.0, 0, 1, 0))
    monitor.apply(Heartbeat(0.0, 2, 1, 0))
    assert monitor.least_loaded() == 1


# ---- validation ----------------------------------------------------------------------------
def test_config_validation():
    with pytest.raises(ValueError, match="alpha must be a number >= 0"):
        LoadConfig(alpha=-1.0)
    with pytest.raises(ValueError, match="beta must be a number >= 0"):
        LoadConfig(beta="1")
    with pytest.raises(ValueError, match="mean_request_tokens must be a number > 0"):
        LoadConfig(mean_request_tokens=0)
    with pytest.raises(ValueError, match="kv_bytes_per_token must be an int > 0"):
        LoadConfig(kv_bytes_per_token=1.5)
    with pytest.raises(TypeError, match="config must be a LoadConfig"):
        LoadMonitor({"alpha": 1})


def test_event_validation(make_cluster):
    monitor = make_cluster(2)
    with pytest.raises(TypeError, match="event must be one of policy.events' types, got str"):
        monitor.apply("joined")
    with pytest.raises(TypeError, match="worker_id must be an int, got float"):
        monitor.apply(WorkerJoined(0.0, 1.0, 10))
    with pytest.raises(TypeError, match="worker_id must be an int, got bool"):
        monitor.apply(WorkerFailed(0.0, True))
    with pytest.raises(ValueError, match="worker_id must be >= 0, got -1"):
        monitor.apply(WorkerJoined(0.0, -1, 10))
    with pytest.raises(ValueError, match="budget_bytes must be >= 0, got -5"):
        monitor.apply(WorkerJoined(0.0, 3, -5))
    with pytest.raises(TypeError, match="domain must be a str, got NoneType"):
        monitor.apply(WorkerJoined(0.0, 3, 5, None))
    with pytest.raises(
        ValueError, match=r"worker_id must be a worker that is not serving, got 1 \(serving\)"
    ):
        monitor.apply(WorkerJoined(0.0, 1, 10))
    with pytest.raises(IndexError, match="worker_id 7 is not a known worker"):
        monitor.apply(WorkerFailed(0.0, 7))
    with pytest.raises(ValueError, match=r"worker_id must be a failed worker, got 0 \(serving\)"):
        monitor.apply(WorkerRecovering(0.0, 0))
    with pytest.raises(ValueError, match="num_running must be >= 0, got -1"):
        monitor.apply(Heartbeat(0.0, 0, -1, 0))
    with pytest.raises(ValueError, match="num_waiting must be >= 0, got -2"):
        monitor.apply(Heartbeat(0.0, 0, 0, -2))
    with pytest.raises(ValueError, match="prompt_tokens must be >= 0, got -1"):
        monitor.apply(RequestAdmitted(0.0, 1, 0, -1, 0))
    with pytest.raises(ValueError, match="expected_output_tokens must be >= 0, got -1"):
        monitor.apply(RequestAdmitted(0.0, 1, 0, 1, -1))
    with pytest.raises(TypeError, match="request_id must be an int, got str"):
        monitor.apply(RequestAdmitted(0.0, "r", 0, 1, 1))
    with pytest.raises(IndexError, match="request_id 9 is not a tracked request"):
        monitor.apply(RequestFinished(0.0, 9))
    with pytest.raises(ValueError, match="durable_tokens must be >= 0, got -3"):
        monitor.apply(CheckpointGrew(0.0, 9, 0, -3))
    monitor.apply(WorkerFailed(0.0, 1))
    with pytest.raises(ValueError, match=r"worker_id must be a serving worker, got 1 \(failed\)"):
        monitor.apply(RequestAdmitted(0.0, 1, 1, 1, 1))


def test_query_validation(make_cluster):
    monitor = make_cluster(2)
    with pytest.raises(IndexError, match="worker_id 2 is not a known worker"):
        monitor.load(2)
    with pytest.raises(TypeError, match="worker_id must be an int, got str"):
        monitor.worker("0")
    with pytest.raises(IndexError, match="request_id 3 is not a tracked request"):
        monitor.request(3)
    with pytest.raises(ValueError, match="worker_id must be a worker that failed, got 0"):
        monitor.mean_load_before_failure(0)
    assert monitor.load(np.int64(1)) == 0.0


def test_reserve_and_assign_validation(make_cluster):
    monitor = make_cluster(3, budget_bytes=100)
    admit(monitor, 1, 0)
    with pytest.raises(TypeError, match="holder_ids must be a tuple or list, got set"):
        monitor.reserve(1, {1}, 10)
    with pytest.raises(ValueError, match=r"holder_ids must be distinct, got \[1, 1\]"):
        monitor.reserve(1, (1, 1), 10)
    with pytest.raises(ValueError, match="holder_ids must not contain the serving worker, got 0"):
        monitor.reserve(1, (0,), 10)
    with pytest.raises(ValueError, match=r"reserved_bytes must fit the holder's free budget, got 101 > 100"):
        monitor.reserve(1, (1, 2), 101)
    with pytest.raises(ValueError, match="reserved_bytes must be >= 0, got -1"):
        monitor.reserve(1, (1,), -1)
    assert monitor.request(1).holder_ids == ()  # nothing reserved by a failed call
    monitor.reserve(1, [1], 10)
    with pytest.raises(ValueError, match=r"holder_ids must be new holders, got 1 \(already holds\)"):
        monitor.reserve(1, (1,), 10)
    monitor.apply(WorkerFailed(0.0, 2))
    with pytest.raises(ValueError, match=r"worker_id must be a serving worker, got 2 \(failed\)"):
        monitor.reserve(1, (2,), 10)
    with pytest.raises(ValueError, match=r"worker_id must be a serving worker, got 2 \(failed\)"):
        monitor.assign(1, 2)
    monitor.apply(CheckpointReserved(0.0, 1, (), 5))
    with pytest.raises(IndexError, match="request_id 4 is not a tracked request"):
        monitor.apply(CheckpointReserved(0.0, 4, (1,), 5))


def test_replaying_reservations_rebuilds_the_same_accounting(make_cluster):
    live = make_cluster(5)
    replica = make_cluster(5)
    placement = LoadAware(PlacementConfig(replicas=2))
    for request_id in range(12):
        event = RequestAdmitted(0.0, request_id, request_id % 5, 40 + request_id, 30)
        live.apply(event)
        replica.apply(event)
        decision = placement.place(live, request_id)
        replica.apply(CheckpointReserved(0.0, request_id, decision.new_holder_ids, decision.reserved_bytes))
    for worker_id in range(5):
        assert replica.worker(worker_id) == live.worker(worker_id)
        assert replica.load(worker_id) == live.load(worker_id)
    assert [replica.request(r) for r in range(12)] == [live.request(r) for r in range(12)]


def test_states_are_one_enum_that_reads_as_its_value(make_cluster):
    monitor = make_cluster(2)
    monitor.apply(WorkerFailed(1.0, 1))
    assert monitor.state(0) is WorkerState.SERVING and monitor.worker(1).state is WorkerState.FAILED
    monitor.apply(WorkerRecovering(2.0, 1))
    assert monitor.state(1) is WorkerState.RECOVERING
    assert WorkerState.RECOVERING == "recovering" and WorkerState("serving") is WorkerState.SERVING
    assert f"{WorkerState.FAILED}" == str(WorkerState.FAILED) == "failed"
    assert {WorkerState.SERVING: 1}["serving"] == 1  # a str key finds it: drivers map either
