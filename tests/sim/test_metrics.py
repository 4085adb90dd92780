import math

import numpy as np
import pytest

from lumen_core.metrics import (
    RequestRecords,
    acceptance_rate,
    checkpoint_coverage,
    count_token_errors,
    holder_balance_ratio,
    nan_mean,
    recovery_time_s,
    rolling_means,
    window_means,
)

NAN = math.nan


def test_nan_mean_skips_nans_and_is_nan_when_nothing_is_left():
    assert nan_mean(np.array([1.0, NAN, 3.0])) == 2.0
    assert math.isnan(nan_mean(np.array([NAN, NAN])))
    assert math.isnan(nan_mean(np.array([])))


def records(arrival, first, finish, n_out, interrupted=None, replay=None):
    n = len(arrival)
    return RequestRecords(
        np.array(arrival, float),
        np.array(first, float),
        np.array(finish, float),
        np.array(n_out),
        np.array(interrupted if interrupted is not None else [False] * n),
        np.array(replay if replay is not None else [NAN] * n, float),
    )


def test_ttft_tpot_by_hand():
    r = records([0.0, 1.0, 2.0], [0.5, 3.0, 2.2], [2.5, 3.0, 4.2], [5, 1, 3])
    assert r.ttft_s.tolist() == pytest.approx([0.5, 2.0, 0.2])
    tpot = r.tpot_s
    assert tpot[0] == pytest.approx(0.5) and math.isnan(tpot[1]) and tpot[2] == pytest.approx(1.0)


def test_window_counts_arrivals_in_window_plus_interrupted_with_replay():
    # failure at 10: request 0 arrived before and was interrupted (replay token at 14),
    # request 1 arrived before and was not (left out), requests 2 and 3 arrive in [10, 20],
    # request 4 after the window.
    r = records(
        [5.0, 6.0, 11.0, 15.0, 25.0],
        [5.5, 6.5, 12.0, 18.0, 25.5],
        [20.0, 7.5, 13.0, 19.0, 26.0],
        [11, 2, 2, 3, 2],
        interrupted=[True, False, False, False, False],
        replay=[14.0, NAN, NAN, NAN, NAN],
    )
    m = window_means(r, failure_s=10.0, eval_s=10.0)
    assert m["replay_ttft_s"] == pytest.approx(4.0)
    assert m["noninterrupted_ttft_s"] == pytest.approx((1.0 + 3.0) / 2)
    assert m["mean_ttft_s"] == pytest.approx((1.0 + 3.0 + 4.0) / 3)
    # TPOT: request 0 (20 - 5.5) / 10, request 2 1.0, request 3 0.5
    assert m["mean_tpot_s"] == pytest.approx((1.45 + 1.0 + 0.5) / 3)
    assert m["num_requests"] == 3 and m["num_interrupted"] == 1


def test_rolling_means_and_recovery():
    arrival = np.arange(0.0, 100.0, 0.5)
    base_ttft = np.full_like(arrival, 1.0)
    slow = np.where((arrival >= 50.0) & (arrival < 62.0), 3.0, 1.0)  # degraded for 12 s
    n_out = np.full(len(arrival), 11)
    base = records(arrival, arrival + base_ttft, arrival + base_ttft + 1.0, n_out)
    hit = records(arrival, arrival + slow, arrival + slow + 1.0, n_out)
    ttft, tpot, count = rolling_means(hit, np.array([40.0, 50.0, 60.0]), 5.0)
    assert count.tolist() == [10, 10, 10]
    assert ttft.tolist() == pytest.approx([1.0, 3.0, 1.8]) and tpot.tolist() == pytest.approx([0.1] * 3)
    assert recovery_time_s(hit, base, failure_s=50.0, window_s=5.0, horizon_s=40.0, step_s=1.0) == 12.0
    assert recovery_time_s(base, base, failure_s=50.0, window_s=5.0, horizon_s=40.0) == 0.0
    never = records(arrival, arrival + np.where(arrival >= 50.0, 3.0, 1.0), arrival + 5.0, n_out)
    assert math.isnan(recovery_time_s(never, base, failure_s=50.0, window_s=5.0, horizon_s=20.0))
    # Windows past the last arrival do not count as recovered.
    assert math.isnan(recovery_time_s(never, base, failure_s=50.0, window_s=5.0, horizon_s=200.0))
    assert math.isnan(recovery_time_s(hit, base, failure_s=50.0, window_s=16.0, horizon_s=40.0))
    # Faster than the failure-free run (a survivor LUMEN's drafts speed up) is recovered.
    fast = records(
        arrival, arrival + base_ttft, arrival + base_ttft + np.where(arrival >= 50.0, 0.5, 1.0), n_out
    )
    assert recovery_time_s(fast, base, failure_s=50.0, window_s=5.0, horizon_s=40.0) == 0.0


