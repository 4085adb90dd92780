"""Each gateway call maps onto the ``RecoveryDriver`` calls it stands for.

The coordinator and the simulator drive the policies through one ``policy.driver.RecoveryDriver``
(its protocol and plans are tested in tests/policy/test_driver.py), so what is left to check on
the gateway side is the mapping: each Coordinator call makes exactly the driver calls listed
here, with these arguments, in this order, and no other. ``CallLog`` stands in front of the
coordinator's real driver and records every call it receives. Last, the log a live gateway's
driver writes (gRPC, real clients, a failure and an assist pairing) replays through fresh
policy objects (``lumen_core.eventlog.replay_event_log``) to the same decisions.
"""

from __future__ import annotations

import inspect

import pytest

from lumen_core.eventlog import EventLog, read_event_log, replay_event_log
from lumen_core.gateway.config import GatewayConfig
from lumen_core.gateway.coordinator import Coordinator
from lumen_core.gateway.reports import HeldReport, RunningReport, WorkerReport
from lumen_core.policy.driver import RecoveryDriver
from lumen_core.policy.events import (
    CheckpointEvicted,
    CheckpointGrew,
    CheckpointRefused,
    CheckpointReserved,
    Heartbeat,
    RequestAdmitted,
    WorkerFailed,
    WorkerJoined,
    WorkerState,
)
from lumen_core.policy.load import LoadConfig
from lumen_core.policy.presets import make_policy

pytestmark = pytest.mark.timeout(60)

SECRET = b"replay-test-secret-0123456789"
BUDGET = 64 << 30
DRIVER_CALLS = (
    "admit",
    "apply",
    "choose_worker",
    "drain",
    "end_pairings",
    "fail",
    "finish",
    "forget_parked",
    "hold_parked",
    "move",
    "num_draft_tokens",
    "pair",
    "park_admission",
    "place",
    "recover",
    "survivor_of",
    "switch_over",
    "unpark",
)


class CallLog:
    """In front of a real driver: records each call (name, args, kwargs), then makes it."""

    def __init__(self, driver: RecoveryDriver) -> None:
        self._driver = driver
        self.calls: list[tuple[str, tuple, dict]] = []

    def __getattr__(self, name: str):
        attr = getattr(self._driver, name)
        if name not in DRIVER_CALLS:
            return attr

        def call(*args, **kwargs):
            self.calls.append((name, args, kwargs))
            return attr(*args, **kwargs)

        return call

    def take(self) -> list[tuple[str, tuple, dict]]:
        calls, self.calls = self.calls, []
        return calls


def call(name: str, *args: object, **kwargs: object) -> tuple[str, tuple, dict]:
    return name, args, kwargs


def recorded_coordinator(policy: str = "LUMEN", num_workers: int = 3) -> tuple[Coordinator, CallLog]:
    coordinator = Coordinator(GatewayConfig(policy=policy), SECRET)
    log = CallLog(coordinator.driver)
    coordinator.driver = log  # type: ignore[assignment]
    for worker_id in range(num_workers):
        coordinator.register(0.0, worker_id, budget_bytes=BUDGET, holder_address=f"h{worker_id}")
        assert log.take() == [call("apply", WorkerJoined(0.0, worker_id, BUDGET, ""))]
    return coordinator, log


def test_every_driver_call_is_one_the_log_records():
    public = {
        name
        for name, member in inspect.getmembers(RecoveryDriver)
        if not name.startswith("_") and inspect.isfunction(member)
    }
    assert public == set(DRIVER_CALLS)


