"""``Coordinator.move``: one running request moved off a live worker (the primitive a drain
and the failure path share), without gRPC."""

import pytest

from lumen_core.gateway.config import GatewayConfig
from lumen_core.gateway.coordinator import Coordinator
from lumen_core.gateway.directives import Cancel, Hold, Release, Resume
from lumen_core.gateway.errors import StaleEpochError
from lumen_core.policy.events import RecoveryAction

pytestmark = pytest.mark.timeout(60)

SECRET = b"move-tests-secret-0123456789abcdef"
GIB = 1 << 30


def cluster(num_workers, policy):
    coordinator = Coordinator(GatewayConfig(policy=policy), SECRET)
    for worker_id in range(num_workers):
        coordinator.register(0.0, worker_id, budget_bytes=64 * GIB, holder_address=f"h{worker_id}")
    return coordinator


def drain_directives(coordinator):
    return {w: coordinator.take_directives(w) for w in coordinator.worker_ids()}


def test_a_moved_request_restores_on_its_holder_and_its_stream_continues():
    coordinator = cluster(3, "FC")
    admission = coordinator.admit(0.0, [3] * 10, 8)
    rid, old = admission.request_id, admission.worker_id
    (holder,) = admission.placement.holder_ids
    drain_directives(coordinator)
    coordinator.report_tokens(0.1, old, 1, rid, 1, 0, [5, 6, 7])
    coordinator.report_checkpoint(0.2, holder, rid, 1, 12)
    reroute = coordinator.move(0.3, rid, "drain")
    assert reroute.route.action is RecoveryAction.RESTORE and reroute.route.target_worker_id == holder
    assert coordinator.request_worker(rid) == (holder, 2)
    directives = drain_directives(coordinator)
    (cancel,) = directives[old]
    assert isinstance(cancel, Cancel) and cancel.request_id == rid and "drain" in cancel.reason
    (resume,) = [d for d in directives[holder] if isinstance(d, Resume)]
    assert (resume.epoch, resume.action, resume.source.worker_id) == (2, RecoveryAction.RESTORE, holder)
    assert resume.prompt_token_ids == (3,) * 10 and resume.output_token_ids == (5, 6, 7)
    # the old worker's late tokens are refused; the new one continues from position 3
    with pytest.raises(StaleEpochError, match=f"request {rid} epoch 1 on worker {old} is stale"):
        coordinator.report_tokens(0.4, old, 1, rid, 1, 3, [8])
    ack = coordinator.report_tokens(0.5, holder, 1, rid, 2, 3, [8, 9])
    assert (ack.num_new, ack.num_conflicts, ack.next_position) == (2, 0, 5)
    assert coordinator.tokens(rid) == ((5, 6, 7, 8, 9), False, False)
    assert coordinator.monitor.request(rid).worker_id == holder


def test_a_move_without_the_checkpoint_reprefills_elsewhere_and_releases_the_copy():
    coordinator = cluster(3, "FC")
    admission = coordinator.admit(0.0, [3] * 10, 8)
    rid, old = admission.request_id, admission.worker_id
    (holder,) = admission.placement.holder_ids
    drain_directives(coordinator)
    reroute = coordinator.move(0.3, rid, "drain deadline", reprefill=True)
    target = reroute.route.target_worker_id
    assert reroute.route.action is RecoveryAction.REPREFILL and target not in (old,)
    directives = drain_directives(coordinator)
    assert [type(d) for d in directives[old]][:1] == [Cancel]  # (it may hold the new copy)
    resume = next(d for d in directives[target] if isinstance(d, Resume))
    assert resume.action is RecoveryAction.REPREFILL and resume.source is None and resume.epoch == 2
    if holder != target:
        assert [type(d) for d in directives[holder]][:1] == [Release]
    assert all(isinstance(d, (Hold, Resume)) for d in directives[target])


def test_move_validation():
    coordinator = cluster(1, "LUMEN")
    rid = coordinator.admit(0.0, [1, 2], 4).request_id
    with pytest.raises(IndexError, match="request_id 99 is not a known request"):
        coordinator.move(0.1, 99, "drain")
    with pytest.raises(TypeError, match="reason must be a str, got int"):
        coordinator.move(0.1, rid, 3)
    with pytest.raises(ValueError, match="must have a serving worker other than 0 to move request 1"):
        coordinator.move(0.1, rid, "drain")
    coordinator.finish_request(0.2, rid)
    with pytest.raises(ValueError, match="request_id must be a running request, got 1 \\(finished\\)"):
        coordinator.move(0.3, rid, "drain")


def test_moves_replay_from_the_event_log(tmp_path):
    from lumen_core.eventlog import EventLog, replay_event_log
    from lumen_core.policy.presets import preset

    path = tmp_path / "moves.jsonl"
    log = EventLog.open(path)
    config = GatewayConfig(policy="LUMEN")
    coordinator = Coordinator(config, SECRET, event_log=log)
    for worker_id in range(3):
        coordinator.register(0.0, worker_id, budget_bytes=64 * GIB, holder_address=f"h{worker_id}")
    rids = [coordinator.admit(0.0, [1] * 8, 4).request_id for _ in range(4)]
    coordinator.move(0.5, rids[0], "drain")
    coordinator.move(0.6, rids[1], "drain deadline", reprefill=True)
    log.close()
    factory = preset(
        "LUMEN",
        placement_config=config.placement_config,
        router_config=config.router_config,
        assist_config=config.assist_config,
    )
    assert replay_event_log(path, factory, config.load_config) >= 2 + 4
