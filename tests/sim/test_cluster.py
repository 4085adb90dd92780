import dataclasses

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lumen_core.eventlog import EventLog, read_event_log, replay_event_log
from lumen_core.policy.events import (
    PlacementDecision,
    RecoveryAction,
    RequestAdmitted,
    RouteDecision,
    WorkerFailed,
)
from lumen_core.policy.presets import POLICY_NAMES, preset
from lumen_core.sim.cluster import ClusterConfig, ClusterSim, Failure, combination
from lumen_core.sim.experiments import load_config_for
from lumen_core.sim.workload import load_trace, poisson_workload

SMALL = ClusterConfig(num_workers=4, model="Qwen3-14B", tp=1, reload_s=20.0)


def small_workload(seed: int = 0, num_requests: int = 600):
    return poisson_workload(20.0, num_requests, (200, 3000), (10, 300), seed)


def run(policy="LUMEN", failures=(Failure(10.0, (0,)),), config=SMALL, workload=None, log=None):
    workload = small_workload() if workload is None else workload
    return ClusterSim(config, workload, preset(policy), failures=failures, event_log=log).run()


def assert_conserved(result, num_requests):
    assert result.finish_counts.tolist() == [1] * num_requests
    records = result.records
    assert not np.isnan(records.finish_s).any() and not np.isnan(records.first_token_s).any()
    assert np.all(records.first_token_s >= records.arrival_s)
    assert np.all(records.finish_s >= records.first_token_s)
    replay = records.replay_token_s[records.interrupted]
    assert not np.isnan(replay).any()


@pytest.mark.parametrize("policy", POLICY_NAMES)
def test_every_request_finishes_exactly_once_through_a_failure(policy):
    result = run(policy)
    assert result.num_interrupted > 0
    assert_conserved(result, 600)
    assert sum(result.actions.values()) == result.num_interrupted


@pytest.mark.parametrize("policy", POLICY_NAMES)
def test_conservation_when_a_holder_dies_with_its_worker_and_again_later(policy):
    failures = (Failure(8.0, (0, 1)), Failure(9.5, (2,)))
    result = run(policy, failures=failures, config=dataclasses.replace(SMALL, num_workers=6))
    assert_conserved(result, 600)


def test_rack_failure_with_domains():
    config = dataclasses.replace(SMALL, num_workers=8, rack_size=4)
    result = run("LUMEN", failures=(Failure(10.0, (0, 1, 2, 3)),), config=config)
    assert_conserved(result, 600)
    assert result.actions["restore"] > 0  # holders sit in the other rack


def test_same_seed_same_run_different_seed_different_run():
    a = run("LUMEN", workload=small_workload(1))
    b = run("LUMEN", workload=small_workload(1))
    c = run("LUMEN", workload=small_workload(2))
    for field in ("first_token_s", "finish_s", "replay_token_s"):
        assert np.array_equal(getattr(a.records, field), getattr(b.records, field), equal_nan=True)
    assert a.actions == b.actions and a.num_iterations == b.num_iterations
    assert not np.array_equal(a.records.finish_s, c.records.finish_s)


@settings(max_examples=8, deadline=None)
@given(
    seed=st.integers(0, 10_000),
    failure_s=st.floats(0.5, 15.0),
    policy=st.sampled_from(POLICY_NAMES),
    failed=st.sets(st.integers(0, 3), min_size=1, max_size=2),
)
def test_conservation_and_determinism_property(seed, failure_s, policy, failed):
    workload = poisson_workload(15.0, 200, (50, 2000), (1, 200), seed)
    failures = (Failure(failure_s, tuple(sorted(failed))),)
    a = run(policy, failures=failures, workload=workload)
    b = run(policy, failures=failures, workload=workload)
    assert_conserved(a, 200)
    assert np.array_equal(a.records.finish_s, b.records.finish_s)


