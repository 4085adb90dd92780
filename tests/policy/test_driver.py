"""RecoveryDriver: the protocol's order (what is recorded, in which order), the plans it
returns, join-shortest-queue admission, pairing and switch-over, and its errors."""

from __future__ import annotations

import pytest

from lumen_core.policy import (
    CheckpointGrew,
    Heartbeat,
    LoadConfig,
    PlacementConfig,
    RecoveryAction,
    RecoveryDriver,
    RequestFinished,
    WorkerJoined,
    WorkerRecovering,
    preset,
)


class ListRecorder:
    """A Recorder keeping (op, payload) in memory, in the order written."""

    def __init__(self) -> None:
        self.records: list[tuple[str, object]] = []

    def event(self, event: object) -> None:
        self.records.append(("event", event))

    def decision(self, op: str, args: dict[str, int], result: object) -> None:
        self.records.append((op, args))

    def gain(self, survivor_id: int, num_draft_tokens: int, value: float) -> None:
        self.records.append(("gain", (survivor_id, num_draft_tokens, value)))

    def ops(self) -> list[str]:
        return [op if op != "event" else type(payload).__name__ for op, payload in self.records]


@pytest.fixture
def make_driver(make_cluster):
    """make_driver(policy, num_workers=4, placement_config=...) -> (driver, its ListRecorder),
    the workers joined; every pairing is worth a gain of 1."""
    load_config = make_cluster(0).config  # the small units of the hand-made clusters

    def build(policy: str = "LUMEN", num_workers: int = 4, **configs: object):
        recorder = ListRecorder()
        factory = preset(policy, **configs)  # type: ignore[arg-type]
        driver = RecoveryDriver(factory, load_config, gain_fn=lambda m, s, k: 1.0, recorder=recorder)
        for worker_id in range(num_workers):
            driver.apply(WorkerJoined(0.0, worker_id, 10**9))
        return driver, recorder

    return build


def test_admission_is_join_shortest_queue_then_place(make_driver):
    driver, recorder = make_driver("FC")
    driver.apply(Heartbeat(0.1, 0, 3, 1))
    driver.apply(Heartbeat(0.1, 1, 1, 0))
    assert driver.choose_worker() == 2  # 2 and 3 report nothing: tie, lowest id
    assert driver.choose_worker(lambda w: {0: 0, 1: 5, 2: 5, 3: 5}[w]) == 0  # the caller's depths
    plan = driver.admit(0.2, 7, 2, 40, 10)
    assert (plan.request_id, plan.worker_id) == (7, 2)
    assert plan.placement.holder_ids == (3,) and driver.monitor.request(7).holder_ids == (3,)
    assert recorder.ops()[-2:] == ["RequestAdmitted", "place"]
    assert driver.finish(0.3, 7) == (3,) and not driver.monitor.has_request(7)
    assert recorder.records[-1] == ("event", RequestFinished(0.3, 7))


def test_no_serving_worker_means_no_choice(make_driver):
    driver, _ = make_driver(num_workers=1)
    driver.fail(1.0, [0])
    assert driver.choose_worker() is None


def test_failure_plan_is_made_in_the_protocols_order(make_driver):
    driver, recorder = make_driver("FC")
    for request_id, worker_id in ((1, 0), (2, 0), (3, 1)):
        driver.admit(0.1, request_id, worker_id, 40, 10)
        (holder_id,) = driver.monitor.request(request_id).holder_ids
        driver.apply(CheckpointGrew(0.2, request_id, holder_id, 30))
    del recorder.records[:]
    # 0 and its fixed neighbour 1 die together: 1 held 0's checkpoints, 2 held 1's.
    plan = driver.fail(1.0, [0, 1], cause="rack")
    assert (plan.time_s, plan.worker_ids, plan.cause, plan.lost_request_ids) == (1.0, (0, 1), "rack", ())
    assert (
        recorder.ops()
        == ["WorkerFailed"] * 2 + ["route", "place", "place", "route", "place"] + ["replace"] * 2
    )
    assert [r.route.request_id for r in plan.reroutes] == [1, 2, 3]
    assert [r.route.action for r in plan.reroutes] == [RecoveryAction.REPREFILL] * 2 + [
        RecoveryAction.RESTORE
    ]
    # 3 restores on its holder 2, which then serves it: no copy is left, it is placed again
    assert all(r.placement is not None and r.holder_ids == r.placement.holder_ids for r in plan.reroutes)
    assert plan.routes == tuple(r.route for r in plan.reroutes)
    assert plan.placements == tuple(r.placement for r in plan.reroutes)