def test_coverage_balance_acceptance():
    assert checkpoint_coverage(
        np.array([100, 200, 300]), np.array([95, 150, 300]), slack_tokens=8
    ) == pytest.approx(2 / 3)
    assert math.isnan(checkpoint_coverage(np.array([]), np.array([])))
    assert holder_balance_ratio(np.array([2.0, 4.0])) == 2.0
    assert holder_balance_ratio(np.array([0.0, 0.0])) == 1.0
    assert holder_balance_ratio(np.array([0.0, 3.0])) == math.inf
    assert math.isnan(holder_balance_ratio(np.array([])))
    assert acceptance_rate(3, 4) == 0.75 and math.isnan(acceptance_rate(0, 0))


def test_validation():
    with pytest.raises(ValueError, match="`first_token_s` must have 2 entries"):
        RequestRecords(np.zeros(2), np.zeros(1), np.zeros(2), np.ones(2), np.zeros(2, bool), np.zeros(2))
    r = records([0.0], [1.0], [2.0], [2])
    with pytest.raises(ValueError, match="`eval_s` must be > 0"):
        window_means(r, 0.0, 0.0)
    with pytest.raises(ValueError, match="`window_s` must be > 0"):
        rolling_means(r, np.array([0.0]), 0.0)
    with pytest.raises(ValueError, match="`tolerance` must be > 0"):
        recovery_time_s(r, r, 0.0, 1.0, 10.0, tolerance=0.0)
    with pytest.raises(ValueError, match="`num_windows` must be >= 1"):
        recovery_time_s(r, r, 0.0, 1.0, 10.0, num_windows=0)
    with pytest.raises(ValueError, match="`horizon_s` must be > 0"):
        recovery_time_s(r, r, 0.0, 1.0, 0.0)
    with pytest.raises(ValueError, match="`step_s` must be > 0"):
        recovery_time_s(r, r, 0.0, 1.0, 10.0, step_s=0.0)
    with pytest.raises(ValueError, match="`durable_tokens` must have the shape"):
        checkpoint_coverage(np.array([1, 2]), np.array([1]))
    with pytest.raises(ValueError, match="`slack_tokens` must be >= 0"):
        checkpoint_coverage(np.array([1]), np.array([1]), slack_tokens=-1)
    with pytest.raises(ValueError, match="`accepted_tokens` and `proposed_tokens` must be >= 0"):
        acceptance_rate(-1, 2)
    with pytest.raises(ValueError, match="`accepted_tokens` must be <= `proposed_tokens`"):
        acceptance_rate(3, 2)


@pytest.mark.parametrize(
    ("received", "errors"),
    [
        ([1, 2, 3, 4, 5], (0, 0, 0)),
        ([1, 2, 3, 3, 4, 5], (1, 0, 0)),  # a token sent twice across the resume point
        ([1, 2, 4, 5], (0, 1, 0)),  # one lost
        ([1, 2, 9, 4, 5], (0, 0, 1)),  # one changed in place
        ([1, 2], (0, 3, 0)),  # a stream that broke off
        ([], (0, 5, 0)),
    ],
)
def test_token_errors_count_duplicate_missing_and_changed_tokens(received: list[int], errors: tuple) -> None:
    assert count_token_errors([1, 2, 3, 4, 5], received) == errors