def test_checkpoints_restore_and_assist_happen_in_lumen():
    result = run("LUMEN")
    assert result.actions["restore"] > 0 and result.restored_tokens > 0
    assert 0.0 < result.coverage_at_failure <= 1.0
    assert result.assist_pairs and result.assist_pairs[0][0] == 0
    assert 0.0 < result.accepted_draft_tokens < result.proposed_draft_tokens
    plain = run("S&R")
    assert plain.actions["restore"] == 0 and plain.restored_tokens == 0 and not plain.assist_pairs


def test_slow_nic_leaves_gaps_in_checkpoints():
    slow = dataclasses.replace(SMALL, cost=dataclasses.replace(SMALL.cost, nic_bytes_per_s=0.2e9))
    fast = dataclasses.replace(SMALL, cost=dataclasses.replace(SMALL.cost, nic_bytes_per_s=50e9))
    assert run("LUMEN", config=slow).coverage_at_failure < run("LUMEN", config=fast).coverage_at_failure


def test_assist_is_refused_when_acceptance_is_too_low():
    # At a = 0 a verify step emits one token and costs at least a decode step: no gain.
    result = run("LUMEN", config=dataclasses.replace(SMALL, acceptance=0.0, acceptance_start=0.0))
    assert not result.assist_pairs


def test_event_log_is_written_readable_and_replays_to_the_same_decisions(tmp_path):
    path = tmp_path / "events.jsonl"
    workload = small_workload()
    log = EventLog.open(path)
    result = run("LUMEN", workload=workload, log=log)
    log.close()
    records = list(read_event_log(path))
    assert len(records) == log.num_records
    ops = {r["op"] for r in records}
    assert {"event", "place", "route", "replace", "pair", "finish", "gain"} <= ops
    admitted = [r["event"] for r in records if r["op"] == "event" and isinstance(r["event"], RequestAdmitted)]
    assert len(admitted) == 600
    routes = [d for r in records if r["op"] == "route" for d in r["result"]]
    assert all(isinstance(d, RouteDecision) for d in routes) and len(routes) == result.num_interrupted
    assert all(isinstance(r["result"][0], PlacementDecision) for r in records if r["op"] == "place")
    checked = replay_event_log(path, preset("LUMEN"), load_config_for(SMALL, workload))
    assert checked == sum(1 for r in records if r["op"] not in ("event", "gain"))
    # A different policy must disagree somewhere: the replay can fail.
    with pytest.raises(AssertionError, match="gave"):
        replay_event_log(path, preset("FC"), load_config_for(SMALL, workload))


def test_a_dead_worker_is_in_no_pairing_when_its_failure_is_detected(tmp_path):
    """Worker 0 fails again while it assists (recovering, paired): its survivor must stop
    verifying its drafts then, not keep a dead assistant until 0's next switch-over."""
    config = ClusterConfig(num_workers=6, model="Qwen3-14B", tp=1, reload_s=8.0, rack_size=2)
    workload = poisson_workload(30.0, 500, (200, 3000), (10, 400), 1)
    failures = (Failure(5.0, (0, 1)), Failure(9.0, (3,)), Failure(12.5, (0,)))
    path = tmp_path / "log.jsonl"
    log = EventLog.open(path)
    result = ClusterSim(config, workload, preset("LUMEN"), failures=failures, event_log=log).run()
    log.close()
    assert_conserved(result, 500)
    survivor_of: dict[int, int] = {}
    num_detected_while_paired = 0
    for record in read_event_log(path):
        op = record["op"]
        if op == "pair" and record["result"][0].survivor_id is not None:
            decision = record["result"][0]
            assert not decision.reason.startswith("already"), decision
            survivor_of[decision.assistant_id] = decision.survivor_id
        elif op == "finish":
            survivor_of.pop(record["args"]["assistant_id"], None)
        elif op == "release_survivor":
            survivor_of = {a: s for a, s in survivor_of.items() if s != record["args"]["survivor_id"]}
        elif op == "event" and isinstance(record["event"], WorkerFailed):
            worker_id = record["event"].worker_id
            num_detected_while_paired += worker_id in survivor_of or worker_id in survivor_of.values()
    assert num_detected_while_paired == 0
    assert (0, 2) in result.assist_pairs  # 0 was paired when it failed the second time


