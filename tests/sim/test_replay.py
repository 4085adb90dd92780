"""The simulator on a live run's arrivals (`lumen demo --compare-sim`)."""

import math

import numpy as np
import pytest

from lumen_core.cost import CostModel
from lumen_core.sim.replay import LIVE_DETECT_S, LiveSetup, sim_figures, simulate
from lumen_core.sim.workload import Workload

SETUP = LiveSetup(
    num_workers=3, model="Qwen3-32B", gpu="H100", tp=2, max_batched_tokens=512, max_num_seqs=64,
    heartbeat_s=0.25 / 4, holder_budget_tokens=100_000,
)  # fmt: skip


def workload(n=60, span_s=6.0, prompt=40, output=120):
    return Workload(
        arrival_s=np.linspace(0.0, span_s, n),
        prompt_tokens=np.full(n, prompt),
        output_tokens=np.full(n, output),
    )


def test_the_cluster_config_is_the_live_one_in_modelled_units():
    config = SETUP.cluster_config()
    assert (config.num_workers, config.model, config.gpu, config.tp) == (3, "Qwen3-32B", "H100", 2)
    assert (config.max_batched_tokens, config.max_num_seqs) == (512, 64)
    assert config.heartbeat_s == 0.0625 and config.detect_s == LIVE_DETECT_S
    assert config.report_min_tokens == 1
    # Room for as many tokens as the live holder has, in the modelled model's KV bytes.
    assert config.holder_budget_bytes == 100_000 * CostModel("Qwen3-32B", "H100", 2).kv_bytes_per_token
    assert config.acceptance == 0.7  # NaN: the simulator's default
    assert LiveSetup(**{**SETUP.__dict__, "acceptance": 0.4}).cluster_config().acceptance == 0.4


def test_a_simulated_decode_step_costs_what_a_paced_live_step_is_paced_to():
    # One request alone: its time per output token is the modelled decode step at its context.
    result = simulate(SETUP, workload(n=1, prompt=40, output=50), "FC", None)
    cost = CostModel("Qwen3-32B", "H100", 2)
    assert float(result.records.tpot_s[0]) == pytest.approx(cost.decode_step_time_s(1, 65), rel=0.02)


def test_the_live_failure_interrupts_requests_and_the_figures_come_prefixed():
    baseline = simulate(SETUP, workload(), "LUMEN", None)
    result = simulate(SETUP, workload(), "FC", (3.0, 1))
    assert result.failure_s == 3.0 and result.num_interrupted > 0
    figures = sim_figures(result, baseline, window_s=1.0, horizon_s=3.0, tolerance=0.25)
    assert set(figures) == {
        "sim_mean_ttft_s", "sim_mean_tpot_s", "sim_recovery_s", "sim_replay_ttft_s", "sim_restored",
        "sim_reprefilled", "sim_interrupted", "sim_accepted_drafts",
    }  # fmt: skip
    assert figures["sim_interrupted"] == result.num_interrupted
    assert figures["sim_restored"] + figures["sim_reprefilled"] == figures["sim_interrupted"]
    assert figures["sim_mean_ttft_s"] > 0 and not math.isnan(figures["sim_replay_ttft_s"])
    # The same arrivals and failure give the same figures (the simulator is deterministic).
    again = sim_figures(simulate(SETUP, workload(), "FC", (3.0, 1)), baseline, 1.0, 3.0, 0.25)
    assert again == figures
