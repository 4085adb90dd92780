"""A simulator event log replayed through the gateway's Coordinator gives the same decisions.

The simulator (``sim.cluster``) writes every policy event, call and gain query to a JSON-lines
log (``sim.eventlog``). Here each logged event is turned into the gateway call that produces
it live (registration, heartbeat report, admission, checkpoint report, finish, failure
detection, switch-over); the policy calls are NOT replayed one by one: the Coordinator makes
them itself, in its own order, and writes its own log. The two logs must be equal record for
record: same events, same calls with the same arguments, same decisions.

Scenario: one worker fails (S&R, FC, LUMEN with assist and switch-over). Two simulator
liberties have no gateway counterpart and are kept out of it: the simulator knows the truth,
so it unpairs a failed survivor (``release_survivor``) at the failure instant where the gateway
does so at detection, and after correlated failures detected at different times it skips
placing a request routed to a worker that is already dead but not yet detected, which the
gateway (knowing no better) places.
"""

from collections import deque

import pytest

from lumen_core.gateway.coordinator import RECOVERING, SERVING, Coordinator, GatewayConfig
from lumen_core.policy.events import (
    CheckpointGrew,
    Heartbeat,
    RequestAdmitted,
    RequestFinished,
    WorkerFailed,
    WorkerJoined,
    WorkerRecovering,
)
from lumen_core.policy.presets import POLICY_NAMES, make_policy
from lumen_core.sim.cluster import ClusterConfig, ClusterSim, Failure, preset
from lumen_core.sim.eventlog import EventLog, read_event_log
from lumen_core.sim.experiments import load_config_for
from lumen_core.sim.workload import poisson_workload

pytestmark = pytest.mark.timeout(60)

SECRET = b"replay-test-secret-0123456789"
CONFIG = ClusterConfig(num_workers=4, model="Qwen3-14B", tp=1, reload_s=4.0)


def simulate(tmp_path, policy: str):
    workload = poisson_workload(20.0, 300, (200, 3000), (10, 300), 0)
    path = tmp_path / f"sim-{policy}.jsonl"
    log = EventLog.open(path)
    ClusterSim(CONFIG, workload, preset(policy), failures=(Failure(6.0, (0,)),), event_log=log).run()
    log.close()
    return path, load_config_for(CONFIG, workload)


def replay_through_coordinator(sim_path, policy, load_config, out_path) -> Coordinator:
    """Drive a Coordinator with the gateway calls that the logged events stand for."""
    records = list(read_event_log(sim_path))
    gains = deque(r for r in records if r["op"] == "gain")

    def logged_gain(monitor, survivor_id, num_draft_tokens):
        record = gains.popleft()
        assert (record["survivor_id"], record["num_draft_tokens"]) == (survivor_id, num_draft_tokens)
        return record["value"]

    out = EventLog.open(out_path)
    coordinator = Coordinator(
        GatewayConfig(policy=policy, load_config=load_config), SECRET, gain_fn=logged_gain, event_log=out
    )
    now_s = 0.0
    i = 0
    while i < len(records):
        record = records[i]
        op = record["op"]
        i += 1
        if op == "event":
            event = record["event"]
            now_s = event.time_s
            if isinstance(event, WorkerJoined):
                coordinator.register(
                    now_s,
                    event.worker_id,
                    state=SERVING,
                    budget_bytes=event.budget_bytes,
                    domain=event.domain,
                )
            elif isinstance(event, WorkerRecovering):
                coordinator.register(now_s, event.worker_id, state=RECOVERING)
            elif isinstance(event, WorkerFailed):
                failed = [event.worker_id]
                while records[i]["op"] == "event" and isinstance(records[i]["event"], WorkerFailed):
                    failed.append(records[i]["event"].worker_id)
                    i += 1
                coordinator.fail(now_s, failed, cause="lease expired")
            elif isinstance(event, Heartbeat):
                coordinator.report_load(now_s, event.worker_id, event.num_running, event.num_waiting)
            elif isinstance(event, RequestAdmitted):
                coordinator.admit(
                    now_s,
                    (0,) * event.prompt_tokens,
                    event.expected_output_tokens,
                    expected_output_tokens=event.expected_output_tokens,
                    worker_id=event.worker_id,
                    request_id=event.request_id,
                )
            elif isinstance(event, CheckpointGrew):
                _, epoch = coordinator.request_worker(event.request_id)
                coordinator.report_checkpoint(
                    now_s, event.holder_id, event.request_id, epoch, event.durable_tokens
                )
            elif isinstance(event, RequestFinished):
                coordinator.finish_request(now_s, event.request_id)
            else:
                raise AssertionError(f"no gateway call stands for {event}")
        elif op == "pair":  # a recovering worker's heartbeat while it is unpaired
            coordinator.assist_report(now_s, record["args"]["assistant_id"], steps=0, proposed=0, accepted=0)
        elif op == "finish":  # switch-over: the logged WorkerJoined that follows is its effect
            joined = records[i]["event"]
            assert isinstance(joined, WorkerJoined) and joined.worker_id == record["args"]["assistant_id"]
            i += 1
            worker_id = joined.worker_id
            epoch = coordinator.worker_epoch(worker_id)
            coordinator.model_loaded(joined.time_s, worker_id, epoch, joined.budget_bytes, joined.domain)
        elif op not in ("gain", "place", "route", "replace"):  # those the Coordinator makes itself
            raise AssertionError(f"no gateway call stands for {record}")
    out.close()
    assert not gains, f"{len(gains)} logged gain queries were never asked"
    return coordinator


