"""Block manager check/commit pairs and slot mapping."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lumen_core.engine.block_manager import BlockManager
from lumen_core.engine.config import SamplingParams
from lumen_core.engine.request import Request


def req(name: str = "r") -> Request:
    return Request(name, [0], 1, SamplingParams())


def test_allocate_truncate_free_and_slots() -> None:
    manager = BlockManager(num_blocks=4, block_size=4)
    r = req()
    assert manager.can_allocate(r, 9) and not manager.can_allocate(r, 17)
    manager.allocate(r, 9)
    assert r.block_ids == [0, 1, 2] and manager.num_free_blocks == 1
    assert manager.slot_ids(r, 3, 6) == [3, 4, 5]
    manager.allocate(r, 12)  # fits in the pages it has
    assert manager.num_free_blocks == 1
    manager.truncate(r, 5)
    assert r.block_ids == [0, 1] and manager.num_free_blocks == 2
    manager.free(r)
    assert r.block_ids == [] and manager.num_free_blocks == 4


def test_slots_follow_the_block_table() -> None:
    manager = BlockManager(num_blocks=4, block_size=2)
    a, b = req("a"), req("b")
    manager.allocate(a, 2)
    manager.allocate(b, 2)
    manager.allocate(a, 4)
    assert a.block_ids == [0, 2]
    assert manager.slot_ids(a, 0, 4) == [0, 1, 4, 5]


def test_allocate_without_room_raises() -> None:
    manager = BlockManager(num_blocks=2, block_size=4)
    with pytest.raises(RuntimeError, match="call can_allocate first"):
        manager.allocate(req(), 9)


def test_slot_ids_outside_pages_raise() -> None:
    manager = BlockManager(num_blocks=2, block_size=4)
    r = req()
    manager.allocate(r, 3)
    with pytest.raises(IndexError, match=r"positions \[2, 5\) of 'r' are outside its 1 blocks"):
        manager.slot_ids(r, 2, 5)


def test_bad_sizes_raise() -> None:
    with pytest.raises(ValueError, match="`num_blocks` and `block_size` must be > 0"):
        BlockManager(0, 4)


@settings(max_examples=50, deadline=None)
@given(
    st.lists(
        st.tuples(st.integers(0, 3), st.sampled_from(["alloc", "truncate", "free"]), st.integers(0, 40)),
        max_size=40,
    )
)
def test_pages_are_never_shared_or_lost(ops: list[tuple[int, str, int]]) -> None:
    manager = BlockManager(num_blocks=8, block_size=4)
    requests = [req(str(i)) for i in range(4)]
    for who, op, n in ops:
        r = requests[who]
        if op == "alloc":
            if manager.can_allocate(r, n):
                manager.allocate(r, n)
                assert len(r.block_ids) >= manager.num_blocks_for(n)
        elif op == "truncate":
            manager.truncate(r, n)
            assert len(r.block_ids) <= manager.num_blocks_for(n)
        else:
            manager.free(r)
        held = [b for x in requests for b in x.block_ids]
        assert len(held) == len(set(held))
        assert len(held) + manager.num_free_blocks == 8
