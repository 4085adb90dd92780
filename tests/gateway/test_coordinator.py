"""The Coordinator alone (no gRPC): decisions, epochs, leases, directives, validation."""

import math

import pytest

from lumen_core.auth import Rights
from lumen_core.gateway import coordinator as coordinator_module
from lumen_core.gateway.config import GatewayConfig
from lumen_core.gateway.coordinator import Coordinator, NoWorkerError
from lumen_core.gateway.directives import Cancel, Hold, Release, Resume, Run, Sampling, Stream
from lumen_core.gateway.errors import GatewayError, StaleEpochError
from lumen_core.gateway.reports import HeldReport, LostReplica, RunningReport, WorkerReport
from lumen_core.policy.events import RecoveryAction
from lumen_core.policy.load import LoadConfig
from lumen_core.policy.placement import PlacementConfig

pytestmark = pytest.mark.timeout(60)

SECRET = b"coordinator-tests-secret-0123456789"
GIB = 1 << 30


def cluster(num_workers=3, policy="LUMEN", **config):
    coordinator = Coordinator(GatewayConfig(policy=policy, **config), SECRET)
    for worker_id in range(num_workers):
        coordinator.register(0.0, worker_id, budget_bytes=64 * GIB, holder_address=f"h{worker_id}")
    return coordinator


def kinds(directives):
    return [type(d) for d in directives]


def test_config_validation():
    with pytest.raises(ValueError, match="policy must be one of S&R, FC, LUMEN, got 'X'"):
        GatewayConfig(policy="X")
    with pytest.raises(ValueError, match="`lease_s` must be > 0, got 0"):
        GatewayConfig(lease_s=0)
    with pytest.raises(ValueError, match="park_leases.*-1"):
        GatewayConfig(park_leases=-1.0)
    with pytest.raises(ValueError, match="max_parked.*-2"):
        GatewayConfig(max_parked=-2)
    with pytest.raises(ValueError, match=r"heartbeat_s must be < lease_s \(10.0\), got 10.0"):
        GatewayConfig(heartbeat_s=10.0)
    with pytest.raises(TypeError, match="load_config must be a LoadConfig, got dict"):
        GatewayConfig(load_config={})
    with pytest.raises(TypeError, match="config must be a GatewayConfig, got str"):
        Coordinator("LUMEN", SECRET)
    with pytest.raises(ValueError, match="`secret` must be given"):
        Coordinator(GatewayConfig(), None)
    assert GatewayConfig().lease_s == 10.0  # not misfiring on a busy 2-core machine


def test_register_validation():
    coordinator = cluster(0)
    with pytest.raises(ValueError, match="state must be 'serving' or 'recovering', got 'busy'"):
        coordinator.register(0.0, 0, state="busy")
    with pytest.raises(ValueError, match="num_shards must be >= 1, got 0"):
        coordinator.register(0.0, 0, num_shards=0)
    with pytest.raises(TypeError, match="`worker_id` must be an int, got str"):
        coordinator.register(0.0, "0")
    with pytest.raises(ValueError, match="`worker_id` must be >= 0, got -1"):
        coordinator.register(0.0, -1)
    with pytest.raises(ValueError, match="`budget_bytes` must be >= 0, got -1"):
        coordinator.register(0.0, 0, budget_bytes=-1)
    with pytest.raises(TypeError, match="domain and holder_address must be str, got int, str"):
        coordinator.register(0.0, 0, domain=3)
    assert coordinator.worker_ids() == []  # nothing was registered by the refused calls
    report = RunningReport(1, 1, (1,), (), 4, 4)
    with pytest.raises(ValueError, match="running must be empty for a recovering worker, got 1 requests"):
        coordinator.register(0.0, 0, state="recovering", running=[report])


def test_admit_validation_and_join_shortest_queue():
    with pytest.raises(NoWorkerError, match="no worker is serving"):
        cluster(0).admit(0.0, [1], 1)
    coordinator = cluster(3)
    with pytest.raises(ValueError, match="prompt_token_ids must not be empty, got 0 tokens"):
        coordinator.admit(0.0, [], 1)
    with pytest.raises(ValueError, match="prompt_token_ids must hold token ids >= 0, got -3"):
        coordinator.admit(0.0, [1, -3], 1)
    with pytest.raises(ValueError, match="max_new_tokens must be >= 1, got 0"):
        coordinator.admit(0.0, [1], 0)
    placed = [coordinator.admit(0.0, [1, 2], 4).worker_id for _ in range(4)]
    assert placed == [0, 1, 2, 0]
    with pytest.raises(ValueError, match="request_id must be new, got 1"):
        coordinator.admit(0.0, [1], 1, request_id=1)


