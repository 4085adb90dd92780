"""A planned drain on loopback: 2 reference-engine worker processes behind a gateway, one
drained while it runs >= 16 requests; every request completes with the undisturbed output,
each moved request recomputes at most 16 tokens (counted by the workers), and the drain frees the
worker sooner than waiting for its requests would."""

from pathlib import Path

import pytest

from lumen_core import _native
from lumen_core.worker.drain import run_drain

pytestmark = [
    pytest.mark.ucx,
    pytest.mark.skipif(not _native.HAS_UCX, reason="lumen_core._C_ucx is not built (LUMEN_UCX=ON)"),
    pytest.mark.timeout(240),
]


def test_a_drain_moves_every_request_with_its_checkpoint(tmp_path: Path) -> None:
    result = run_drain(tmp_path, num_requests=32, min_running=16, min_tokens=8)
    assert [r.error for r in result.results] == [""] * 32
    assert result.identical == result.total == 32
    assert result.moved >= 16 and result.num_reprefilled_at_deadline == 0
    assert 0 < result.reprefilled_tokens_per_moved_request <= 16
    resumed = {s["worker_id"]: s["resumed"] for s in result.worker_stats}
    restored = sum(int(s["restored"]) for s in result.worker_stats)
    assert resumed[0] == 0 and restored == result.moved  # every move restored its checkpoint
    assert result.drain_s < result.graceful_wait_s
    assert result.retired and result.num_failures == 0  # it reported its exit: retired, not failed
    metrics = {row["metric"] for row in result.rows()}
    assert {"drain_s", "graceful_wait_s", "reprefilled_tokens_per_moved_request", "moved"} <= metrics
