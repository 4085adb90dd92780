"""A planned drain through the Coordinator (no gRPC) and over the gateway's admin call."""

import math

import pytest

from lumen_core.gateway.config import GatewayConfig
from lumen_core.gateway.coordinator import Coordinator, NoWorkerError
from lumen_core.gateway.directives import Flush, Hold, Release, Resume, Stop, Stream
from lumen_core.gateway.reports import WorkerReport
from lumen_core.policy.events import RecoveryAction, WorkerState

pytestmark = pytest.mark.timeout(60)

SECRET = b"drain-tests-secret-0123456789abcdef"
GIB = 1 << 30


def cluster(num_workers=3, policy="FC"):
    coordinator = Coordinator(GatewayConfig(policy=policy), SECRET)
    for worker_id in range(num_workers):
        coordinator.register(0.0, worker_id, budget_bytes=64 * GIB, holder_address=f"h{worker_id}")
    return coordinator


def take_all(coordinator):
    return {w: coordinator.take_directives(w) for w in coordinator.worker_ids()}


def test_a_drain_flushes_then_moves_every_request_and_stops_the_worker():
    coordinator = cluster(3)
    on_zero = [coordinator.admit(0.0, [2] * 12, 8, worker_id=0).request_id for _ in range(3)]
    held_here = coordinator.admit(0.0, [2] * 12, 8, worker_id=2).request_id  # FC: held by 0
    assert coordinator.monitor.request(held_here).holder_ids == (0,)
    for rid in on_zero:
        coordinator.report_tokens(0.1, 0, 1, rid, 1, 0, [7, 8])
        (holder,) = coordinator.monitor.request(rid).holder_ids
        coordinator.report_checkpoint(0.2, holder, rid, 1, 13)
    take_all(coordinator)
    status = coordinator.drain(1.0, 0, 5.0)
    assert (status.state, status.num_requests, status.deadline_s) == ("flushing", 3, 6.0)
    assert coordinator.worker_state(0) == WorkerState.DRAINING
    assert coordinator.choose_worker() != 0  # admitted nothing more
    directives = take_all(coordinator)
    assert type(directives[0][-1]) is Flush and Release in [type(d) for d in directives[0]]
    # the copy it held is placed again and streamed there in full
    assert coordinator.monitor.request(held_here).holder_ids == (1,)
    assert Stream in [type(d) for d in directives[2]] and Hold in [type(d) for d in directives[1]]
    # its requests run on there until it says it flushed
    assert coordinator.heartbeat(1.5, 0, 1, WorkerReport(num_running=3))[0].fenced is False
    assert coordinator.drain_status(0).state == "flushing"
    coordinator.heartbeat(2.0, 0, 1, WorkerReport(flushed=True))
    status = coordinator.drain_status(0)
    assert (status.state, status.num_moved, status.num_reprefilled, status.finished_s) == (
        "stopped",
        3,
        0,
        2.0,
    )
    directives = take_all(coordinator)
    assert [type(d) for d in directives[0]] == [Stop]  # not cancelled: that would release the copies
    resumes = [d for w in (1, 2) for d in directives[w] if isinstance(d, Resume)]
    assert sorted(r.request_id for r in resumes) == on_zero
    assert all(r.action is RecoveryAction.RESTORE and r.output_token_ids == (7, 8) for r in resumes)
    assert coordinator.drain(2.5, 0, 5.0).state == "stopped"  # asked again: its progress
    # its exit retires it: no failure is counted, and a restart registers as new
    assert coordinator.process_exited(3.0, 0, 1, "drained") is None
    assert coordinator.worker_state(0) == WorkerState.FAILED and coordinator.failures == ()
    assert coordinator.drain(3.5, 0, 5.0).state == "stopped"  # polled after its exit: still its progress
    assert coordinator.register(4.0, 0, budget_bytes=GIB, holder_address="h0").epoch == 2
    assert coordinator.failures == () and coordinator.worker_state(0) == WorkerState.SERVING