def test_token_reports_are_deduplicated_bounded_and_fenced():
    coordinator = cluster(2, policy="S&R")
    admission = coordinator.admit(0.0, [1, 2], 3)
    rid, w = admission.request_id, admission.worker_id
    with pytest.raises(IndexError, match="request_id 99 is not a known request"):
        coordinator.report_tokens(0.1, w, 1, 99, 1, 0, [5])
    with pytest.raises(StaleEpochError, match="worker 0 epoch 7 is fenced") as stale:
        coordinator.report_tokens(0.1, w, 7, rid, 1, 0, [5])
    # the class GatewayClient raises too: a worker handles a fenced epoch one way in or out of process
    assert isinstance(stale.value, GatewayError) and stale.value.code.name == "FAILED_PRECONDITION"
    assert str(stale.value) == "FAILED_PRECONDITION: worker 0 epoch 7 is fenced"
    with pytest.raises(StaleEpochError, match=f"request {rid} epoch 2 on worker 0 is stale"):
        coordinator.report_tokens(0.1, w, 1, rid, 2, 0, [5])
    with pytest.raises(ValueError, match="token_ids must end by max_new_tokens=3, got 4 tokens"):
        coordinator.report_tokens(0.1, w, 1, rid, 1, 0, [5, 6, 7, 8])
    assert coordinator.report_tokens(0.1, w, 1, rid, 1, 0, [5, 6]).num_new == 2
    ack = coordinator.report_tokens(0.2, w, 1, rid, 1, 0, [5, 6, 7], finished=True)
    assert (ack.num_new, ack.num_conflicts, ack.next_position) == (1, 0, 3)
    assert coordinator.tokens(rid, 1) == ((6, 7), True, False)
    assert not coordinator.monitor.has_request(rid)  # finished: the monitor forgot it
    with pytest.raises(IndexError, match="request_id 99 is not a known request"):
        coordinator.tokens(99)
    with pytest.raises(IndexError, match="request_id 99 is not a known request"):
        coordinator.finish_request(0.3, 99)


def test_a_worker_registering_again_fails_its_old_incarnation():
    coordinator = cluster(2, policy="FC")
    rid = coordinator.admit(0.0, [1, 2, 3], 4).request_id
    coordinator.take_directives(0)
    registration = coordinator.register(1.0, 0, budget_bytes=GIB)
    assert registration.epoch == 2
    (failure,) = coordinator.failures
    assert "worker 0 registered again (epoch 1 is gone)" in failure.cause
    assert failure.routes[0].request_id == rid and failure.routes[0].target_worker_id == 1
    assert coordinator.renew_lease(1.0, 0, 1).fenced
    assert coordinator.take_directives(0) == []  # the new incarnation gets nothing of the old


def test_lease_expiry_and_exit_reports():
    coordinator = cluster(3, lease_s=2.0, heartbeat_s=0.5)
    assert coordinator.expire_leases(1.9) is None
    coordinator.renew_lease(1.5, 1, 1)
    coordinator.renew_lease(1.5, 2, 1)
    outcome = coordinator.expire_leases(2.1)
    assert outcome.worker_ids == (0,) and outcome.cause == "lease expired"
    lease = coordinator.renew_lease(2.2, 0, 1)
    assert lease.fenced and "epoch 1 fenced at 2.100: lease expired" in lease.reason
    assert coordinator.process_exited(2.3, 0, 1) is None  # already failed
    assert coordinator.process_exited(2.3, 1, 5) is None  # not that incarnation
    assert coordinator.process_exited(2.3, 7, 1) is None  # unknown worker
    assert coordinator.process_exited(2.3, 1, 1, "SIGKILL").cause == "process exited: SIGKILL"
    assert coordinator.renew_lease(2.4, 9, 1).reregister
    with pytest.raises(ValueError, match="worker_ids must be live registered workers, got 1"):
        coordinator.fail(2.5, [1], cause="again")


def test_surviving_holders_get_the_new_epoch_and_a_dead_holder_is_replaced(granted):
    coordinator = cluster(4, policy="FC")
    rid = coordinator.admit(0.0, [1] * 10, 4).request_id  # on 0, held by 1
    other = coordinator.admit(0.0, [1] * 10, 4).request_id  # on 1, held by 2
    for w in range(4):
        coordinator.take_directives(w)
    coordinator.report_checkpoint(0.5, 1, rid, 1, 10)
    coordinator.report_checkpoint(0.5, 2, other, 1, 10)
    coordinator.report_checkpoint(0.5, 2, other, 0, 99)  # older epoch: ignored
    assert coordinator.monitor.request(other).durable_tokens == ((2, 10),)
    outcome = coordinator.fail(1.0, [2], cause="test")  # the holder of `other` dies
    assert outcome.routes == ()
    (replaced,) = outcome.replacements
    assert replaced.request_id == other and replaced.new_holder_ids == (3,)
    assert kinds(coordinator.take_directives(1)) == [Stream]
    (hold,) = coordinator.take_directives(3)
    assert isinstance(hold, Hold) and hold.serving_worker_id == 1 and hold.epoch == 1
    outcome = coordinator.fail(2.0, [0], cause="test")  # `rid` restores on holder 1 at epoch 2
    (route,) = outcome.routes
    assert route.action is RecoveryAction.RESTORE and route.target_worker_id == 1
    directives = coordinator.take_directives(1)
    resume = next(d for d in directives if isinstance(d, Resume))
    assert resume.epoch == 2
    # the source holder may only read, at the new epoch (the read fences the dead writer)
    assert granted(coordinator.issuer_public_key, resume.source.capabilities) == [(rid, 0, 2, 1, Rights.READ)]


