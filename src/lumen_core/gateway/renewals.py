"""RenewalQueue: the requests whose capabilities the gateway will renew, earliest grant first.

A heap of (granted_s, sequence, request_id) with lazy deletion: a request has at most one live
entry (the one its latest ``push`` made), and the entries it superseded, or that ``discard``
ended, stay in the heap as stale until they are popped. So a renewal pass pops only the
entries due, each once, instead of walking every request the gateway keeps (finished ones are
kept for ``finished_retention_s``). The heap is rebuilt from its live entries whenever it holds
more than ``2 * live + SLACK`` of them: at most that many after every call, for amortized O(1)
work per ``push`` or ``discard``.
"""

from __future__ import annotations

import heapq


class RenewalQueue:
    """Not thread-safe (the Coordinator's caller holds the lock)."""

    SLACK = 64  # stale entries always tolerated before a rebuild (a rebuild of a few is a waste)

    def __init__(self) -> None:
        self._heap: list[tuple[float, int, int]] = []  # (granted_s, sequence, request_id)
        self._live: dict[int, int] = {}  # request id -> the sequence number of its live entry
        self._next_sequence = 0

    def __len__(self) -> int:
        """Entries held, stale ones included (<= 2 * ``num_live`` + SLACK)."""
        return len(self._heap)

    @property
    def num_live(self) -> int:
        """Requests with a live entry."""
        return len(self._live)

    def push(self, request_id: int, granted_s: float) -> None:
        """The request's grants were issued at ``granted_s``: it is due once that is old
        enough. Supersedes its earlier entry."""
        sequence = self._next_sequence
        self._next_sequence += 1
        self._live[request_id] = sequence
        heapq.heappush(self._heap, (granted_s, sequence, request_id))
        self._bound()

    def discard(self, request_id: int) -> None:
        """The request needs no renewal any more (it ended); no-op when it has no entry."""
        if self._live.pop(request_id, None) is not None:
            self._bound()

    def pop_due(self, due_s: float) -> list[int]:
        """The requests whose live entry has ``granted_s <= due_s``, earliest grant first (ties:
        in push order). Their entries leave the queue: push again those still to renew."""
        due: list[int] = []
        heap = self._heap
        while heap and heap[0][0] <= due_s:
            _, sequence, request_id = heapq.heappop(heap)
            if self._live.get(request_id) == sequence:
                del self._live[request_id]
                due.append(request_id)
        return due

    def _bound(self) -> None:
        if len(self._heap) > 2 * len(self._live) + self.SLACK:
            self._heap = [entry for entry in self._heap if self._live.get(entry[2]) == entry[1]]
            heapq.heapify(self._heap)
