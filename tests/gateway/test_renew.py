"""Capability renewal (issue 19): the coordinator re-issues a running request's capabilities
before they expire (RENEW, decided on the injected clock); its lifetime is configurable."""

import time

import pytest

from lumen_core.auth import CapabilityIssuer, Rights, verify_capability
from lumen_core.cli import main
from lumen_core.gateway.config import GatewayConfig
from lumen_core.gateway.coordinator import Coordinator
from lumen_core.gateway.directives import Renew, Resume, Run
from lumen_core.gateway.renewals import RenewalQueue
from lumen_core.gateway.reports import HeldReport, RunningReport

pytestmark = pytest.mark.timeout(60)

SECRET = b"renewal-tests-secret-0123456789abcdef"
GIB = 1 << 30
TTL_S = 2.0  # renewed at half of it: 1 s after each grant


def cluster(num_workers=3, policy="LUMEN"):
    config = GatewayConfig(policy=policy, heartbeat_s=0.5, capability_ttl_s=TTL_S)
    coordinator = Coordinator(config, SECRET)
    for worker_id in range(num_workers):
        coordinator.register(0.0, worker_id, budget_bytes=64 * GIB, holder_address=f"h{worker_id}")
    return coordinator


def renewals(coordinator, now_s):
    """The RENEWs each worker got from one renewal pass at ``now_s``."""
    coordinator.renew_capabilities(now_s)
    out = {}
    for worker_id in coordinator.worker_ids():
        got = [d for d in coordinator.take_directives(worker_id) if isinstance(d, Renew)]
        if got:
            out[worker_id] = got
    return out


def fields(public_key, grants):
    return [(g.worker_id, verify_capability(public_key, c)) for g in grants for c in g.capabilities]


def test_capability_lifetime_validation(ucx_module):
    with pytest.raises(ValueError, match="`capability_ttl_s` must be > 0, got 0"):
        GatewayConfig(capability_ttl_s=0)
    with pytest.raises(ValueError, match="capability_ttl_s must be finite, got inf"):
        GatewayConfig(capability_ttl_s=float("inf"))
    with pytest.raises(ValueError, match=r"capability_renew_share must be in \(0, 1\), got 1.0"):
        GatewayConfig(capability_renew_share=1.0)
    with pytest.raises(ValueError, match="`capability_renew_share` must be > 0, got 0"):
        GatewayConfig(capability_renew_share=0)
    with pytest.raises(ValueError, match=r"must be > heartbeat_s \(1.0\), got 2.0 \* \(1 - 0.5\) = 1.0"):
        GatewayConfig(capability_ttl_s=2.0)
    assert GatewayConfig().capability_ttl_s == 3600.0  # the one-hour default stays
    with pytest.raises(
        ValueError, match=r"issuer.ttl_s must be config.capability_ttl_s \(3600.0\), got 60.0"
    ):
        Coordinator(GatewayConfig(), SECRET, issuer=CapabilityIssuer.generate(ttl_s=60.0))


def test_the_gateway_flag_is_validated(tmp_path, capsys):
    path = tmp_path / "secret"
    assert main(["gateway", "--write-secret", str(path)]) == 0
    assert main(["gateway", "--secret-file", str(path), "--capability-ttl-s", "-1"]) == 2
    assert "`capability_ttl_s` must be > 0, got -1.0" in capsys.readouterr().err
    assert main(["gateway", "--secret-file", str(path), "--capability-ttl-s", "1.5"]) == 2
    assert "must be > heartbeat_s (1.0), got 1.5 * (1 - 0.5) = 0.75" in capsys.readouterr().err