def test_with_two_replicas_the_stream_directive_keeps_the_surviving_holder():
    coordinator = cluster(4, policy="LUMEN", placement_config=PlacementConfig(replicas=2))
    admission = coordinator.admit(0.0, [1] * 10, 4)
    first, second = admission.placement.holder_ids
    for w in range(4):
        coordinator.take_directives(w)
    outcome = coordinator.fail(1.0, [first], cause="test")  # one replica's holder dies
    (replaced,) = outcome.replacements
    (new_holder,) = replaced.new_holder_ids
    (stream,) = coordinator.take_directives(admission.worker_id)
    assert isinstance(stream, Stream)
    assert sorted(g.worker_id for g in stream.holders) == sorted([second, new_holder])


def test_refused_checkpoint_is_placed_elsewhere_and_evictions_are_recorded():
    coordinator = cluster(3, policy="LUMEN")
    admission = coordinator.admit(0.0, [1] * 10, 4)
    (holder,) = admission.placement.holder_ids
    for w in range(3):
        coordinator.take_directives(w)
    lease, directives, _ = coordinator.heartbeat(
        0.5, holder, 1, WorkerReport(refused_request_ids=(admission.request_id,))
    )
    assert not lease.fenced
    view = coordinator.monitor.request(admission.request_id)
    assert holder not in view.holder_ids and len(view.holder_ids) == 1
    new_holder = view.holder_ids[0]
    assert kinds(coordinator.take_directives(new_holder)) == [Hold]
    assert kinds(coordinator.take_directives(admission.worker_id)) == [Stream]
    coordinator.heartbeat(0.6, new_holder, 1, WorkerReport(evicted_request_ids=(admission.request_id, 999)))
    assert coordinator.monitor.request(admission.request_id).holder_ids == ()


def test_a_replica_its_streamer_lost_is_released_on_its_holder_and_placed_elsewhere():
    coordinator = cluster(3, policy="LUMEN")
    admission = coordinator.admit(0.0, [1] * 10, 4)
    (holder,) = admission.placement.holder_ids
    for w in range(3):
        coordinator.take_directives(w)
    rid, serving = admission.request_id, admission.worker_id
    other = ({0, 1, 2} - {holder, serving}).pop()
    ignored = [
        (other, LostReplica(rid, holder)),  # not the serving worker (a stale incarnation's report)
        (serving, LostReplica(rid, 7)),  # no such holder
        (serving, LostReplica(999, holder)),  # no such request
    ]
    for reporter, lost in ignored:
        coordinator.heartbeat(0.4, reporter, 1, WorkerReport(lost_replicas=(lost,)))
    assert coordinator.monitor.request(rid).holder_ids == (holder,)
    assert [coordinator.take_directives(w) for w in range(3)] == [[], [], []]
    coordinator.heartbeat(0.5, serving, 1, WorkerReport(lost_replicas=(LostReplica(rid, holder),)))
    assert coordinator.monitor.request(rid).holder_ids == (other,)
    assert coordinator.monitor.refused_by(rid) == {holder}
    (release,) = coordinator.take_directives(holder)
    assert (type(release), release.request_id, release.epoch) == (Release, rid, 1)
    assert kinds(coordinator.take_directives(other)) == [Hold]
    (stream,) = coordinator.take_directives(serving)
    assert (type(stream), [h.worker_id for h in stream.holders]) == (Stream, [other])
    coordinator.heartbeat(0.6, serving, 1, WorkerReport(lost_replicas=(LostReplica(rid, holder),)))
    assert [coordinator.take_directives(w) for w in range(3)] == [[], [], []]  # reported again


def test_a_refused_checkpoint_with_no_other_holder_degrades_to_reprefill():
    coordinator = cluster(2, policy="LUMEN")
    admission = coordinator.admit(0.0, [1] * 10, 4)
    (holder,) = admission.placement.holder_ids
    (hold,) = coordinator.take_directives(holder)
    assert isinstance(hold, Hold) and hold.reserved_bytes == admission.placement.reserved_bytes > 0
    coordinator.take_directives(admission.worker_id)
    coordinator.heartbeat(0.5, holder, 1, WorkerReport(refused_request_ids=(admission.request_id,)))
    assert coordinator.monitor.request(admission.request_id).holder_ids == ()
    assert coordinator.monitor.refused_by(admission.request_id) == {holder}
    assert coordinator.take_directives(holder) == []
    (stream,) = coordinator.take_directives(admission.worker_id)  # stream it nowhere
    assert (type(stream), stream.request_id, stream.epoch, stream.holders) == (
        Stream,
        admission.request_id,
        1,
        (),
    )
    coordinator.heartbeat(
        0.6, holder, 1, WorkerReport(refused_request_ids=(admission.request_id,))
    )  # sent again
    assert coordinator.take_directives(admission.worker_id) == []
    outcome = coordinator.fail(1.0, [admission.worker_id], cause="test")
    assert [r.action for r in outcome.routes] == [RecoveryAction.REPREFILL]


