import numpy as np
import pytest

from lumen_core.sim.workload import Workload, load_trace, poisson_workload


def test_trace_matches_its_readme():
    trace = load_trace()
    assert len(trace) == 19_366
    assert trace.prompt_tokens.mean() == pytest.approx(1154.7, abs=0.05)
    assert trace.output_tokens.mean() == pytest.approx(211.1, abs=0.05)
    assert trace.arrival_s[0] == 0.0 and trace.arrival_s[-1] == pytest.approx(3502, abs=1)
    assert trace.rate_per_s == pytest.approx(5.53, abs=0.01)


def test_scaling_thinning_and_slicing():
    trace = load_trace()
    fast = trace.scaled_to_rate(50.0)
    assert fast.rate_per_s == pytest.approx(50.0)
    assert np.array_equal(fast.prompt_tokens, trace.prompt_tokens)
    thin = trace.thinned(4)
    assert len(thin) == (len(trace) + 3) // 4 and thin.prompt_tokens[1] == trace.prompt_tokens[4]
    assert len(fast.until(10.0)) == int(np.sum(fast.arrival_s < 10.0))
    assert len(trace.head(5)) == 5


def test_other_csv(tmp_path):
    path = tmp_path / "t.csv"
    path.write_text(
        "TIMESTAMP,ContextTokens,GeneratedTokens\n"
        "2024-01-01 23:59:59.5000000,10,2\n"
        "2024-01-02 00:00:00.2500000,20,0\n"
    )
    trace = load_trace(path)
    assert trace.arrival_s.tolist() == [0.0, 0.75]  # across midnight
    assert trace.output_tokens.tolist() == [2, 1]  # at least one output token
    bad = tmp_path / "bad.csv"
    bad.write_text("time,prompt\n1,2\n")
    with pytest.raises(ValueError, match="`path` must be a CSV with columns"):
        load_trace(bad)
    empty = tmp_path / "empty.csv"
    empty.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n")
    with pytest.raises(ValueError, match="`path` must hold at least one request"):
        load_trace(empty)


def test_poisson_is_seeded_and_bounded():
    a = poisson_workload(5.0, 2000, (100, 200), (1, 50), seed=3)
    b = poisson_workload(5.0, 2000, (100, 200), (1, 50), seed=3)
    c = poisson_workload(5.0, 2000, (100, 200), (1, 50), seed=4)
    assert np.array_equal(a.arrival_s, b.arrival_s) and np.array_equal(a.prompt_tokens, b.prompt_tokens)
    assert not np.array_equal(a.arrival_s, c.arrival_s)
    assert a.prompt_tokens.min() >= 100 and a.prompt_tokens.max() <= 200
    assert a.output_tokens.min() >= 1 and a.output_tokens.max() <= 50
    assert a.rate_per_s == pytest.approx(5.0, rel=0.1)


def test_validation():
    with pytest.raises(ValueError, match="`rate_per_s` must be > 0"):
        poisson_workload(0.0, 10, (1, 2), (1, 2), 0)
    with pytest.raises(ValueError, match="`num_requests` must be >= 1"):
        poisson_workload(1.0, 0, (1, 2), (1, 2), 0)
    with pytest.raises(ValueError, match="`prompt_tokens` must be a range"):
        poisson_workload(1.0, 10, (5, 2), (1, 2), 0)
    with pytest.raises(ValueError, match="`rate_per_s` must be > 0"):
        load_trace().scaled_to_rate(-1.0)
    with pytest.raises(ValueError, match="`step` must be >= 1"):
        load_trace().thinned(0)
    one = np.array([1])
    with pytest.raises(ValueError, match="`prompt_tokens` and `output_tokens` must have 2 entries"):
        Workload(np.array([0.0, 1.0]), one, one)
    with pytest.raises(ValueError, match="`arrival_s` must be sorted"):
        Workload(np.array([1.0, 0.0]), np.array([1, 1]), np.array([1, 1]))
    with pytest.raises(ValueError, match="must be >= 1"):
        Workload(np.array([0.0]), np.array([0]), one)


def test_missing_trace_is_reported(monkeypatch, tmp_path):
    from lumen_core.sim import workload

    monkeypatch.setattr(workload, "TRACE_NAME", "absent.csv")
    monkeypatch.setenv("LUMEN_TRACE_DIR", str(tmp_path))
    with pytest.raises(FileNotFoundError, match="set LUMEN_TRACE_DIR or pass --trace"):
        workload.default_trace_path()
    (tmp_path / "absent.csv").write_text(
        "TIMESTAMP,ContextTokens,GeneratedTokens\n2024-01-01 00:00:00.0,5,5\n"
    )
    assert workload.default_trace_path() == tmp_path / "absent.csv"
