"""bench/policy_latency.py runs end to end at a tiny size and writes the documented rows."""

from __future__ import annotations

import importlib.util
import json
import pathlib

BENCH = pathlib.Path(__file__).resolve().parents[2] / "bench" / "policy_latency.py"


def test_bench_rows(tmp_path):
    spec = importlib.util.spec_from_file_location("policy_latency", BENCH)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    out = tmp_path / "rows.json"
    assert (
        bench.main(["--workers", "4", "--count", "60", "--requests-per-worker", "2", "--json", str(out)]) == 0
    )
    rows = json.loads(out.read_text())
    ops = {row["op"] for row in rows}
    assert ops == {"lifecycle", "lifecycle_fc", "place", "place_fc", "place_naive", "route", "route_sr"}
    for row in rows:
        assert {"workers", "op", "p50_us", "p99_us", "per_s"} <= row.keys()
        assert row["workers"] == 4 and 0 < row["p50_us"] <= row["p99_us"] and row["per_s"] > 0
    route = next(row for row in rows if row["op"] == "route")
    assert route["decisions_per_route"] == 2.0 and route["ratio"] > 0