def test_when_no_worker_is_left_and_parking_is_off_the_requests_are_lost_and_said_so():
    coordinator = cluster(1, policy="S&R", park_leases=0.0)
    rid = coordinator.admit(0.0, [1], 2).request_id
    outcome = coordinator.fail(1.0, [0], cause="test")
    assert outcome.lost_request_ids == (rid,) and outcome.routes == ()
    assert coordinator.tokens(rid) == ((), True, True)
    assert coordinator.lost_reason(rid) == "no worker was left serving (park_leases 0: parking is off)"


def test_with_no_worker_left_requests_park_and_resume_on_a_registering_worker():
    coordinator = cluster(2, policy="LUMEN", lease_s=3.0)
    a = coordinator.admit(0.0, [1, 2, 3], 6)
    coordinator.take_directives(a.worker_id)
    coordinator.report_tokens(0.1, a.worker_id, 1, a.request_id, 1, 0, [7, 8])
    outcome = coordinator.fail(1.0, [0, 1], cause="lease expired")
    assert outcome.parked_request_ids == (a.request_id,) and outcome.lost_request_ids == ()
    assert coordinator.tokens(a.request_id) == ((7, 8), False, False)  # the stream stays open
    metrics = coordinator.metrics()
    assert (metrics.num_parked, metrics.num_parked_total) == (1, 1)
    assert coordinator.unpark(5.0) == 0  # nobody registered yet, within 6 leases
    coordinator.register(6.0, 1, budget_bytes=64 * GIB, holder_address="h1", last_epoch=1)
    (resume,) = [d for d in coordinator.take_directives(1) if isinstance(d, Resume)]
    assert (resume.request_id, resume.epoch, resume.action) == (a.request_id, 2, RecoveryAction.REPREFILL)
    assert (resume.prompt_token_ids, resume.output_token_ids) == ((1, 2, 3), (7, 8))
    assert coordinator.request_worker(a.request_id) == (1, 2)
    assert coordinator.metrics().num_parked == 0
    coordinator.report_tokens(6.5, 1, 2, a.request_id, 2, 2, [9], finished=True)
    assert coordinator.tokens(a.request_id) == ((7, 8, 9), True, False)


def test_a_parked_request_restores_on_a_worker_back_with_its_holder():
    """Every worker fenced by one cut (issue 23): they linger with their holders and register
    again reporting what they hold, so a parked request restores on the first worker back with
    a copy; a copy reported after it moved is released; a request whose holder is not back yet
    waits up to a lease for it, then re-prefills."""
    coordinator = cluster(3, policy="LUMEN", lease_s=3.0)
    a = coordinator.admit(0.0, [1, 2, 3], 60)
    holder = a.placement.holder_ids[0]
    coordinator.report_tokens(0.1, a.worker_id, 1, a.request_id, 1, 0, [7, 8])
    coordinator.report_checkpoint(0.1, holder, a.request_id, 1, 4)
    b = coordinator.admit(0.0, [4, 5], 60, worker_id=holder)
    coordinator.report_checkpoint(0.1, b.placement.holder_ids[0], b.request_id, 1, 2)
    outcome = coordinator.fail(1.0, [0, 1, 2], cause="lease expired")
    assert set(outcome.parked_request_ids) == {a.request_id, b.request_id}
    held = (HeldReport(a.request_id, 1, 4),)
    coordinator.register(5.0, holder, budget_bytes=64 * GIB, held=held, last_epoch=1)
    (resume,) = [d for d in coordinator.take_directives(holder) if isinstance(d, Resume)]
    assert (resume.request_id, resume.action, resume.epoch) == (a.request_id, RecoveryAction.RESTORE, 2)
    assert resume.source is not None and resume.source.worker_id == holder
    assert resume.output_token_ids == (7, 8)
    other = next(w for w in range(3) if w not in (holder, b.placement.holder_ids[0]))
    coordinator.register(5.1, other, budget_bytes=64 * GIB, held=held, last_epoch=1)
    assert [d.request_id for d in coordinator.take_directives(other) if isinstance(d, Release)] == [
        a.request_id
    ]
    # b's holder is not back: b waits a lease from the first unpark (5.0) for it, then re-prefills.
    assert [p.request_id for p in coordinator.driver.parked] == [b.request_id]
    assert coordinator.unpark(7.9) == 0
    assert coordinator.unpark(8.1) == 1
    assert coordinator.request_worker(b.request_id)[1] == 2


