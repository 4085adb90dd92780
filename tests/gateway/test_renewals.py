"""RenewalQueue (issue 19): the requests due for a capability renewal, without a walk over
every request kept; stale entries are skipped and the heap stays bounded by the live ones."""

import math

from hypothesis import given
from hypothesis import strategies as st

from lumen_core.gateway.renewals import RenewalQueue


def test_pop_due_gives_the_live_entries_due_earliest_grant_first_and_takes_them_out():
    queue = RenewalQueue()
    queue.push(3, 2.0)
    queue.push(1, 1.0)
    queue.push(2, -math.inf)  # granted before a gateway restart: due at once
    queue.push(4, 1.0)  # same grant time as 1: after it, in push order
    assert queue.pop_due(0.5) == [2]
    assert queue.pop_due(1.5) == [1, 4]
    assert queue.pop_due(1.5) == []  # taken out: pushed again only by the caller
    assert queue.num_live == 1 and queue.pop_due(2.0) == [3] and len(queue) == 0


def test_a_superseded_or_discarded_entry_is_never_popped():
    queue = RenewalQueue()
    queue.push(1, 0.0)
    queue.push(1, 5.0)  # granted again (a move's RESUME): its entry at 0.0 is stale
    queue.push(2, 0.0)
    queue.discard(2)  # ended
    queue.discard(9)  # never queued: nothing to do
    assert len(queue) == 3 and queue.num_live == 1
    assert queue.pop_due(4.0) == []  # pops both stale entries, gives neither
    assert len(queue) == 1
    assert queue.pop_due(5.0) == [1]


def test_the_heap_is_rebuilt_past_twice_the_live_entries_plus_slack():
    queue = RenewalQueue()
    for request_id in range(20_000):  # requests that ended, nothing popped since
        queue.push(request_id, float(request_id))
        queue.discard(request_id)
        assert len(queue) <= 2 * queue.num_live + RenewalQueue.SLACK
    for request_id in range(10):
        for granted_s in range(100):  # renewed again and again before any pass
            queue.push(request_id, float(granted_s))
            assert len(queue) <= 2 * queue.num_live + RenewalQueue.SLACK
    assert queue.num_live == 10 and len(queue) <= 2 * 10 + RenewalQueue.SLACK
    assert queue.pop_due(math.inf) == list(range(10))


@given(
    st.lists(
        st.tuples(st.sampled_from(["push", "discard", "pop"]), st.integers(0, 7), st.integers(0, 20)),
        max_size=200,
    )
)
def test_the_queue_pops_what_a_walk_over_the_latest_grants_finds_due(ops):
    """The obvious version: a dict of each live request's latest grant, walked in full."""
    queue, latest = RenewalQueue(), {}
    for op, request_id, time_s in ops:
        if op == "push":
            queue.push(request_id, float(time_s))
            latest[request_id] = float(time_s)
        elif op == "discard":
            queue.discard(request_id)
            latest.pop(request_id, None)
        else:
            due = [r for r, granted_s in latest.items() if granted_s <= time_s]
            assert sorted(queue.pop_due(float(time_s))) == sorted(due)
            for request_id in due:
                del latest[request_id]
        assert queue.num_live == len(latest)
        assert len(queue) <= 2 * queue.num_live + RenewalQueue.SLACK
