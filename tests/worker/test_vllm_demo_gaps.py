"""The vLLM demo's failover gaps: each interrupted stream's gap from the SIGKILL to its next
token at the client, split at the gateway's detection, the agent's receipt of the RESUME and
the server's first token (no vLLM needed: the timings are given)."""

from __future__ import annotations

import math

import pytest

from lumen_core.policy.events import RecoveryAction
from lumen_core.worker.vllm_demo import _Stream, failover_gaps, gap_summary


def _stream(request_id: int, chunks: list[tuple[float, int]]) -> _Stream:
    """A client's stream: (arrival time, tokens in the chunk) per chunk."""
    stream = _Stream(request_id=request_id)
    for time_s, count in chunks:
        stream.token_ids.extend([7] * count)
        stream.times_s.append(time_s)
        stream.ends.append(len(stream.token_ids))
    return stream


def _timing(request_id: int, position: int, received_s: float, first_token_s: float) -> dict:  # type: ignore[type-arg]
    return {"request_id": request_id, "epoch": 2, "position": position, "restoring": True,
            "received_s": received_s, "first_token_s": first_token_s}  # fmt: skip


def _lookup(request_id: int, **times_s: float) -> dict:  # type: ignore[type-arg]
    return {"request_id": str(request_id), "matched": 100, **times_s}


def test_a_gap_is_cut_at_detection_the_directive_and_the_servers_first_token() -> None:
    streams = [
        _stream(1, [(9.0, 8), (10.9, 3)]),  # its 8 tokens before the kill, then 3 in one chunk
        _stream(2, [(9.1, 9), (11.5, 1)]),
        _stream(3, [(9.2, 10), (10.0, 1)]),  # not moved: no gap
    ]
    actions = {1: RecoveryAction.RESTORE, 2: RecoveryAction.REPREFILL}
    resumes = [
        _timing(2, 9, received_s=10.3, first_token_s=11.2),
        _timing(1, 8, received_s=10.2, first_token_s=10.6),
        _timing(1, 0, received_s=5.0, first_token_s=5.5),  # its first RUN's era: before the kill
    ]
    lookups = [  # the restoring server's: an older lookup of request 1, then this RESUME's
        _lookup(1, arrived_s=4.0, added_s=4.05, asked_s=4.1, planned_s=4.2),
        _lookup(1, arrived_s=10.25, added_s=10.27, asked_s=10.3, planned_s=10.45),
    ]
    gaps = failover_gaps(10.0, 10.1, actions, resumes, streams, lookups)
    assert [(g.request_id, g.restored) for g in gaps] == [(1, True), (2, False)]
    restored, reprefilled = gaps
    parts = {"api": 0.05, "admit": 0.02, "queue": 0.03, "lookup": 0.15, "load": 0.15}
    assert restored.server_parts == pytest.approx(parts)
    assert reprefilled.server_parts is None
    assert restored.detection_s == pytest.approx(0.1) and restored.directive_s == pytest.approx(0.1)
    assert restored.server_s == pytest.approx(0.4) and restored.relay_s == pytest.approx(0.3)
    assert restored.total_s == pytest.approx(0.9)  # 10.9 - 10.0
    assert reprefilled.total_s == pytest.approx(1.5) and reprefilled.server_s == pytest.approx(0.9)
    assert actions == {1: RecoveryAction.RESTORE, 2: RecoveryAction.REPREFILL}  # not consumed
    summary = gap_summary(gaps)
    assert summary["restored"] == {"n": 1, "detection_ms": 100.0, "directive_ms": 100.0, "server_ms": 400.0,
                                   "relay_ms": 300.0, "total_ms": 900.0, "n_parts": 1, "server_api_ms": 50.0,
                                   "server_admit_ms": 20.0, "server_queue_ms": 30.0,
                                   "server_lookup_ms": 150.0, "server_load_ms": 150.0}  # fmt: skip
    assert summary["reprefilled"]["n"] == 1 and summary["reprefilled"]["total_ms"] == 1500.0


def test_a_stream_whose_next_token_never_came_has_no_gap() -> None:
    stream = _stream(1, [(9.0, 8)])
    assert math.isnan(stream.received_s(8)) and stream.received_s(7) == 9.0
    resumes = [_timing(1, 8, received_s=10.2, first_token_s=10.6)]
    assert failover_gaps(10.0, 10.1, {1: RecoveryAction.RESTORE}, resumes, [stream]) == []
    assert gap_summary([]) == {}