def test_parked_requests_past_park_leases_or_max_parked_are_lost_with_the_bound_named():
    coordinator = cluster(2, policy="S&R", lease_s=3.0, max_parked=1)
    first = coordinator.admit(0.0, [1], 4).request_id
    second = coordinator.admit(0.0, [1], 4).request_id
    outcome = coordinator.fail(1.0, [0, 1], cause="lease expired")
    assert (outcome.parked_request_ids, outcome.lost_request_ids) == ((first,), (second,))
    assert coordinator.lost_reason(second) == "no worker was left serving and max_parked 1 reached"
    assert coordinator.unpark(19.0) == 1  # the reaper's call: 18 s parked, past 6 x 3 s
    assert coordinator.tokens(first) == ((), True, True)
    assert coordinator.lost_reason(first) == (
        "parked 18.0 s (park_leases 6.0 x lease 3.0 s): no worker registered"
    )
    coordinator.register(20.0, 0, budget_bytes=64 * GIB, last_epoch=1)
    assert not [d for d in coordinator.take_directives(0) if isinstance(d, Resume)]


def test_a_parked_request_its_client_cancels_is_dropped():
    coordinator = cluster(1, policy="S&R")
    rid = coordinator.admit(0.0, [1], 4).request_id
    coordinator.fail(1.0, [0], cause="test")
    assert coordinator.cancel(2.0, rid, "client gone")
    coordinator.register(3.0, 0, budget_bytes=64 * GIB, last_epoch=1)
    assert not [d for d in coordinator.take_directives(0) if isinstance(d, Resume)]
    assert coordinator.metrics().num_parked == 0


def test_restart_rebuild_attaches_holds_reported_before_their_request_and_releases_stale_ones():
    coordinator = Coordinator(GatewayConfig(policy="LUMEN"), SECRET)
    held = [HeldReport(7, 3, 12), HeldReport(8, 1, 5)]
    coordinator.register(0.0, 1, budget_bytes=GIB, held=held, last_epoch=4)
    assert coordinator.worker_epoch(1) == 5
    running = [RunningReport(7, 3, (1,) * 12, (4, 4), 8, 8), RunningReport(8, 2, (1,) * 5, (), 8, 8)]
    coordinator.register(0.0, 0, budget_bytes=GIB, running=running)
    assert coordinator.monitor.request(7).durable_tokens == ((1, 12),)
    assert coordinator.monitor.request(8).holder_ids == ()  # epoch 1 copy of an epoch 2 request
    (release,) = coordinator.take_directives(1)
    assert isinstance(release, Release) and release.request_id == 8
    assert coordinator.admit(0.1, [1], 1).request_id == 9  # ids continue past the reported ones


def test_a_recovering_worker_unknown_to_a_restarted_gateway_is_paired():
    coordinator = cluster(2, policy="LUMEN")
    registration = coordinator.register(0.0, 5, state="recovering", holder_address="h5")
    assert coordinator.worker_state(5) == "recovering"
    assert registration.assist is not None and registration.assist.survivor_id in (0, 1)


def test_assist_report_and_switch_over_validation():
    coordinator = cluster(2, policy="LUMEN")
    coordinator.fail(0.0, [0], cause="test")
    coordinator.register(1.0, 0, state="recovering")
    with pytest.raises(ValueError, match="accepted must be <= proposed, got 5 > 4"):
        coordinator.assist_report(1.1, 0, steps=1, proposed=4, accepted=5)
    with pytest.raises(StaleEpochError, match="worker 0 epoch 1 is not a live incarnation"):
        coordinator.model_loaded(2.0, 0, 1, GIB)
    with pytest.raises(ValueError, match="`budget_bytes` must be >= 0, got -5"):
        coordinator.model_loaded(2.0, 0, 2, -5)
    with pytest.raises(TypeError, match="domain must be a str, got int"):
        coordinator.model_loaded(2.0, 0, 2, GIB, 7)
    assert coordinator.worker_state(0) == "recovering"
    assert coordinator.model_loaded(2.0, 0, 2, GIB) == 1
    with pytest.raises(ValueError, match="worker_id must be a recovering worker, got 0 \\(serving\\)"):
        coordinator.model_loaded(2.0, 0, 2, GIB)
    assert coordinator.assist_report(2.1, 0, steps=0, proposed=0, accepted=0) == 0