def test_past_the_deadline_requests_are_reprefilled_and_counted():
    coordinator = cluster(3)
    rids = [coordinator.admit(0.0, [2] * 12, 8, worker_id=1).request_id for _ in range(2)]
    coordinator.drain(1.0, 1, 2.0)
    assert coordinator.expire_drains(2.9) == 0
    take_all(coordinator)
    assert coordinator.expire_drains(3.1) == 1
    status = coordinator.drain_status(1)
    assert (status.state, status.num_moved, status.num_reprefilled) == ("stopped", 2, 2)
    resumes = [d for w in (0, 2) for d in coordinator.take_directives(w) if isinstance(d, Resume)]
    assert sorted(r.request_id for r in resumes) == rids
    assert all(r.action is RecoveryAction.REPREFILL for r in resumes)


def test_a_worker_dying_mid_drain_falls_into_the_failure_path():
    coordinator = cluster(3)
    rid = coordinator.admit(0.0, [2] * 12, 8, worker_id=1).request_id
    coordinator.drain(1.0, 1, 30.0)
    plan = coordinator.process_exited(1.5, 1, 1, "SIGKILL")
    assert plan is not None and [r.request_id for r in plan.routes] == [rid]
    status = coordinator.drain_status(1)
    assert (status.state, status.num_moved, status.finished_s) == ("failed", 0, 1.5)
    assert coordinator.expire_drains(99.0) == 0
    assert coordinator.drain(2.0, 1, 30.0).state == "failed"


def test_drain_validation():
    coordinator = cluster(2)
    with pytest.raises(IndexError, match="worker_id 7 is not a registered worker"):
        coordinator.drain(0.0, 7, 1.0)
    with pytest.raises(ValueError, match="`deadline_s` must be > 0, got 0"):
        coordinator.drain(0.0, 0, 0)
    coordinator.admit(0.0, [1], 4, worker_id=0)
    coordinator.fail(0.1, [1], cause="test")
    with pytest.raises(ValueError, match=r"worker_id must be a serving worker, got 1 \(failed\)"):
        coordinator.drain(0.2, 1, 1.0)
    with pytest.raises(NoWorkerError, match="no other worker is serving: the 1 requests of 0 stay"):
        coordinator.drain(0.2, 0, 1.0)
    assert math.isnan(coordinator.metrics().recovery_s) or coordinator.metrics().num_failures == 1


def test_the_drain_call_needs_the_cluster_secret(start_gateway, connect):
    from lumen_core.gateway.errors import GatewayError

    server = start_gateway()
    worker = connect(server)
    worker.register(0, budget_bytes=GIB, holder_address="127.0.0.1:1")
    other = connect(server)
    other.register(1, budget_bytes=GIB, holder_address="127.0.0.1:2")
    admin = connect(server)
    reply = admin.drain(0, deadline_s=5.0)
    assert (reply.worker_id, reply.state, reply.num_requests) == (0, "flushing", 0)
    with pytest.raises(GatewayError, match="INVALID_ARGUMENT: `deadline_s` must be > 0"):
        admin.drain(1, deadline_s=0.0)
    outsider = connect(server, secret=b"not-the-cluster-secret-0123456789")
    with pytest.raises(GatewayError, match="UNAUTHENTICATED"):
        outsider.drain(1, deadline_s=5.0)
    assert server.coordinator.worker_state(1) == WorkerState.SERVING


def test_lumen_drain_waits_for_the_drain_and_prints_it(start_gateway, connect, tmp_path, capsys):
    """The CLI verb end to end: the worker never flushes (no process behind it), so the reaper
    ends the drain at its deadline and the verb prints it stopped."""
    import json
    import os

    from lumen_core.cli import main

    secret_path = tmp_path / "cluster.secret"
    fd = os.open(secret_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as handle:
        handle.write(b"gateway-tests-secret-0123456789abcdef")  # conftest's, the start_gateway secret
    server = start_gateway(reap_interval_s=0.05)
    for worker_id in (0, 1):
        connect(server).register(worker_id, budget_bytes=GIB, holder_address=f"127.0.0.1:{worker_id + 1}")
    argv = ["drain", "1", "--gateway", server.address, "--secret-file", str(secret_path), "--deadline", "0.3"]
    assert main(argv) == 0
    printed = json.loads(capsys.readouterr().out)
    assert (printed["worker_id"], printed["state"], printed["num_moved"]) == (1, "stopped", 0)
    assert printed["finished_s"] >= printed["started_s"] + 0.3
    with pytest.raises(SystemExit):
        main([*argv[:-1], "0"])  # --deadline 0
    assert "--deadline must be > 0, got 0.0" in capsys.readouterr().err
