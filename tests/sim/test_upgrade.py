"""The simulator's rolling upgrade (issue 22): each worker drained and restarted in turn by
graceful wait, abort-and-re-prefill or LUMEN's move, through the driver's drain and move."""

import numpy as np
import pytest

from lumen_core.eventlog import EventLog, replay_event_log
from lumen_core.policy.presets import preset
from lumen_core.sim.cluster import ClusterConfig, ClusterSim, RollingUpgrade
from lumen_core.sim.experiments import upgrade_metrics
from lumen_core.sim.workload import poisson_workload

CONFIG = ClusterConfig(num_workers=4, model="Qwen3-14B", gpu="H100", tp=1)
WORKLOAD = poisson_workload(12.0, 1200, (200, 1200), (50, 300), seed=3)  # 100 s: outlasts every upgrade


def run(strategy, **kwargs):
    sim = ClusterSim(CONFIG, WORKLOAD, preset("LUMEN"), upgrade=RollingUpgrade(2.0, strategy), **kwargs)
    result = sim.run()
    return result, upgrade_metrics(result, 2.0, 60.0)


def test_the_three_strategies_free_workers_and_recompute_as_they_should():
    graceful, g = run("graceful")
    abort, a = run("abort")
    move, m = run("move")
    assert g["workers_upgraded"] == a["workers_upgraded"] == m["workers_upgraded"] == 4
    assert g["free_s"] > 0 and g["moved"] == 0 and g["reprefilled_tokens"] == 0  # it waits
    assert a["free_s"] == 0 < m["free_s"] < 0.5 < g["free_s"]  # at once; after the flush; waiting
    assert a["moved"] > 0 and m["moved"] > 0
    assert abort.actions["restore"] == 0 and move.actions["restore"] > 0
    # a move recomputes only the last token of each request (its KV was not computed yet)
    assert m["reprefilled_tokens"] <= m["moved"] < a["reprefilled_tokens"]
    assert a["upgrade_s"] < g["upgrade_s"] and m["upgrade_s"] < g["upgrade_s"]
    for result in (graceful, abort, move):  # every request finished exactly once (checked by run)
        assert (result.finish_counts == 1).all() and not np.isnan(result.records.ttft_s).any()


def test_a_moving_upgrade_replays_from_its_event_log(tmp_path):
    path = tmp_path / "upgrade.jsonl"
    log = EventLog.open(path)
    sim = ClusterSim(CONFIG, WORKLOAD, preset("LUMEN"), upgrade=RollingUpgrade(2.0, "move"), event_log=log)
    sim.run()
    log.close()
    assert replay_event_log(path, preset("LUMEN"), sim.driver.monitor.config) > 0


def test_upgrade_validation():
    with pytest.raises(
        ValueError, match="`strategy` must be one of \\('graceful', 'abort', 'move'\\), got 'x'"
    ):
        RollingUpgrade(1.0, "x")
    with pytest.raises(ValueError, match="`start_s` must be >= 0, got -1"):
        RollingUpgrade(-1, "move")
    with pytest.raises(IndexError, match="upgrade worker ids \\[9\\] out of range \\[0, 4\\)"):
        ClusterSim(CONFIG, WORKLOAD, preset("LUMEN"), upgrade=RollingUpgrade(1.0, "move", (9,)))
    with pytest.raises(TypeError, match="`upgrade` must be a RollingUpgrade, got str"):
        ClusterSim(CONFIG, WORKLOAD, preset("LUMEN"), upgrade="move")


@pytest.mark.slow  # the trace twice over, three times (~15 s alone, a minute on a loaded machine)
def test_lumen_sim_rolling_upgrade_writes_the_three_strategies(tmp_path):
    import json

    from lumen_core.cli import main

    out = tmp_path / "rows.json"
    assert (
        main(
            ["sim", "--experiment", "rolling_upgrade", "--workers", "4", "--json", str(out), "--no-progress"]
        )
        == 0
    )
    rows = {(r["policy"], r["metric"]): r["value"] for r in json.loads(out.read_text())}
    policies = ("graceful wait", "abort + re-prefill", "LUMEN move")
    assert {p for p, _ in rows} == set(policies)
    for metric in ("free_s", "mean_ttft_s", "mean_tpot_s", "reprefilled_tokens"):
        assert all((p, metric) in rows for p in policies)
    assert rows[("graceful wait", "free_s")] > rows[("LUMEN move", "free_s")] > 0
    assert rows[("abort + re-prefill", "reprefilled_tokens")] > rows[("LUMEN move", "reprefilled_tokens")]
    assert rows[("graceful wait", "workers_upgraded")] == 4