def test_capabilities_per_shard_and_metrics(granted):
    coordinator = Coordinator(
        GatewayConfig(policy="LUMEN", load_config=LoadConfig(kv_bytes_per_token=1024)), SECRET
    )
    for w in range(3):
        coordinator.register(0.0, w, budget_bytes=GIB, num_shards=2)
    admission = coordinator.admit(0.0, [1] * 100, 10)
    run = coordinator.take_directives(admission.worker_id)[0]
    assert isinstance(run, Run)
    holder_id = run.holders[0].worker_id
    assert granted(coordinator.issuer_public_key, run.holders[0].capabilities) == [
        (admission.request_id, s, 1, holder_id, Rights.WRITE | Rights.READ) for s in (0, 1)
    ]
    metrics = coordinator.metrics()
    assert metrics.coverage == 0.0 and math.isnan(metrics.recovery_s) and metrics.num_failures == 0
    coordinator.report_checkpoint(0.1, admission.placement.holder_ids[0], admission.request_id, 1, 90)
    assert coordinator.metrics().coverage == 1.0  # 90 of 100 tokens: within the 16-token slack
    coordinator.fail(1.0, [admission.worker_id], cause="test")
    assert math.isnan(coordinator.metrics().recovery_s)  # the interrupted request has not resumed
    target, epoch = coordinator.request_worker(admission.request_id)
    coordinator.report_tokens(1.5, target, 1, admission.request_id, epoch, 0, [3])
    metrics = coordinator.metrics()
    assert metrics.recovery_s == pytest.approx(0.5) and metrics.replay_ttft_s == pytest.approx(0.5)
    assert metrics.worker_state[admission.worker_id] == "failed"


def test_a_reported_request_that_runs_elsewhere_is_cancelled_on_the_reporter():
    coordinator = Coordinator(GatewayConfig(policy="FC"), SECRET)
    coordinator.register(0.0, 0, budget_bytes=GIB, running=[RunningReport(4, 2, (1, 2), (3,), 8, 8)])
    coordinator.register(0.0, 1, budget_bytes=GIB, running=[RunningReport(4, 1, (1, 2), (), 8, 8)])
    assert coordinator.request_worker(4) == (0, 2)
    (cancel,) = coordinator.take_directives(1)
    assert isinstance(cancel, Cancel) and cancel.request_id == 4
    assert coordinator.take_directives(0) == []


def test_forgetting_looks_only_at_requests_that_ended_before_the_horizon():
    coordinator = cluster(2, policy="S&R", finished_retention_s=10.0)
    ids = []
    for i in range(2000):
        admitted = coordinator.admit(0.0, [1], 2, worker_id=0)
        coordinator.report_tokens(float(i % 4), 0, 1, admitted.request_id, 1, 0, [4, 5], finished=True)
        ids.append(admitted.request_id)
    running = coordinator.admit(0.0, [1], 2, worker_id=1).request_id
    assert (coordinator.num_requests, coordinator.num_finished) == (2001, 2000)
    assert coordinator.forget_finished(10.5) == 500  # those that ended at 0.0
    assert coordinator.forget_finished(10.5) == 0
    assert coordinator.forget_finished(20.0) == 1500 and coordinator.num_finished == 0
    assert not coordinator._ended  # noqa: SLF001 - the queue of ended requests is empty again
    assert coordinator.tokens(running) == ((), False, False)


def test_a_heartbeat_must_carry_the_registered_state():
    coordinator = cluster(2, policy="LUMEN")
    with pytest.raises(ValueError, match="state must be the registered state 'serving' .*, got 'recovering'"):
        coordinator.heartbeat(0.1, 0, 1, WorkerReport(), state="recovering")
    coordinator.fail(0.2, [0], cause="test")
    coordinator.register(0.3, 0, state="recovering")
    lease, _, k = coordinator.heartbeat(0.4, 0, 2, WorkerReport(assist_steps=0), state="recovering")
    assert not lease.fenced and k == 2


def test_finished_requests_are_forgotten_after_the_retention_except_the_last_failures():
    coordinator = cluster(2, policy="S&R", finished_retention_s=10.0)
    first = coordinator.admit(0.0, [1], 2)
    interrupted = coordinator.admit(0.0, [1], 2, worker_id=1)
    coordinator.report_tokens(1.0, first.worker_id, 1, first.request_id, 1, 0, [4, 5], finished=True)
    coordinator.fail(2.0, [1], cause="test")
    target, epoch = coordinator.request_worker(interrupted.request_id)
    coordinator.report_tokens(3.0, target, 1, interrupted.request_id, epoch, 0, [6, 7], finished=True)
    assert coordinator.forget_finished(10.5) == 0
    assert coordinator.forget_finished(11.5) == 1
    with pytest.raises(IndexError, match=f"request_id {first.request_id} is not a known request"):
        coordinator.tokens(first.request_id)
    assert coordinator.tokens(interrupted.request_id)[0] == (6, 7)
    assert coordinator.metrics().recovery_s == pytest.approx(1.0)
    with pytest.raises(ValueError, match="`finished_retention_s` must be > 0, got -1"):
        GatewayConfig(finished_retention_s=-1)


