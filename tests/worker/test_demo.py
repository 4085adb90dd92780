"""`lumen demo`: the table and figure from rows (fast), and a short full run (slow)."""

import json
import math
from pathlib import Path

import numpy as np
import pytest

from lumen_core import _native
from lumen_core.cli import main
from lumen_core.worker.demo import (
    COLUMNS,
    SIM_COLUMNS,
    faithful,
    plot_timeline,
    print_comparison,
    print_table,
)


def test_table_has_every_column_and_shows_undefined_as_dash(capsys) -> None:
    row = {c: 0 for c in COLUMNS} | {"policy": "LUMEN", "recovery_s": math.nan, "acceptance": 0.5}
    print_table([row])
    header, line = capsys.readouterr().out.splitlines()
    assert header.split() == list(COLUMNS)
    assert line.split()[COLUMNS.index("recovery_s")] == "-"
    assert line.split()[COLUMNS.index("acceptance")] == "0.500"


def test_comparison_prints_live_simulated_and_their_ratio_per_policy(capsys) -> None:
    row = {c: 1.0 for c in (*COLUMNS, *SIM_COLUMNS)} | {
        "policy": "FC",
        "mean_ttft_s": 0.3,
        "sim_mean_ttft_s": 0.2,
    }
    row |= {"recovery_s": math.nan, "restored": 31, "sim_restored": 30, "sim_recovery_s": 2.0}
    print_comparison([row])
    lines = {line.split()[1]: line.split()[2:] for line in capsys.readouterr().out.splitlines()[1:]}
    assert lines["mean_ttft_s"] == ["0.300", "0.200", "1.500"]
    assert lines["recovery_s"] == ["-", "2.000", "-"]
    assert lines["restored"] == ["31", "30", "1.033"]
    assert set(lines) == {"mean_ttft_s", "mean_tpot_s", "replay_ttft_s", "recovery_s", "interrupted",
                          "restored", "accepted_drafts"}  # fmt: skip


@pytest.mark.parametrize(
    ("fractions", "expected"), [((0.0, 0.05), True), ((0.01, 0.06), False), ((0.0, math.nan), False)]
)
def test_a_run_is_faithful_only_when_no_policy_overran_more_than_5_percent(fractions, expected) -> None:
    assert faithful([{"paced_overrun_fraction": f} for f in fractions]) is expected


def test_timeline_png(tmp_path: Path) -> None:
    starts = np.arange(0.0, 10.0, 1.0)
    means = (np.linspace(0.1, 0.2, 10), np.full(10, 0.01), np.ones(10))
    path = tmp_path / "t.png"
    plot_timeline({"failure-free": (starts, means, math.nan), "LUMEN": (starts, means, 4.0)}, path)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.slow
@pytest.mark.ucx
@pytest.mark.skipif(not _native.HAS_UCX, reason="lumen_core._C_ucx is not built (LUMEN_UCX=ON)")
@pytest.mark.timeout(600)
def test_short_demo_end_to_end(tmp_path: Path) -> None:
    rows_path = tmp_path / "rows.json"
    status = main(
        ["demo", "--workers", "3", "--duration", "10", "--rate", "6", "--time-scale", "2", "--compare-sim",
         "--json", str(rows_path), "--plot", str(tmp_path / "t.png"), "--workdir", str(tmp_path / "work")]
    )  # fmt: skip
    rows = json.loads(rows_path.read_text())
    assert status == 0
    assert [r["policy"] for r in rows] == ["S&R", "FC", "LUMEN"]
    assert all(set(r) == {*COLUMNS, *SIM_COLUMNS, "repeat"} and r["repeat"] == 0 for r in rows)
    assert all(r["sim_interrupted"] >= 1 and r["interrupted"] >= 1 for r in rows)
    assert all(0 <= r["paced_overrun_fraction"] <= 1 for r in rows)
    assert all(r["lost"] == 0 and r["identical"] == r["total"] for r in rows)
    # Through the front door with the openai client: every stream whole, every token once.
    assert all(r["broken_streams"] == r["duplicate_tokens"] == r["missing_tokens"] == 0 for r in rows)
    assert (tmp_path / "t.png").is_file()