def test_gateway_calls_map_onto_driver_calls():
    coordinator, log = recorded_coordinator()
    first = coordinator.admit(0.1, [1] * 50, 20)
    assert log.take() == [call("choose_worker"), call("admit", 0.1, 1, 0, 50, 20)]
    second = coordinator.admit(0.1, [1] * 30, 10, worker_id=2)
    assert log.take() == [call("admit", 0.1, 2, 2, 30, 10)]
    (holder_id,) = first.placement.holder_ids

    coordinator.heartbeat(
        0.2, holder_id, 1, WorkerReport(num_running=2, num_waiting=1, held=(HeldReport(1, 1, 40),))
    )
    assert log.take() == [
        call("apply", Heartbeat(0.2, holder_id, 2, 1)),
        call("apply", CheckpointGrew(0.2, 1, holder_id, 40)),
    ]
    (other_holder,) = second.placement.holder_ids
    coordinator.heartbeat(0.3, other_holder, 1, WorkerReport(refused_request_ids=(2,)))
    assert log.take() == [
        call("apply", Heartbeat(0.3, other_holder, 0, 0)),
        call("apply", CheckpointRefused(0.3, 2, other_holder)),
        call("place", 2),
    ]
    coordinator.heartbeat(0.35, holder_id, 1, WorkerReport(evicted_request_ids=(1,)))
    assert log.take() == [
        call("apply", Heartbeat(0.35, holder_id, 0, 0)),
        call("apply", CheckpointEvicted(0.35, 1, holder_id)),
    ]
    coordinator.report_tokens(0.4, 2, 1, 2, 1, 0, [5] * 10, finished=True)
    assert log.take() == [call("finish", 0.4, 2)]
    coordinator.move(0.45, 1, "drain")
    assert log.take() == [call("move", 0.45, 1, reprefill=False)]

    assert coordinator.process_exited(1.0, 0, 1, "SIGKILL") is not None
    assert log.take() == [call("fail", 1.0, [0], cause="process exited: SIGKILL")]
    registration = coordinator.register(2.0, 0, state=WorkerState.RECOVERING, holder_address="h0")
    assert log.take() == [call("recover", 2.0, 0)]
    assert registration.assist is not None and registration.assist.survivor_id is not None
    coordinator.heartbeat(
        2.5,
        0,
        registration.epoch,
        WorkerReport(assist_steps=3, proposed_draft_tokens=6, accepted_draft_tokens=4),
        state=WorkerState.RECOVERING,
    )
    assert log.take() == [call("survivor_of", 0), call("num_draft_tokens", 0, 3)]
    coordinator.model_loaded(3.0, 0, registration.epoch, BUDGET)
    assert log.take() == [call("switch_over", 3.0, 0, BUDGET, "")]

    coordinator.register(3.5, 1, budget_bytes=BUDGET, holder_address="h1")  # 1 restarted unseen
    assert log.take() == [
        call("fail", 3.5, [1], cause="worker 1 registered again (epoch 1 is gone)"),
        call("apply", WorkerJoined(3.5, 1, BUDGET, "")),
    ]
    assert coordinator.expire_leases(20.0) is not None
    assert log.take() == [call("fail", 20.0, [0, 1, 2], cause="lease expired")]
    assert coordinator.admit(20.1, [1] * 5, 5).parked  # every worker failed: parked, not refused
    assert log.take() == [call("choose_worker"), call("park_admission", 20.1, 3, 5, 5)]
    coordinator.register(21.0, 2, budget_bytes=BUDGET, holder_address="h2")
    assert log.take() == [
        call("apply", WorkerJoined(21.0, 2, BUDGET, "")),
        call("unpark", 21.0, holder_wait_s=10.0),
    ]


def test_a_drain_maps_onto_drain_then_a_move_per_request():
    coordinator, log = recorded_coordinator(policy="FC")
    rid = coordinator.admit(0.1, [1] * 20, 10, worker_id=0).request_id
    log.take()
    coordinator.drain(0.2, 0, 5.0)
    assert log.take() == [call("drain", 0.2, 0)]
    coordinator.heartbeat(0.3, 0, 1, WorkerReport(flushed=True))
    assert log.take() == [call("move", 0.3, rid, reprefill=False)]  # a draining worker's load is not fed
    assert coordinator.process_exited(0.4, 0, 1, "drained") is None  # retired, not failed
    assert log.take() == [call("apply", WorkerFailed(0.4, 0))]


