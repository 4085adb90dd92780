"""The simulator on a live run's arrivals (``lumen demo --compare-sim``, issue 21).

A paced live cluster and the simulator share the cost model; run on the same arrivals (same
requests, failure time and worker, policies, batching limits and control latencies) their
figures should agree, and where they do not one side models something wrong. This module
builds that simulated run from what the live run used and returns its figures under the
demo's names.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from lumen_core.metrics import run_figures
from lumen_core.policy.presets import preset
from lumen_core.sim.cluster import ClusterConfig, ClusterSim, Failure, SimResult
from lumen_core.sim.workload import Workload

# The live worker's failure is reported to the gateway by the process supervisor right
# after the SIGKILL is reaped (``LocalCluster.kill``): detection takes no lease expiry. The
# simulator needs a positive delay; a millisecond stands for "at once".
LIVE_DETECT_S = 1e-3


@dataclass(frozen=True)
class LiveSetup:
    """What the live cluster ran with, in modelled units: ``num_workers`` workers of
    ``model`` on ``tp`` x ``gpu``; the engine's ``max_batched_tokens`` / ``max_num_seqs``;
    heartbeats every ``heartbeat_s``; each holder offers room for ``holder_budget_tokens``
    tokens; drafts accepted at ``acceptance`` (the live run's measured rate, NaN: the
    simulator's default)."""

    num_workers: int
    model: str
    gpu: str
    tp: int
    max_batched_tokens: int
    max_num_seqs: int
    heartbeat_s: float
    holder_budget_tokens: int
    acceptance: float = math.nan

    def cluster_config(self) -> ClusterConfig:
        config = ClusterConfig(
            num_workers=self.num_workers,
            model=self.model,
            gpu=self.gpu,
            tp=self.tp,
            max_batched_tokens=self.max_batched_tokens,
            max_num_seqs=self.max_num_seqs,
            heartbeat_s=self.heartbeat_s,
            detect_s=LIVE_DETECT_S,
            report_min_tokens=1,  # a live worker reports every held checkpoint at every heartbeat
        )
        budget_bytes = self.holder_budget_tokens * config.cost_model().kv_bytes_per_token
        acceptance = config.acceptance if math.isnan(self.acceptance) else self.acceptance
        return dataclasses.replace(config, holder_budget_bytes=budget_bytes, acceptance=acceptance)


def simulate(
    setup: LiveSetup, workload: Workload, policy: str, failure: tuple[float, int] | None
) -> SimResult:
    """One simulated run of ``workload`` under ``policy``; ``failure``: (modelled time,
    worker id) of the live SIGKILL, None for the failure-free run."""
    failures = () if failure is None else (Failure(failure[0], (failure[1],)),)
    return ClusterSim(setup.cluster_config(), workload, preset(policy), failures=failures).run()


def sim_figures(
    result: SimResult, baseline: SimResult, window_s: float, horizon_s: float, tolerance: float
) -> dict[str, float]:
    """The demo's figures of a simulated run, prefixed ``sim_``: the timing figures of
    ``metrics.run_figures`` and the restored / re-prefilled / accepted-draft counts."""
    figures = run_figures(result.records, baseline.records, result.failure_s, window_s, horizon_s, tolerance)
    figures["restored"] = result.actions.get("restore", 0) + result.actions.get("remote_restore", 0)
    figures["reprefilled"] = result.actions.get("reprefill", 0)
    figures["interrupted"] = result.num_interrupted
    figures["accepted_drafts"] = result.accepted_draft_tokens
    return {f"sim_{k}": float(v) for k, v in figures.items()}
