"""Capability renewal (issue 19): the coordinator re-issues a running request's capabilities
before they expire (RENEW, decided on the injected clock); its lifetime is configurable."""

import time

import pytest

from lumen_core.auth import CapabilityIssuer, Rights, verify_capability
from lumen_core.cli import main
from lumen_core.gateway.config import GatewayConfig
from lumen_core.gateway.coordinator import Coordinator
from lumen_core.gateway.directives import Renew, Resume, Run

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