def test_a_restarted_gateways_adoptions_map_onto_events():
    coordinator, log = recorded_coordinator(num_workers=0)
    running = RunningReport(7, 1, (1,) * 20, (), 10, 10)
    coordinator.register(0.0, 0, budget_bytes=BUDGET, running=[running])
    assert log.take() == [
        call("apply", WorkerJoined(0.0, 0, BUDGET, "")),
        call("apply", RequestAdmitted(0.0, 7, 0, 20, 10)),
    ]
    coordinator.register(0.0, 1, budget_bytes=BUDGET, held=[HeldReport(7, 1, 12)])
    reserved = 30 * coordinator.config.load_config.kv_bytes_per_token
    assert log.take() == [
        call("apply", WorkerJoined(0.0, 1, BUDGET, "")),
        call("apply", CheckpointReserved(0.0, 7, (1,), reserved)),
        call("apply", CheckpointGrew(0.0, 7, 1, 12)),
    ]


def test_the_mapping_depends_on_the_policy_so_the_check_can_fail():
    """Under FC nothing pairs: the same recovering worker's heartbeat asks the driver nothing,
    where under LUMEN it asks for its survivor and draft length."""
    calls = {}
    for policy in ("FC", "LUMEN"):
        coordinator, log = recorded_coordinator(policy)
        coordinator.process_exited(1.0, 0, 1)
        registration = coordinator.register(2.0, 0, state=WorkerState.RECOVERING)
        log.take()
        coordinator.heartbeat(
            2.5, 0, registration.epoch, WorkerReport(assist_steps=1), state=WorkerState.RECOVERING
        )
        calls[policy] = log.take()
    assert calls["FC"] == [] and calls["FC"] != calls["LUMEN"]


def test_a_live_gateways_event_log_replays_to_the_same_decisions(tmp_path):
    """The log a live gateway writes (gRPC, real clients, a failure and an assist pairing)
    replays through fresh policy objects (``lumen_core.eventlog.replay_event_log``)."""
    from lumen_core.gateway.client import GatewayClient
    from lumen_core.gateway.directives import Hold
    from lumen_core.gateway.server import GatewayServer

    path = tmp_path / "gateway.jsonl"
    log = EventLog.open(path)
    config = GatewayConfig(policy="LUMEN")
    with GatewayServer(config, SECRET, event_log=log) as server:
        workers = [GatewayClient(server.address, SECRET) for _ in range(3)]
        client = GatewayClient(server.address, SECRET)
        try:
            for worker_id, worker in enumerate(workers):
                worker.register(worker_id, budget_bytes=1 << 36)
            streams = [client.submit([1] * 50, 20, timeout_s=30.0) for _ in range(4)]
            request_ids = [next(s).request_id for s in streams]
            for worker in workers:
                directives = worker.heartbeat(WorkerReport(num_running=1)).directives
                held = tuple(HeldReport(d.request_id, 1, 50) for d in directives if isinstance(d, Hold))
                worker.heartbeat(WorkerReport(num_running=2, held=held))
            assert workers[0].report_exit(0, 1, "SIGKILL")
            workers[0].register(0, state=WorkerState.RECOVERING)
            workers[0].heartbeat(
                WorkerReport(assist_steps=3, proposed_draft_tokens=6, accepted_draft_tokens=4)
            )
            workers[0].model_loaded(budget_bytes=1 << 36)
            for stream in streams:
                stream.close()
        finally:
            for worker in [*workers, client]:
                worker.close()
    log.close()
    records = list(read_event_log(path))
    assert {"place", "route", "replace", "pair", "finish"} <= {r["op"] for r in records}
    assert len(request_ids) == 4
    checked = replay_event_log(path, lambda gain_fn: make_policy("LUMEN", gain_fn=gain_fn), LoadConfig())
    assert checked == sum(1 for r in records if r["op"] not in ("event", "gain"))
