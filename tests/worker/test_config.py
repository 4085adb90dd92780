"""Argument checks of the worker's configuration and `lumen worker`/`lumen demo`."""

from pathlib import Path

import pytest

from lumen_core.cli import main
from lumen_core.worker.cluster import LocalCluster
from lumen_core.worker.process import WorkerConfig
from lumen_core.worker.scenario import Arrival, kv_blocks_for


@pytest.fixture
def model_file(tmp_path: Path) -> str:
    path = tmp_path / "model.pt"
    path.write_bytes(b"x")
    return str(path)


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"worker_id": -1}, "worker_id must be an int >= 0"),
        ({"worker_id": True}, "worker_id must be an int >= 0"),
        ({"state": "failed"}, "state must be 'serving' or 'recovering'"),
        ({"model_path": "/nonexistent/model.pt"}, "model_path must be a file"),
        ({"draft_path": "/nonexistent/draft.pt"}, "draft_path must be a file"),
        ({"modelled_full_load_s": -1.0}, "modelled_full_load_s must be a finite number >= 0"),
        ({"modelled_draft_load_s": float("inf")}, "modelled_draft_load_s must be a finite number >= 0"),
        ({"budget_bytes": -1}, "budget_bytes must be an int >= 0"),
        ({"reserve_bytes": 2 << 30}, r"reserve_bytes must be an int in \[0, budget_bytes\], got 2147483648"),
        ({"time_scale": 0.0}, "time_scale must be a finite number > 0"),
        ({"pace": "qwen3-32b/b200x2"}, "`pace` must be MODEL/GPUxTP"),
    ],
)
def test_worker_config_refuses(model_file: str, changes: dict, message: str) -> None:
    arguments = {"worker_id": 0, "gateway": "127.0.0.1:1", "model_path": model_file, **changes}
    with pytest.raises(ValueError, match=message):
        WorkerConfig(**arguments)


def test_lumen_worker_refuses_a_missing_secret_file(tmp_path: Path, model_file: str, capsys) -> None:
    status = main(
        ["worker", "--worker-id", "0", "--gateway", "127.0.0.1:1", "--secret-file",
         str(tmp_path / "missing"), "--model", model_file]
    )  # fmt: skip
    assert status == 2
    assert "lumen worker:" in capsys.readouterr().err


def test_lumen_worker_refuses_an_unknown_pace(tmp_path: Path, model_file: str, capsys) -> None:
    status = main(
        ["worker", "--worker-id", "0", "--gateway", "127.0.0.1:1", "--secret-file",
         str(tmp_path / "missing"), "--model", model_file, "--pace", "gpt-5/h100"]
    )  # fmt: skip
    assert status == 2
    assert "`pace` must be MODEL/GPUxTP" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("arguments", "message"),
    [(["--workers", "2"], "--workers must be >= 3"), (["--repeats", "0"], "--repeats must be >= 1")],
)
def test_lumen_demo_refuses(arguments: list[str], message: str, capsys) -> None:
    assert main(["demo", *arguments]) == 2
    assert message in capsys.readouterr().err


def test_local_cluster_needs_two_workers(tmp_path: Path) -> None:
    from lumen_core.worker.cluster import LocalCluster

    with pytest.raises(ValueError, match="`num_workers` must be >= 2, got 1"):
        LocalCluster(tmp_path, policy="LUMEN", num_workers=1)


def test_a_scenarios_workers_hold_every_running_request_at_its_longest(tmp_path: Path) -> None:
    # The --full run's longest request: a 192-token prompt and 384 new tokens.
    arrivals = [Arrival(0.0, (1,) * 192, 384), Arrival(0.1, (1,) * 4, 24)]
    pages = kv_blocks_for(arrivals)
    assert pages * WorkerConfig.block_size >= WorkerConfig.max_num_seqs * (192 + 384) == 36_864
    assert kv_blocks_for([Arrival(0.0, (1,), 1)]) == WorkerConfig.num_blocks  # never below the default
    cluster = LocalCluster(tmp_path, policy="S&R", num_workers=2, num_blocks=pages)
    assert cluster.worker_args[-2:] == ["--num-blocks", str(pages)]
    with pytest.raises(ValueError, match="`num_blocks` must be >= 1, got 0"):
        LocalCluster(tmp_path, policy="S&R", num_workers=2, num_blocks=0)
