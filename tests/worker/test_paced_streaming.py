"""Paced checkpoint streaming (issue 21): saves leave at the modelled link's rate, in order,
split mid-save when the link has carried part of one; dropped saves never reach the streamer."""

import pytest

from lumen_core.cost import CostModel
from lumen_core.engine.connector import SavedTokens
from lumen_core.pacing import PacedSaves, parse_pace


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def save(request_id: str, start: int, n: int) -> SavedTokens:
    return SavedTokens(
        request_id, start, tuple(range(start, start + n)), tuple(range(1000 + start, 1000 + start + n))
    )


@pytest.fixture
def cost() -> CostModel:
    return parse_pace("qwen3-32b/h100x2")


def test_saves_leave_at_the_modelled_link_rate_per_copy_in_order(cost: CostModel) -> None:
    clock = Clock()
    paced = PacedSaves(cost, time_scale=2.0, clock=clock)
    token_s = 2.0 * cost.kv_bytes_per_token / cost.stream_bytes_per_s
    assert paced.token_s == pytest.approx(token_s) and token_s > 0
    copies = {"a": 1, "b": 2}.__getitem__
    paced.push([save("a", 0, 10), save("b", 0, 4)], copies)
    assert paced.take() == []  # nothing has crossed the link yet
    clock.now += 6.5 * token_s
    out = paced.take()
    assert out == [save("a", 0, 6)]  # whole tokens only, the rest of the save still queued
    clock.now += 4 * token_s + 2 * 2 * token_s  # a's last 4, then 2 of b's tokens (2 copies each)
    assert paced.take() == [save("a", 6, 4), save("b", 0, 2)]
    assert paced.backlog_tokens == 2
    clock.now += 1000 * token_s
    assert paced.take() == [save("b", 2, 2)] and paced.backlog_tokens == 0


def test_a_requests_saves_come_out_together(cost: CostModel) -> None:
    clock = Clock()
    paced = PacedSaves(cost, clock=clock)
    paced.push([save("a", 0, 2), save("b", 0, 2)], lambda _: 1)  # one step
    paced.push([save("a", 2, 1), save("b", 2, 1)], lambda _: 1)  # the next
    clock.now += 100 * paced.token_s
    assert paced.take() == [save("a", 0, 2), save("a", 2, 1), save("b", 0, 2), save("b", 2, 1)]


def test_an_idle_link_banks_nothing_and_unstreamed_requests_pass_at_once(cost: CostModel) -> None:
    clock = Clock()
    paced = PacedSaves(cost, clock=clock)
    clock.now += 10_000 * paced.token_s  # idle for a long time
    paced.push([save("a", 0, 3)], lambda _: 1)
    assert paced.take() == []
    paced.push([save("c", 0, 5)], lambda _: 0)  # no holders: not streamed, behind a in order
    clock.now += 3 * paced.token_s
    assert paced.take() == [save("a", 0, 3), save("c", 0, 5)]


def test_dropped_requests_never_leave(cost: CostModel) -> None:
    clock = Clock()
    paced = PacedSaves(cost, clock=clock)
    paced.push([save("a", 0, 4), save("b", 0, 4), save("a", 4, 1)], lambda _: 1)
    paced.drop("a")
    assert paced.num_dropped_tokens == 5 and paced.backlog_tokens == 4
    clock.now += 100 * paced.token_s
    assert paced.take() == [save("b", 0, 4)]


def test_time_scale_is_checked(cost: CostModel) -> None:
    with pytest.raises(ValueError, match="`time_scale` must be > 0, got 0"):
        PacedSaves(cost, time_scale=0)