def first_difference(a_path, b_path) -> tuple[int, object, object] | None:
    a = list(read_event_log(a_path))
    b = list(read_event_log(b_path))
    for k, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return k, x, y
    if len(a) != len(b):
        return min(len(a), len(b)), None, None
    return None


@pytest.mark.parametrize("policy", POLICY_NAMES)
def test_simulator_log_replayed_through_the_coordinator_gives_the_same_decisions(tmp_path, policy):
    sim_path, load_config = simulate(tmp_path, policy)
    gateway_path = tmp_path / f"gateway-{policy}.jsonl"
    coordinator = replay_through_coordinator(sim_path, policy, load_config, gateway_path)
    sim_records = list(read_event_log(sim_path))
    ops = {r["op"] for r in sim_records}
    assert {"event", "place", "route", "replace"} <= ops
    if policy == "LUMEN":
        assert {"pair", "finish", "gain"} <= ops
    routes = [d for r in sim_records if r["op"] == "route" for d in r["result"]]
    assert len(routes) >= 3, "the failure must interrupt requests, or the test proves little"
    assert first_difference(sim_path, gateway_path) is None
    assert len(coordinator.failures) == 1 and coordinator.failures[0].routes == tuple(routes)


def test_a_different_policy_disagrees_so_the_replay_can_fail(tmp_path):
    sim_path, load_config = simulate(tmp_path, "S&R")
    gateway_path = tmp_path / "gateway-FC.jsonl"
    replay_through_coordinator(sim_path, "FC", load_config, gateway_path)
    difference = first_difference(sim_path, gateway_path)
    assert difference is not None and difference[1]["op"] == "place"


def test_a_live_gateways_event_log_replays_through_the_simulators_replayer(tmp_path):
    """The other direction: the log a live gateway writes (gRPC, real clients, a failure and an
    assist pairing) replays through ``sim.eventlog.replay_event_log`` to the same decisions."""
    from lumen_core.gateway.client import GatewayClient
    from lumen_core.gateway.directives import Hold
    from lumen_core.gateway.reports import HeldReport, WorkerReport
    from lumen_core.gateway.server import GatewayServer
    from lumen_core.policy.load import LoadConfig
    from lumen_core.sim.eventlog import replay_event_log

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
            assert client.report_exit(0, 1, "SIGKILL")
            workers[0].register(0, state=RECOVERING)
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
