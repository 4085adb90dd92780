import json

import numpy as np
import pytest

from lumen_core.cli import main
from lumen_core.policy.presets import preset
from lumen_core.sim.cluster import ClusterSim
from lumen_core.sim.experiments import (
    FAILURE_FREE_TTFT_S,
    RATE_PER_WORKER,
    Options,
    calibrate_rate,
    failed_workers,
    proto_config,
    run_experiment,
)
from lumen_core.sim.workload import load_trace


def value(outcome, policy, metric, setting=None, workers=None):
    matches = [
        r.value
        for r in outcome.rows
        if r.policy == policy
        and r.metric == metric
        and (setting is None or r.setting == setting)
        and (workers is None or r.workers == workers)
    ]
    assert len(matches) == 1, (policy, metric, setting, workers, matches)
    return matches[0]


def test_the_calibrated_rate_gives_the_papers_failure_free_ttft():
    trace = load_trace().scaled_to_rate(RATE_PER_WORKER * 4)
    result = ClusterSim(proto_config(4), trace, preset("S&R")).run()
    assert float(np.nanmean(result.records.ttft_s)) == pytest.approx(FAILURE_FREE_TTFT_S, rel=0.05)


@pytest.mark.slow
def test_calibration_finds_the_rate_again():
    rate = calibrate_rate(proto_config(4), load_trace(), bounds=(5.0, 9.0), iterations=10)
    assert rate == pytest.approx(RATE_PER_WORKER, abs=0.05)


def test_proto4_lumen_no_worse_than_fc_and_sr(tmp_path):
    out = tmp_path / "proto4.json"
    assert main(["sim", "--experiment", "proto4", "--json", str(out), "--no-progress"]) == 0
    rows = json.loads(out.read_text())

    def value(policy, metric, setting):
        (match,) = [
            r["value"] for r in rows if (r["policy"], r["metric"], r["setting"]) == (policy, metric, setting)
        ]
        return match

    assert {r["policy"] for r in rows} == {"failure-free", "S&R", "FC", "LUMEN"}
    assert value("S&R", "mean_ttft_s", "failure at 150 s") is not None
    for setting in ("failure at 150 s", "failure at 300 s"):
        for metric in ("mean_ttft_s", "recovery_s"):
            lumen = value("LUMEN", metric, setting)
            assert lumen <= value("FC", metric, setting), (setting, metric)
            assert lumen <= value("S&R", metric, setting), (setting, metric)
        # a failure costs S&R something
        assert value("S&R", "mean_ttft_s", setting) > value("failure-free", "window_ttft_s", setting)
    assert value("FC", "restored_fraction", "failure at 150 s") > 0.3
    assert value("S&R", "restored_fraction", "failure at 150 s") == 0.0
    assert [r["paper_value"] for r in rows if (r["policy"], r["metric"]) == ("S&R", "mean_ttft_s")] == [
        4.69,
        4.69,
    ]


def test_table1_sr_degradation_is_roughly_constant_from_4_to_64_workers():
    outcome = run_experiment("table1", Options())
    degradation = [
        value(outcome, "S&R", "noninterrupted_ttft_s", workers=n)
        / value(outcome, "failure-free", "window_ttft_s", workers=n)
        for n in (4, 8, 16, 32, 64)
    ]
    assert min(degradation) > 2.0  # the failure hurts at every size
    assert max(degradation) / min(degradation) < 1.5
    replay = [value(outcome, "S&R", "replay_ttft_s", workers=n) for n in (4, 8, 16, 32, 64)]
    assert max(replay) / min(replay) < 1.5


def test_failed_workers_is_a_seeded_quarter():
    assert len(failed_workers(64, 0.25, 0)) == 16
    assert failed_workers(64, 0.25, 0) == failed_workers(64, 0.25, 0)
    assert failed_workers(64, 0.25, 0) != failed_workers(64, 0.25, 1)
    assert len(failed_workers(4, 0.25, 0)) == 1