def test_holds_of_requests_nobody_reports_running_are_released_after_a_lease():
    coordinator = Coordinator(GatewayConfig(policy="LUMEN", lease_s=2.0, heartbeat_s=0.5), SECRET)
    coordinator.register(0.0, 1, budget_bytes=GIB, held=[HeldReport(7, 1, 12), HeldReport(8, 1, 3)])
    coordinator.register(0.5, 0, budget_bytes=GIB, running=[RunningReport(7, 1, (1,) * 12, (), 8, 8)])
    assert coordinator.monitor.request(7).durable_tokens == ((1, 12),)
    assert coordinator.drop_orphaned_holds(1.9) == 0
    assert coordinator.drop_orphaned_holds(2.1) == 1
    (release,) = coordinator.take_directives(1)
    assert (type(release), release.request_id) == (Release, 8)
    coordinator.fail(3.0, [1], cause="test")
    coordinator.register(3.5, 2, budget_bytes=GIB)
    coordinator.register(3.5, 1, state="recovering", held=[HeldReport(7, 1, 12)])  # lost with its memory
    assert coordinator.monitor.request(7).holder_ids == ()
    assert Release in kinds(coordinator.take_directives(1))


def test_cancel_stops_the_request_on_its_worker_and_releases_its_checkpoints():
    coordinator = cluster(3, policy="FC")
    admission = coordinator.admit(0.0, [1, 2], 8)
    rid, w = admission.request_id, admission.worker_id
    holder_ids = coordinator.monitor.request(rid).holder_ids
    assert holder_ids
    for worker_id in range(3):
        coordinator.take_directives(worker_id)
    coordinator.report_tokens(0.1, w, 1, rid, 1, 0, [5, 6])
    with pytest.raises(IndexError, match="request_id 99 is not a known request"):
        coordinator.cancel(0.2, 99, "client disconnected")
    assert coordinator.cancel(0.2, rid, "client disconnected")
    assert coordinator.take_directives(w) == [Cancel(rid, "client disconnected")]
    for holder_id in holder_ids:
        assert coordinator.take_directives(holder_id) == [Release(rid, 1, "finished")]
    assert coordinator.tokens(rid) == ((5, 6), True, False)
    assert not coordinator.monitor.has_request(rid)
    assert not coordinator.cancel(0.3, rid, "again")  # ended already: nothing more is sent
    assert all(coordinator.take_directives(worker_id) == [] for worker_id in range(3))


def test_a_workers_error_ends_the_request_as_lost_and_releases_its_checkpoints():
    coordinator = cluster(3, policy="FC")
    admission = coordinator.admit(0.0, [1, 2], 8)
    rid, w = admission.request_id, admission.worker_id
    holder_ids = coordinator.monitor.request(rid).holder_ids
    assert holder_ids
    for worker_id in range(3):
        coordinator.take_directives(worker_id)
    with pytest.raises(TypeError, match="error must be a str, got bytes"):
        coordinator.report_tokens(0.1, w, 1, rid, 1, 0, [5], error=b"refused")
    coordinator.report_tokens(0.1, w, 1, rid, 1, 0, [5, 6], error="the server answered 400:\nno room")
    assert coordinator.tokens(rid) == ((5, 6), True, True)  # the tokens sent with it are kept
    assert coordinator.lost_reason(rid) == "worker 0 refused it: the server answered 400:?no room"
    assert coordinator.refused(rid)
    assert not coordinator.monitor.has_request(rid)
    for holder_id in holder_ids:
        assert coordinator.take_directives(holder_id) == [Release(rid, 1, "finished")]
    assert coordinator.take_directives(w) == []  # it refused the request: nothing to cancel
    # An ended request stays as it ended: a later error changes nothing.
    done = coordinator.admit(0.2, [1], 2, worker_id=w).request_id
    coordinator.report_tokens(0.3, w, 1, done, 1, 0, [7, 8], finished=True)
    coordinator.report_tokens(0.3, w, 1, done, 1, 2, [], error="late")
    assert (coordinator.tokens(done), coordinator.lost_reason(done)) == (((7, 8), True, False), "")
    # The error is kept bounded: a hostile worker cannot make the gateway hold (or stream) more.
    long = coordinator.admit(0.4, [1], 2, worker_id=w).request_id
    coordinator.report_tokens(0.5, w, 1, long, 1, 0, [], error="\x1b" + "x" * 5000)
    assert coordinator.lost_reason(long) == "worker 0 refused it: ?" + "x" * 511