def test_a_rerouted_request_keeps_its_surviving_holders(make_driver):
    driver, _ = make_driver("FC", placement_config=PlacementConfig(replicas=2))
    driver.admit(0.1, 1, 0, 40, 10)
    assert driver.monitor.request(1).holder_ids == (1, 2)
    driver.apply(CheckpointGrew(0.2, 1, 1, 30))
    plan = driver.fail(1.0, [0])
    (reroute,) = plan.reroutes
    assert reroute.route.target_worker_id == 1 and reroute.placement is None
    assert reroute.holder_ids == (2,)  # as routed; the replacement that follows tops it up
    (replaced,) = plan.replacements
    assert replaced.new_holder_ids == (3,) and driver.monitor.request(1).holder_ids == (2, 3)


@pytest.mark.parametrize("doomed_ids", [(), (2,)])
def test_requests_routed_to_a_doomed_worker_are_not_placed(make_driver, doomed_ids):
    driver, recorder = make_driver("FC", num_workers=4)
    driver.admit(0.1, 1, 0, 40, 10)
    del recorder.records[:]
    plan = driver.fail(1.0, [0, 1], doomed_ids=doomed_ids)  # 0's holder 1 dies with it
    (reroute,) = plan.reroutes
    assert reroute.route.target_worker_id == 2  # least loaded, lowest id
    placed = ["place"] if not doomed_ids else []
    assert recorder.ops() == ["WorkerFailed"] * 2 + ["route", *placed, "route"] + ["replace"] * 2
    assert (reroute.placement is None) == bool(doomed_ids)


def test_requests_are_lost_when_no_worker_is_left(make_driver):
    driver, recorder = make_driver("S&R", num_workers=2)
    driver.admit(0.1, 1, 0, 40, 10)
    driver.admit(0.1, 2, 1, 40, 10)
    plan = driver.fail(1.0, [0, 1])
    assert plan.lost_request_ids == (1, 2) and plan.reroutes == ()
    assert (
        recorder.ops()[-8:]
        == ["WorkerFailed"] * 2 + ["RequestFinished"] * 2 + ["route"] * 2 + ["replace"] * 2
    )
    assert driver.monitor.request_ids() == []


def test_pairing_recovery_and_switch_over(make_driver):
    driver, recorder = make_driver("LUMEN")
    driver.apply(Heartbeat(0.1, 2, 9, 0))  # the most loaded survivor
    driver.fail(1.0, [0])
    decision = driver.recover(2.0, 0)
    assert decision is not None and decision.survivor_id == 2
    assert recorder.records[-3:] == [
        ("event", WorkerRecovering(2.0, 0)),
        ("gain", (2, 4, 1.0)),
        ("pair", {"assistant_id": 0}),
    ]
    assert driver.survivor_of(0) == 2 and driver.num_draft_tokens(0, 0) == 2
    assert driver.num_draft_tokens(0, 10**6) == 4 and driver.num_draft_tokens(3, 0) == 0
    assert driver.switch_over(5.0, 0, 10**9, "a") == 2
    assert recorder.records[-2:] == [
        ("finish", {"assistant_id": 0}),
        ("event", WorkerJoined(5.0, 0, 10**9, "a")),
    ]
    assert driver.survivor_of(0) is None and driver.monitor.live_worker_ids() == [0, 1, 2, 3]