def test_a_running_request_is_renewed_before_expiry_at_its_epoch_for_its_holders(ucx_module):
    coordinator = cluster()
    admission = coordinator.admit(0.0, [1] * 10, 50)
    rid, serving = admission.request_id, admission.worker_id
    (run,) = [d for d in coordinator.take_directives(serving) if isinstance(d, Run)]
    for worker_id in coordinator.worker_ids():
        coordinator.take_directives(worker_id)
    time.sleep(0.01)  # expiries are on the issuer's wall clock, in ms: the renewal's is later
    assert renewals(coordinator, 0.99) == {}
    [(worker_id, [renew])] = renewals(coordinator, 1.0).items()
    assert worker_id == serving and renew.request_id == rid and renew.epoch == run.epoch == 1
    assert (
        [g.worker_id for g in renew.holders]
        == [g.worker_id for g in run.holders]
        == [*admission.placement.holder_ids]
    )
    assert [g.address for g in renew.holders] == [g.address for g in run.holders]
    before = fields(coordinator.issuer_public_key, run.holders)
    after = fields(coordinator.issuer_public_key, renew.holders)
    assert len(after) == len(before) == 1
    for (holder, old), (same_holder, new) in zip(before, after):
        assert holder == same_holder == new.holder_id
        assert (new.request_id, new.shard, new.epoch, new.rights) == (rid, 0, 1, Rights.WRITE | Rights.READ)
        assert (old.request_id, old.shard, old.epoch, old.rights) == (
            new.request_id,
            new.shard,
            new.epoch,
            new.rights,
        )
        assert new.expires_at_ms > old.expires_at_ms
        assert abs(new.expires_at_ms / 1000 - (time.time() + TTL_S)) < 1.0
    assert renewals(coordinator, 1.5) == {}  # renewed at 1.0: due again at 2.0
    assert [r.epoch for r in renewals(coordinator, 2.0)[serving]] == [1]
    coordinator.report_tokens(2.1, serving, 1, rid, 1, 0, [5] * 50, finished=True)
    assert renewals(coordinator, 10.0) == {}  # finished: nothing more


def test_a_moved_request_is_renewed_only_where_it_runs_now_and_at_its_new_epoch(ucx_module):
    coordinator = cluster(4, policy="FC")
    admission = coordinator.admit(0.0, [1] * 10, 50)
    rid, old = admission.request_id, admission.worker_id
    coordinator.report_checkpoint(0.5, admission.placement.holder_ids[0], rid, 1, 10)
    for worker_id in coordinator.worker_ids():
        coordinator.take_directives(worker_id)
    coordinator.fail(0.9, [old], cause="test")
    target, epoch = coordinator.request_worker(rid)
    (resume,) = [d for d in coordinator.take_directives(target) if isinstance(d, Resume)]
    assert epoch == resume.epoch == 2 and resume.holders
    assert renewals(coordinator, 1.5) == {}  # the RESUME's grants are 0.6 s old, not the RUN's 1.5 s
    got = renewals(coordinator, 2.0)
    assert list(got) == [target] and [(r.request_id, r.epoch) for r in got[target]] == [(rid, 2)]
    assert [g.worker_id for g in got[target][0].holders] == [g.worker_id for g in resume.holders]
    assert {f.epoch for _, f in fields(coordinator.issuer_public_key, got[target][0].holders)} == {2}


def test_a_request_without_holders_is_not_renewed(ucx_module):
    coordinator = cluster(1, policy="FC")  # no other worker to hold a copy
    admission = coordinator.admit(0.0, [1] * 10, 50)
    assert admission.placement.holder_ids == ()
    assert renewals(coordinator, 5.0) == {}


def test_parked_requests_are_not_renewed_until_a_worker_takes_them(ucx_module):
    coordinator = Coordinator(GatewayConfig(lease_s=3.0, heartbeat_s=0.5, capability_ttl_s=TTL_S), SECRET)
    for worker_id in range(2):
        coordinator.register(0.0, worker_id, budget_bytes=64 * GIB, holder_address=f"h{worker_id}")
    request_id = coordinator.admit(0.0, [1, 2, 3], 400).request_id
    coordinator.fail(0.5, [0, 1], cause="lease expired")  # every worker: parked
    parked_now = coordinator.admit(0.6, [4, 5], 400).request_id  # parked at admission
    assert renewals(coordinator, 5.0) == {}  # neither is served anywhere: nothing to renew
    coordinator.register(6.0, 1, budget_bytes=64 * GIB, holder_address="h1", last_epoch=1)
    resumed = [d for d in coordinator.take_directives(1) if isinstance(d, Resume)]
    assert {d.request_id for d in resumed} == {request_id, parked_now}
    assert renewals(coordinator, 6.9) == {}  # their grants came with the RESUME at 6.0


