"""End to end on loopback: a gateway, 3 worker processes, a SIGKILL while requests run with
durable checkpoints, a restart; every request completes with the failure-free output."""

from pathlib import Path

import pytest

from lumen_core import _native
from lumen_core.policy.events import RecoveryAction
from lumen_core.engine import Engine, SamplingParams, load_model
from lumen_core.sim.workload import Workload
from lumen_core.worker.scenario import FailurePlan, arrivals_from_workload, run_scenario

import numpy as np

pytestmark = [
    pytest.mark.ucx,
    pytest.mark.skipif(not _native.HAS_UCX, reason="lumen_core._C_ucx is not built (LUMEN_UCX=ON)"),
    pytest.mark.timeout(240),
]


def _arrivals(n: int, seed: int = 3):
    workload = Workload(
        arrival_s=np.linspace(0.0, 1.0, n),
        prompt_tokens=np.full(n, 320),
        output_tokens=np.full(n, 160),
    )
    return arrivals_from_workload(workload, seed=seed, max_output_tokens=160)


def _reference(workdir: Path, arrivals) -> list[list[int]]:
    engine = Engine(load_model(workdir / "target.pt"))
    return [
        engine.generate([list(a.prompt_token_ids)], SamplingParams(max_tokens=a.max_new_tokens))[0]
        for a in arrivals
    ]


@pytest.mark.parametrize("policy", ["S&R", "FC", "LUMEN"])
def test_one_failure_loses_nothing_and_outputs_match(tmp_path: Path, policy: str) -> None:
    arrivals = _arrivals(9)
    result = run_scenario(
        tmp_path,
        policy,
        arrivals,
        num_workers=3,
        failure=FailurePlan(not_before_s=0.3, min_requests=2, min_durable_tokens=16, give_up_s=30.0),
        request_timeout_s=90.0,
        modelled_full_load_s=1.0,
    )
    assert result.failed_worker_id >= 0 and len(result.interrupted_ids) >= 2
    assert [r.error for r in result.results] == [""] * len(arrivals)
    assert all(r.finished for r in result.results)
    reference = _reference(tmp_path, arrivals)
    assert [r.token_ids for r in result.results] == reference
    interrupted = len(result.interrupted_ids)
    assert result.restored + result.reprefilled == interrupted
    restores = [d for d in result.routes if d.action != RecoveryAction.REPREFILL]
    if policy == "S&R":
        assert result.restored == 0 and not restores
    else:  # every restore the router decided happened (a holder is never overloaded here)
        assert restores and result.restored == len(restores)