def test_a_failure_ends_the_pairings_of_the_dead_on_both_sides(make_driver):
    driver, recorder = make_driver("LUMEN")
    driver.apply(Heartbeat(0.1, 2, 9, 0))
    driver.apply(Heartbeat(0.1, 3, 5, 0))
    driver.fail(1.0, [0])
    driver.fail(1.0, [1])
    driver.recover(2.0, 0)  # assists 2
    driver.recover(2.0, 1)  # assists 3
    del recorder.records[:]
    plan = driver.fail(3.0, [2, 1])  # 2 is a survivor, 1 an assistant
    assert [(u.worker_id, u.freed_assistant_id, u.freed_survivor_id) for u in plan.unpairings] == [
        (2, 0, None),
        (1, None, 3),
    ]
    assert recorder.ops()[:4] == ["release_survivor", "finish", "WorkerFailed", "WorkerFailed"]
    assert driver.survivor_of(0) is None and driver.survivor_of(1) is None
    assert driver.end_pairings(2).freed_assistant_id is None  # ended once: nothing left to end


def test_without_a_planner_nothing_pairs(make_driver):
    driver, recorder = make_driver("FC")
    driver.fail(1.0, [0])
    assert not driver.assists and driver.recover(2.0, 0) is None
    assert driver.survivor_of(0) is None and driver.num_draft_tokens(0, 0) == 0
    with pytest.raises(ValueError, match="`policy` must assist to pair workers, got 'FC'"):
        driver.pair(0)
    assert driver.switch_over(3.0, 0, 10**9) is None and recorder.ops()[-1] == "WorkerJoined"


def test_validation():
    with pytest.raises(TypeError, match="`policy` must build a PolicySet, got str"):
        RecoveryDriver(lambda gain_fn: "LUMEN", LoadConfig())  # type: ignore[arg-type,return-value]


def test_a_move_routes_one_request_off_its_live_worker_and_is_recorded(make_driver, tmp_path):
    driver, recorder = make_driver("LUMEN")
    driver.admit(0.1, 1, 0, 40, 10)
    (holder,) = driver.monitor.request(1).holder_ids
    driver.apply(CheckpointGrew(0.2, 1, holder, 40))
    reroute = driver.move(0.3, 1)
    assert reroute.route.action is RecoveryAction.RESTORE and reroute.route.target_worker_id == holder
    assert driver.monitor.request(1).worker_id == holder and recorder.ops()[-2:] == ["move", "place"]
    again = driver.move(0.4, 1, reprefill=True)  # never onto the worker it runs on
    assert again.route.action is RecoveryAction.REPREFILL and again.route.target_worker_id != holder
    assert again.placement is not None and again.holder_ids == again.placement.holder_ids


def parking_driver(make_cluster, *, park_s=6.0, max_parked=8, num_workers=2):
    recorder = ListRecorder()
    driver = RecoveryDriver(
        preset("FC"), make_cluster(0).config, recorder=recorder, park_s=park_s, max_parked=max_parked
    )
    for worker_id in range(num_workers):
        driver.apply(WorkerJoined(0.0, worker_id, 10**9))
    return driver, recorder


def test_with_no_worker_left_the_requests_are_parked_then_rerouted_on_a_join(make_cluster):
    driver, recorder = parking_driver(make_cluster)
    driver.admit(0.1, 1, 0, 40, 10)
    driver.admit(0.1, 2, 1, 40, 10)
    plan = driver.fail(1.0, [0, 1])
    assert (plan.parked_request_ids, plan.lost_request_ids, plan.reroutes) == ((1, 2), (), ())
    assert [p.request_id for p in driver.parked] == [1, 2] and driver.parked[0].deadline_s == 7.0
    assert driver.unpark(2.0).reroutes == ()  # nobody serves yet: they stay parked
    assert len(driver.parked) == 2
    driver.apply(WorkerJoined(3.0, 0, 10**9))
    driver.apply(WorkerJoined(3.0, 5, 10**9))
    del recorder.records[:]
    moved = driver.unpark(3.0)
    assert [r.route.request_id for r in moved.reroutes] == [1, 2] and moved.expired == ()
    assert [r.route.action for r in moved.reroutes] == [RecoveryAction.REPREFILL] * 2
    assert [r.route.target_worker_id for r in moved.reroutes] == [0, 5]  # least loaded each time
    assert all(r.placement is not None and r.holder_ids for r in moved.reroutes)
    assert recorder.ops() == ["RequestAdmitted", "place"] * 2
    assert driver.parked == () and driver.monitor.request(1).worker_id == 0


