"""Hypothesis: random sequences of gateway calls keep the Coordinator's invariants."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lumen_core.gateway.config import GatewayConfig
from lumen_core.gateway.coordinator import Coordinator, NoWorkerError
from lumen_core.gateway.reports import HeldReport, WorkerReport
from lumen_core.policy.events import WorkerState
from lumen_core.policy.presets import POLICY_NAMES

pytestmark = pytest.mark.timeout(120)

SECRET = b"property-tests-secret-0123456789"
NUM_WORKERS = 5
OPS = st.lists(
    st.tuples(
        st.sampled_from(
            ["admit", "tokens", "held", "fail", "exit", "restart", "loaded", "heartbeat", "expire"]
        ),
        st.integers(0, NUM_WORKERS - 1),
        st.integers(1, 6),
    ),
    min_size=1,
    max_size=60,
)


def check_invariants(coordinator: Coordinator, epochs: dict[int, int]) -> None:
    monitor = coordinator.monitor
    for worker_id in coordinator.worker_ids():
        state = coordinator.worker_state(worker_id)
        assert state in (WorkerState.SERVING, WorkerState.RECOVERING, WorkerState.FAILED)
        assert monitor.state(worker_id) == state
        assert coordinator.worker_epoch(worker_id) >= epochs.get(worker_id, 0)
        epochs[worker_id] = coordinator.worker_epoch(worker_id)
        if state == WorkerState.FAILED:
            assert coordinator.take_directives(worker_id) == []
    for request_id in monitor.request_ids():
        view = monitor.request(request_id)
        worker_id, _ = coordinator.request_worker(request_id)
        assert view.worker_id == worker_id
        assert coordinator.worker_state(worker_id) == WorkerState.SERVING  # routed away from every failure
        assert worker_id not in view.holder_ids
        assert all(coordinator.worker_state(h) == WorkerState.SERVING for h in view.holder_ids)


@settings(max_examples=40, deadline=None)
@given(policy=st.sampled_from(POLICY_NAMES), ops=OPS)
def test_random_call_sequences_keep_requests_on_serving_workers_and_epochs_monotone(policy, ops):
    config = GatewayConfig(policy=policy, lease_s=5.0, heartbeat_s=1.0)
    coordinator = Coordinator(config, SECRET)
    for worker_id in range(NUM_WORKERS):
        coordinator.register(0.0, worker_id, budget_bytes=1 << 40)
    epochs: dict[int, int] = {}
    max_new: dict[int, int] = {}
    now_s = 0.0
    for op, worker_id, size in ops:
        now_s += 0.5
        state = coordinator.worker_state(worker_id)
        epoch = coordinator.worker_epoch(worker_id)
        live_requests = coordinator.monitor.request_ids()
        if op == "admit":
            try:
                max_new[coordinator.admit(now_s, [1] * (10 * size), size).request_id] = size
            except NoWorkerError:
                assert not coordinator.monitor.live_worker_ids()
        elif op == "tokens" and live_requests:
            request_id = live_requests[size % len(live_requests)]
            target, request_epoch = coordinator.request_worker(request_id)
            known = len(coordinator.tokens(request_id)[0])
            new = [7] * min(2, max_new[request_id] - known)
            done = known + len(new) == max_new[request_id]
            worker_epoch = coordinator.worker_epoch(target)
            ack = coordinator.report_tokens(
                now_s, target, worker_epoch, request_id, request_epoch, known, new, finished=done
            )
            assert ack.num_new == len(new) and ack.next_position == known + len(new)
            assert coordinator.monitor.has_request(request_id) != done
        elif op == "held" and live_requests and state == WorkerState.SERVING:
            request_id = live_requests[size % len(live_requests)]
            _, request_epoch = coordinator.request_worker(request_id)
            coordinator.heartbeat(
                now_s, worker_id, epoch, WorkerReport(held=(HeldReport(request_id, request_epoch, size),))
            )
        elif op == "fail" and state != WorkerState.FAILED:
            coordinator.fail(now_s, [worker_id], cause="test")
        elif op == "exit" and state != WorkerState.FAILED:
            assert coordinator.process_exited(now_s, worker_id, epoch, "SIGKILL") is not None
        elif op == "restart" and state == WorkerState.FAILED:
            restarted = WorkerState.RECOVERING if size % 2 else WorkerState.SERVING
            coordinator.register(now_s, worker_id, state=restarted, budget_bytes=1 << 40)
        elif op == "loaded" and state == WorkerState.RECOVERING:
            coordinator.model_loaded(now_s, worker_id, epoch, 1 << 40)
        elif op == "heartbeat" and state != WorkerState.FAILED:
            coordinator.heartbeat(now_s, worker_id, epoch, WorkerReport(num_running=size), state=state)
        elif op == "expire":
            coordinator.expire_leases(now_s)
        check_invariants(coordinator, epochs)
