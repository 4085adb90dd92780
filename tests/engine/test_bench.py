"""Smoke run of bench/engine_step.py: it checks correctness first and writes its JSON rows."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest
import torch

BENCH = Path(__file__).resolve().parents[2] / "bench" / "engine_step.py"


def test_quick_bench_writes_its_rows(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    spec = importlib.util.spec_from_file_location("engine_step", BENCH)
    assert spec is not None and spec.loader is not None
    bench = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "engine_step", bench)  # dataclasses look it up
    spec.loader.exec_module(bench)
    threads = torch.get_num_threads()
    out = tmp_path / "engine.json"
    assert bench.main(["--quick", "--json", str(out)]) == 0
    torch.set_num_threads(threads)
    result = json.loads(out.read_text())
    assert [r["batch"] for r in result["decode"]] == [1, 16]
    assert all(r["engine_tokens_per_s"] > 0 and r["ratio_vs_baseline"] > 0 for r in result["decode"])
    assert [(r["batch"], r["k"]) for r in result["speculative"]] == [
        (1, 2),
        (1, 4),
        (16, 2),
        (16, 4),
    ]
    for r in result["speculative"]:
        assert 1.0 <= r["tokens_per_verify_step"] <= r["k"] + 1
        assert 0.0 <= r["acceptance_rate"] <= r["chain_acceptance_rate"] <= 1.0
    assert len(result["acceptance"]) == 4