def test_a_pass_looks_only_at_the_requests_due_not_at_the_finished_ones_kept(ucx_module):
    coordinator = cluster()
    for _ in range(20_000):  # kept for finished_retention_s, each with its RUN's grant
        coordinator.finish_request(0.0, coordinator.admit(0.0, [1], 1).request_id)
    running = {coordinator.admit(0.5, [1] * 10, 50).request_id for _ in range(10)}
    for worker_id in coordinator.worker_ids():
        coordinator.take_directives(worker_id)
    assert coordinator.num_requests == 20_010 and coordinator.num_finished == 20_000
    queue = coordinator._renewals  # noqa: SLF001 - what a pass pops from
    assert queue.num_live == 10 and len(queue) <= 2 * 10 + RenewalQueue.SLACK
    assert renewals(coordinator, 1.25) == {}  # the finished ones' grants are due: none renewed
    got = renewals(coordinator, 1.5)
    assert {r.request_id for renews in got.values() for r in renews} == running
    assert queue.num_live == 10 and len(queue) == 10  # renewed, queued again; nothing stale


def test_a_moved_request_is_not_renewed_again_until_due_from_its_resume(ucx_module):
    coordinator = cluster(4, policy="FC")
    admission = coordinator.admit(0.0, [1] * 10, 50)
    rid = admission.request_id
    coordinator.report_checkpoint(0.5, admission.placement.holder_ids[0], rid, 1, 10)
    coordinator.move(0.75, rid, "rebalance")
    target, epoch = coordinator.request_worker(rid)
    assert target != admission.worker_id and epoch == 2
    assert renewals(coordinator, 1.5) == {}  # the RUN's grant (0.0) is due, but was superseded
    assert renewals(coordinator, 1.74) == {}
    got = renewals(coordinator, 1.75)
    assert list(got) == [target] and [(r.request_id, r.epoch) for r in got[target]] == [(rid, 2)]


def test_an_unparked_request_is_renewed_once_due_from_its_resume(ucx_module):
    config = GatewayConfig(policy="FC", lease_s=3.0, heartbeat_s=0.5, capability_ttl_s=TTL_S)
    coordinator = Coordinator(config, SECRET)
    for worker_id in range(3):
        coordinator.register(0.0, worker_id, budget_bytes=64 * GIB, holder_address=f"h{worker_id}")
    admission = coordinator.admit(0.0, [1, 2, 3], 400, worker_id=0)
    rid, (holder,) = admission.request_id, admission.placement.holder_ids
    coordinator.report_checkpoint(0.5, holder, rid, 1, 3)
    coordinator.fail(0.75, [0, 1, 2], cause="lease expired")  # parked, its RUN's grant queued
    assert renewals(coordinator, 5.0) == {}  # due, but parked: it leaves the queue
    other = ({1, 2} - {holder}).pop()
    coordinator.register(6.0, other, budget_bytes=64 * GIB, holder_address=f"h{other}", last_epoch=1)
    assert coordinator.request_worker(rid) == (0, 1)  # waiting for its holder to come back
    held = (HeldReport(rid, 1, 3),)
    coordinator.register(
        6.25, holder, budget_bytes=64 * GIB, holder_address=f"h{holder}", last_epoch=1, held=held
    )
    assert coordinator.request_worker(rid) == (holder, 2)  # restored where its copy is
    (resume,) = [d for d in coordinator.take_directives(holder) if isinstance(d, Resume)]
    assert [g.worker_id for g in resume.holders] == [other]
    assert renewals(coordinator, 7.0) == {}
    got = renewals(coordinator, 7.25)
    assert list(got) == [holder] and [(r.request_id, r.epoch) for r in got[holder]] == [(rid, 2)]


def test_an_adopted_request_without_a_holder_yet_is_renewed_once_its_holder_registers(ucx_module):
    """After a gateway restart: a pass before the holder is back skips the request, and keeps it."""
    coordinator = Coordinator(GatewayConfig(policy="FC", heartbeat_s=0.5, capability_ttl_s=TTL_S), SECRET)
    running = (RunningReport(7, 3, (1,) * 12, (4, 4), 8, 8),)
    coordinator.register(0.0, 0, budget_bytes=64 * GIB, holder_address="h0", last_epoch=1, running=running)
    assert renewals(coordinator, 0.25) == {}  # due (signed before the restart), but no holder
    held = (HeldReport(7, 3, 12),)
    coordinator.register(0.5, 1, budget_bytes=64 * GIB, holder_address="h1", last_epoch=1, held=held)
    got = renewals(coordinator, 0.75)
    assert list(got) == [0] and [(r.request_id, r.epoch) for r in got[0]] == [(7, 3)]
    assert [g.worker_id for g in got[0][0].holders] == [1]