def test_a_request_its_worker_failed_is_moved_a_bounded_number_of_times_then_lost():
    coordinator = cluster(3, policy="S&R")
    admission = coordinator.admit(0.0, [1, 2], 8)
    rid, first = admission.request_id, admission.worker_id
    for worker_id in range(3):
        coordinator.take_directives(worker_id)
    with pytest.raises(ValueError, match="failed needs the error that failed the request"):
        coordinator.report_tokens(0.1, first, 1, rid, 1, 0, [5], failed=True)
    # The tokens sent with the failure are kept; the request resumes elsewhere from them.
    coordinator.report_tokens(0.1, first, 1, rid, 1, 0, [5, 6], error="the server answered 500", failed=True)
    worker, epoch = coordinator.request_worker(rid)
    assert (worker != first, epoch) == (True, 2)
    assert coordinator.take_directives(first) == [Cancel(rid, "moved (failed)")]
    (resume,) = [d for d in coordinator.take_directives(worker) if isinstance(d, Resume)]
    assert resume.output_token_ids == (5, 6)
    assert coordinator.tokens(rid) == ((5, 6), False, False) and not coordinator.refused(rid)
    for _ in range(coordinator_module.MAX_FAILED_MOVES - 1):
        coordinator.report_tokens(0.2, worker, 1, rid, epoch, 2, [], error="again", failed=True)
        worker, epoch = coordinator.request_worker(rid)
    # An error that follows the request from worker to worker is its own: it ends there.
    coordinator.report_tokens(0.3, worker, 1, rid, epoch, 2, [7], error="500 again", failed=True)
    assert coordinator.tokens(rid) == ((5, 6, 7), True, True)
    assert coordinator.lost_reason(rid) == f"worker {worker} failed it: 500 again"
    assert not coordinator.refused(rid)  # the cluster's failure, not the request's own error
    # With no other worker serving, a failed request is lost at once.
    alone = cluster(1, policy="S&R")
    rid = alone.admit(0.0, [1, 2], 8).request_id
    alone.report_tokens(0.1, 0, 1, rid, 1, 0, [], error="boom", failed=True)
    assert alone.lost_reason(rid) == "worker 0 failed it: boom" and not alone.refused(rid)


def test_an_error_from_a_stale_or_fenced_epoch_is_refused_and_the_request_goes_on():
    coordinator = cluster(3, policy="FC")
    admission = coordinator.admit(0.0, [1, 2], 8)
    rid, old = admission.request_id, admission.worker_id
    coordinator.report_tokens(0.1, old, 1, rid, 1, 0, [5])
    new = coordinator.move(0.2, rid, "rebalance").route.target_worker_id
    assert new != old and coordinator.request_worker(rid) == (new, 2)
    with pytest.raises(StaleEpochError, match=f"request {rid} epoch 1 on worker {old} is stale"):
        coordinator.report_tokens(0.3, old, 1, rid, 1, 1, [], error="refused")
    with pytest.raises(StaleEpochError, match=f"worker {new} epoch 7 is fenced"):
        coordinator.report_tokens(0.3, new, 7, rid, 2, 1, [], error="refused")
    assert coordinator.tokens(rid) == ((5,), False, False)
    assert coordinator.report_tokens(0.4, new, 1, rid, 2, 1, [6], finished=True).num_new == 1
    assert coordinator.tokens(rid) == ((5, 6), True, False) and coordinator.lost_reason(rid) == ""


def test_a_request_keeps_its_sampling_when_it_is_moved():
    coordinator = cluster(3, policy="S&R")
    sampling = Sampling(0.8, 12345)
    with pytest.raises(TypeError, match="sampling must be a Sampling, got float"):
        coordinator.admit(0.0, [1, 2], 8, sampling=0.8)
    admission = coordinator.admit(0.0, [1, 2], 8, sampling=sampling)
    rid, w = admission.request_id, admission.worker_id
    (run,) = [d for d in coordinator.take_directives(w) if isinstance(d, Run)]
    assert run.sampling == sampling
    coordinator.report_tokens(0.1, w, 1, rid, 1, 0, [5, 6])
    coordinator.fail(0.2, [w], cause="test")
    target, _ = coordinator.request_worker(rid)
    (resume,) = [d for d in coordinator.take_directives(target) if isinstance(d, Resume)]
    assert (resume.sampling, resume.output_token_ids) == (sampling, (5, 6))


def test_a_request_admitted_while_every_worker_failed_is_parked_then_run():
    coordinator = cluster(1, policy="S&R")
    coordinator.fail(1.0, [0], cause="lease expired")
    plan = coordinator.admit(2.0, [4, 5], 3)
    assert plan.parked and coordinator.tokens(plan.request_id) == ((), False, False)
    coordinator.register(3.0, 0, budget_bytes=64 * GIB, last_epoch=1)
    (resume,) = [d for d in coordinator.take_directives(0) if isinstance(d, Resume)]
    assert (resume.request_id, resume.prompt_token_ids) == (plan.request_id, (4, 5))
    assert resume.output_token_ids == ()
    full = cluster(1, policy="S&R", max_parked=0)
    full.fail(1.0, [0], cause="lease expired")
    with pytest.raises(NoWorkerError, match="no worker is serving and max_parked 0 reached"):
        full.admit(2.0, [4, 5], 3)
