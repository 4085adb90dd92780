"""SpecAssistPlanner: pairing with the most loaded unassisted survivor when the gain is
positive, the cold/warm draft length, finishing, and the gain model."""

from __future__ import annotations

import pytest

from lumen_core.policy import (
    AssistConfig,
    Heartbeat,
    LoadMonitor,
    SpecAssistPlanner,
    WorkerFailed,
    WorkerRecovering,
    expected_tokens_per_step,
    make_acceptance_gain,
)


def recovering_cluster(make_cluster, queues: list[int], recovering: tuple[int, ...]) -> LoadMonitor:
    monitor = make_cluster(len(queues))
    for worker_id, depth in enumerate(queues):
        monitor.apply(Heartbeat(0.0, worker_id, depth, 0))
    for worker_id in recovering:
        monitor.apply(WorkerFailed(1.0, worker_id))
        monitor.apply(WorkerRecovering(2.0, worker_id))
    return monitor


def always(gain: float):
    return lambda monitor, survivor_id, k: gain


def test_pairs_most_loaded_then_next(make_cluster):
    monitor = recovering_cluster(make_cluster, [0, 3, 7, 7, 1], recovering=(0, 4))
    planner = SpecAssistPlanner(AssistConfig(), always(1.0))
    first = planner.pair(monitor, 0)
    assert (first.survivor_id, first.num_draft_tokens, first.predicted_gain) == (2, 2, 1.0)
    assert "most loaded unassisted survivor 2" in first.reason
    second = planner.pair(monitor, 4)
    assert second.survivor_id == 3  # 2 already has an assistant; tie 2/3 went to 2
    assert planner.pair(monitor, 0).survivor_id == 2  # idempotent
    assert planner.survivor_of(0) == 2 and planner.assistant_of(3) == 4


def test_skips_survivors_without_gain(make_cluster):
    monitor = recovering_cluster(make_cluster, [0, 5, 9], recovering=(0,))
    seen = []

    def gain(monitor, survivor_id, k):
        seen.append((survivor_id, k))
        return -0.5 if survivor_id == 2 else 0.25

    decision = SpecAssistPlanner(AssistConfig(num_draft_tokens=6), gain).pair(monitor, 0)
    assert decision.survivor_id == 1 and seen == [(2, 6), (1, 6)]
    assert "no gain on 2: -0.500" in decision.reason


def test_no_pairing_without_gain_or_survivor(make_cluster):
    monitor = recovering_cluster(make_cluster, [0, 5], recovering=(0,))
    decision = SpecAssistPlanner(AssistConfig(), always(0.0)).pair(monitor, 0)
    assert (decision.survivor_id, decision.num_draft_tokens) == (None, 0)
    assert "no survivor with a positive predicted gain" in decision.reason
    planner = SpecAssistPlanner(AssistConfig(), always(1.0))
    monitor = recovering_cluster(make_cluster, [0, 5, 0], recovering=(0, 2))
    assert planner.pair(monitor, 0).survivor_id == 1
    lonely = planner.pair(monitor, 2)
    assert lonely.survivor_id is None and "no serving worker without an assistant" in lonely.reason


def test_finish_and_release_free_the_survivor(make_cluster):
    monitor = recovering_cluster(make_cluster, [0, 5, 0], recovering=(0, 2))
    planner = SpecAssistPlanner(AssistConfig(), always(1.0))
    planner.pair(monitor, 0)
    assert planner.finish(0) == 1 and planner.survivor_of(0) is None
    assert planner.finish(0) is None
    assert planner.pair(monitor, 2).survivor_id == 1
    assert planner.release_survivor(1) == 2 and planner.survivor_of(2) is None
    assert planner.release_survivor(1) is None


def test_draft_length_cold_then_warm():
    planner = SpecAssistPlanner(
        AssistConfig(num_draft_tokens=5, cold_num_draft_tokens=2, cold_steps=100), always(1.0)
    )
    assert [planner.num_draft_tokens(0, s) for s in (0, 99, 100, 1000)] == [2, 2, 5, 5]
    assert SpecAssistPlanner(AssistConfig(cold_steps=0), always(1.0)).num_draft_tokens(0, 0) == 4


def test_gain_model():
    assert expected_tokens_per_step(0.0, 4) == 1.0
    assert expected_tokens_per_step(1.0, 4) == 5.0
    assert expected_tokens_per_step(0.5, 2) == pytest.approx(1.75)
    gain = make_acceptance_gain(0.5, 0.2)
    assert gain(LoadMonitor(), 0, 2) == pytest.approx(1.75 - 1.4)
    assert make_acceptance_gain(0.1, 0.5)(LoadMonitor(), 0, 4) < 0


def test_validation(make_cluster):
    monitor = recovering_cluster(make_cluster, [0, 5], recovering=(0,))
    planner = SpecAssistPlanner(AssistConfig(), always(1.0))
    with pytest.raises(ValueError, match="`num_draft_tokens` must be >= 1, got 0"):
        AssistConfig(num_draft_tokens=0)
    with pytest.raises(TypeError, match="`cold_num_draft_tokens` must be an int, got float"):
        AssistConfig(cold_num_draft_tokens=1.5)
    with pytest.raises(ValueError, match="`cold_steps` must be >= 0, got -1"):
        AssistConfig(cold_steps=-1)
    with pytest.raises(TypeError, match="`config` must be an AssistConfig, got NoneType"):
        SpecAssistPlanner(None, always(1.0))
    with pytest.raises(TypeError, match="`gain_fn` must be callable, got float"):
        SpecAssistPlanner(AssistConfig(), 1.0)
    with pytest.raises(TypeError, match="`monitor` must be a LoadMonitor, got dict"):
        planner.pair({}, 0)
    with pytest.raises(ValueError, match=r"`assistant_id` must be a recovering worker, got 1 \(serving\)"):
        planner.pair(monitor, 1)
    with pytest.raises(IndexError, match="worker_id 9 is not a known worker"):
        planner.pair(monitor, 9)
    with pytest.raises(ValueError, match="`steps_done` must be >= 0, got -1"):
        planner.num_draft_tokens(0, -1)
    with pytest.raises(TypeError, match="`steps_done` must be an int, got float"):
        planner.num_draft_tokens(0, 1.0)
    with pytest.raises(ValueError, match=r"`acceptance_rate` must be in \[0, 1\], got 1.5"):
        expected_tokens_per_step(1.5, 2)
    with pytest.raises(TypeError, match="`acceptance_rate` must be a number, got str"):
        expected_tokens_per_step("0.5", 2)
    with pytest.raises(ValueError, match="`num_draft_tokens` must be >= 0, got -1"):
        expected_tokens_per_step(0.5, -1)
    with pytest.raises(ValueError, match="`verify_cost_per_draft_token` must be >= 0, got -0.1"):
        make_acceptance_gain(0.5, -0.1)
