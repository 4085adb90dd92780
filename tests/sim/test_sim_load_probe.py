"""bench/sim_load_probe.py: at the faithful live run's load (40/s) the failure queues the
survivors, so the whole run's mean TTFT separates LUMEN from S&R and FC."""

from __future__ import annotations

import importlib.util
import json
import pathlib

BENCH = pathlib.Path(__file__).resolve().parents[2] / "bench" / "sim_load_probe.py"


def test_at_40_per_s_the_failure_separates_the_policies(tmp_path: pathlib.Path) -> None:
    spec = importlib.util.spec_from_file_location("sim_load_probe", BENCH)
    assert spec is not None and spec.loader is not None
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    out = tmp_path / "rows.json"
    assert bench.main(["--load", "40", "--json", str(out)]) == 0
    rows = {row["policy"]: row for row in json.loads(out.read_text())}
    assert set(rows) == {"failure-free", "S&R", "FC", "LUMEN"}
    ttft = {policy: row["mean_ttft_s"] for policy, row in rows.items()}
    assert ttft["failure-free"] < ttft["LUMEN"] < 0.5 * min(ttft["S&R"], ttft["FC"])
    assert all(rows[p]["interrupted"] >= 30 and rows[p]["rate_per_s"] == 40.0 for p in ("S&R", "FC", "LUMEN"))