def test_a_parked_request_restores_from_the_longest_copy_of_a_worker_back(make_cluster):
    driver, _ = parking_driver(make_cluster, num_workers=3)
    driver.admit(0.1, 1, 0, 40, 10)
    holders = driver.monitor.request(1).holder_ids
    driver.fail(1.0, [0, 1, 2])
    assert driver.parked[0].holder_ids == holders
    assert not driver.hold_parked(9, 1, 5)  # not parked
    driver.apply(WorkerJoined(3.0, 1, 10**9))
    driver.apply(WorkerJoined(3.0, 2, 10**9))
    assert driver.hold_parked(1, 1, 12) and driver.hold_parked(1, 2, 30) and driver.hold_parked(1, 1, 20)
    plan = driver.unpark(3.0, holder_wait_s=5.0)
    (reroute,) = plan.reroutes
    route = reroute.route
    assert (route.action, route.target_worker_id, route.source_holder_id, route.restorable_tokens) == (
        RecoveryAction.RESTORE,
        2,
        2,
        30,
    )
    assert plan.unused_copies == ((1, 1),) and driver.monitor.request(1).worker_id == 2
    assert 2 not in reroute.holder_ids  # a worker never holds what it serves


def test_a_parked_request_waits_for_its_holders_then_re_prefills(make_cluster):
    driver, _ = parking_driver(make_cluster, num_workers=3)
    driver.admit(0.1, 1, 0, 40, 10)
    (holder,) = driver.monitor.request(1).holder_ids
    driver.fail(1.0, [0, 1, 2])
    back = next(w for w in range(3) if w != holder)
    driver.apply(WorkerJoined(3.0, back, 10**9))
    assert driver.unpark(3.0, holder_wait_s=2.0).reroutes == ()  # its holder may come back
    assert driver.unpark(4.9, holder_wait_s=2.0).reroutes == ()
    (reroute,) = driver.unpark(5.0, holder_wait_s=2.0).reroutes
    assert reroute.route.action is RecoveryAction.REPREFILL and reroute.route.target_worker_id == back
    with pytest.raises(ValueError, match="holder_wait_s"):
        driver.unpark(5.0, holder_wait_s=-1.0)


def test_the_copies_of_an_expired_parked_request_are_released(make_cluster):
    driver, _ = parking_driver(make_cluster)
    driver.admit(0.1, 1, 0, 40, 10)
    driver.fail(1.0, [0, 1])
    driver.hold_parked(1, 1, 8)
    plan = driver.unpark(7.5)
    assert [p.request_id for p in plan.expired] == [1] and plan.unused_copies == ((1, 1),)


def test_parked_requests_past_their_deadline_or_over_max_parked_are_lost(make_cluster):
    driver, _ = parking_driver(make_cluster, max_parked=1)
    driver.admit(0.1, 1, 0, 40, 10)
    driver.admit(0.1, 2, 1, 40, 10)
    plan = driver.fail(1.0, [0, 1])
    assert (plan.parked_request_ids, plan.lost_request_ids) == ((1,), (2,))
    driver.apply(WorkerJoined(7.5, 0, 10**9))
    late = driver.unpark(7.5)  # 6.5 s parked, past park_s 6.0
    assert [p.request_id for p in late.expired] == [1] and late.reroutes == ()
    assert driver.parked == () and driver.monitor.request_ids() == []


def test_parking_bounds_are_checked(make_cluster):
    with pytest.raises(ValueError, match="park_s"):
        parking_driver(make_cluster, park_s=-1.0)
    with pytest.raises(ValueError, match="max_parked"):
        parking_driver(make_cluster, max_parked=-1)