def test_cli_writes_json_and_event_log(tmp_path, capsys):
    out = tmp_path / "rows.json"
    log = tmp_path / "events.jsonl"
    code = main(
        [
            "sim",
            "--experiment",
            "scale",
            "--workers",
            "8",
            "--policy",
            "FC",
            "--json",
            str(out),
            "--event-log",
            str(log),
            "--no-progress",
        ]
    )
    assert code == 0
    rows = json.loads(out.read_text())
    assert {"experiment", "policy", "workers", "metric", "value", "paper_value"} <= set(rows[0])
    assert {r["policy"] for r in rows} == {"failure-free", "FC"}
    assert any(r["metric"] == "sim_requests_per_wall_s" and r["value"] > 0 for r in rows)
    assert log.stat().st_size > 0
    printed = capsys.readouterr().out
    assert "== scale ==" in printed and "recovery_s" in printed


def test_cli_plots(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    assert (
        main(["sim", "--experiment", "long_context", "--plot", str(tmp_path / "lc.png"), "--no-progress"])
        == 0
    )
    assert (tmp_path / "lc.png").stat().st_size > 10_000
    assert (
        main(
            [
                "sim",
                "--experiment",
                "scale",
                "--workers",
                "4",
                "--plot",
                str(tmp_path / "s.png"),
                "--no-progress",
            ]
        )
        == 0
    )
    assert "scale has no figure" in capsys.readouterr().out


def test_plot_series_of_proto_ablation_and_sensitivity(tmp_path):
    pytest.importorskip("matplotlib")
    from lumen_core.sim.experiments import Outcome
    from lumen_core.sim.plots import plot_outcome

    t = [0.0, 1.0, 2.0]
    outcome = Outcome(
        "proto4",
        series={
            "rolling": {
                "t_s": t,
                "failure_s": 150.0,
                "S&R": {"ttft_s": [1.0, 2.0, 1.0], "tpot_s": [0.1, 0.2, 0.1]},
            },
            "bars": {"FC": {"mean_ttft_s": 1.0, "mean_tpot_s": 0.1, "recovery_s": 20.0}},
            "curves": {
                "theta_multiple": {"x": [1.0, 2.0], "mean_ttft_s": [1.0, 0.9], "recovery_s": [20.0, 18.0]}
            },
        },
    )
    paths = plot_outcome(outcome, tmp_path / "all.png")
    assert len(paths) == 3 and len(set(paths)) == 3 and all(p.stat().st_size > 5_000 for p in paths)


def test_cli_rejects_bad_arguments():
    with pytest.raises(SystemExit):
        main(["sim", "--experiment", "nope"])
    with pytest.raises(SystemExit):
        main(["sim", "--experiment", "scale", "--workers", "1"])
    with pytest.raises(SystemExit):
        main(["sim", "--experiment", "scale", "--rate", "0"])
    with pytest.raises(ValueError, match="`experiment` must be one of"):
        run_experiment("nope", Options())


def test_long_context_coverage_grows_with_the_holder_budget():
    outcome = run_experiment("long_context", Options())
    for prompt in (32768, 65536):
        small = value(outcome, "LUMEN", "checkpoint_coverage", f"prompt={prompt}; budget=16GB")
        large = value(outcome, "LUMEN", "checkpoint_coverage", f"prompt={prompt}; budget=256GB")
        assert small < large
    # a 128K-token Qwen3-32B checkpoint (34 GB) never fits a 16 GB budget
    assert value(outcome, "LUMEN", "checkpoint_coverage", "prompt=131072; budget=16GB") == 0.0


def test_rack_failure_domain_aware_placement_restores_more():
    outcome = run_experiment("rack", Options())
    aware = value(outcome, "LUMEN", "restored_fraction")
    assert aware > value(outcome, "LUMEN (domain-blind)", "restored_fraction")
    assert value(outcome, "LUMEN", "mean_ttft_s") <= value(outcome, "LUMEN (domain-blind)", "mean_ttft_s")