def test_ablation_combinations_run():
    for mask in range(8):
        factory = combination(
            f"m{mask}",
            load_aware_placement=bool(mask & 1),
            locality_routing=bool(mask & 2),
            speculative_assist=bool(mask & 4),
        )
        result = ClusterSim(SMALL, small_workload(num_requests=200), factory, (Failure(5.0, (1,)),)).run()
        assert_conserved(result, 200)
        assert bool(result.assist_pairs) == bool(mask & 4)


def test_validation():
    workload = small_workload(num_requests=10)
    with pytest.raises(TypeError, match="`num_workers` must be int"):
        ClusterConfig(num_workers=2.0)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="`num_workers` must be >= 1"):
        ClusterConfig(num_workers=0)
    with pytest.raises(ValueError, match="`detect_s` must be > 0"):
        ClusterConfig(detect_s=0.0)
    with pytest.raises(ValueError, match="`reload_s` must be >= 0 or None"):
        ClusterConfig(reload_s=-1.0)
    with pytest.raises(ValueError, match="`acceptance` must be in"):
        ClusterConfig(acceptance=1.5)
    with pytest.raises(ValueError, match="`rack_size` must be >= 0"):
        ClusterConfig(rack_size=-1)
    with pytest.raises(ValueError, match="`time_s` must be >= 0"):
        Failure(-1.0, (0,))
    with pytest.raises(ValueError, match="`worker_ids` must name at least one"):
        Failure(1.0, ())
    with pytest.raises(ValueError, match="`worker_ids` must be distinct"):
        Failure(1.0, (1, 1))
    with pytest.raises(IndexError, match="out of range"):
        ClusterSim(SMALL, workload, preset("S&R"), (Failure(1.0, (4,)),))
    with pytest.raises(TypeError, match="`config` must be ClusterConfig"):
        ClusterSim(object(), workload, preset("S&R"))  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="`workload` must be Workload"):
        ClusterSim(SMALL, object(), preset("S&R"))  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="`policy` must build a PolicySet"):
        ClusterSim(SMALL, workload, lambda gain: None)  # type: ignore[arg-type,return-value]
    huge = poisson_workload(1.0, 2, (400_000, 400_000), (1, 1), 0)
    with pytest.raises(ValueError, match="must fit one worker's KV cache"):
        ClusterSim(SMALL, huge, preset("S&R"))
    with pytest.raises(ValueError, match="`name` must be one of"):
        preset("nope")


def test_whole_trace_runs_at_64_workers_without_loss():
    trace = load_trace().scaled_to_rate(6.9 * 64)
    config = ClusterConfig(num_workers=64, model="Llama-3-70B", tp=4)
    result = ClusterSim(config, trace, preset("LUMEN"), (Failure(15.0, tuple(range(0, 64, 4))),)).run()
    assert_conserved(result, len(trace))
    assert result.num_interrupted > 500


def test_event_log_validation(tmp_path):
    import io

    from lumen_core.eventlog import from_json, to_json

    decision = RouteDecision(3, 1, RecoveryAction.RESTORE, 2, 100, "r")
    assert from_json(to_json(decision)) == decision
    with pytest.raises(ValueError, match="`type` must be one of"):
        from_json({"type": "Nope"})
    log = EventLog(io.StringIO())
    with pytest.raises(ValueError, match="`op` must be one of"):
        log.decision("evict", {}, None)
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"op": "teleport"}\n')
    with pytest.raises(ValueError, match="record `op` must be"):
        list(read_event_log(bad))


def test_progress_bar_goes_to_stderr(capsys):
    ClusterSim(SMALL, small_workload(num_requests=100), preset("S&R"), progress=True).run()
    captured = capsys.readouterr()
    assert "100.0%" in captured.err and captured.out == ""


@pytest.mark.parametrize("policy", POLICY_NAMES)
def test_every_worker_failing_at_once_parks_the_requests_until_one_recovers(policy):
    result = run(policy, failures=(Failure(10.0, (0, 1, 2, 3)),))
    assert result.num_interrupted > 0
    assert_conserved(result, 600)
    assert result.actions["reprefill"] >= result.num_interrupted  # no holder survived
