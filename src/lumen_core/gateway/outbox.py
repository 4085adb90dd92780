"""DirectiveOutbox: the directives decided for one worker epoch and not yet acknowledged.

Each directive gets the next sequence number (1, 2, ...). Both delivery paths read from
here: the pushed stream sends what follows the last number it sent, a heartbeat reply what
follows the number the heartbeat acknowledges. A directive stays until a heartbeat
acknowledges it (cumulatively: the worker has applied every number up to it), so a stream
that drops before the worker read what it sent loses nothing: the next heartbeat reply or
the reconnected stream sends it again, and the worker skips numbers it has applied.
"""

from __future__ import annotations

from collections import deque

from lumen_core._validate import check_int
from lumen_core.gateway.directives import Delivery, Directive


class DirectiveOutbox:
    """Not thread-safe (the Coordinator's caller holds the lock)."""

    def __init__(self) -> None:
        self._pending: deque[Delivery] = deque()
        self.last_sequence = 0  # the number of the newest directive (0: none yet)

    def put(self, directive: Directive) -> Delivery:
        self.last_sequence += 1
        delivery = Delivery(self.last_sequence, directive)
        self._pending.append(delivery)
        return delivery

    def after(self, sequence: int) -> list[Delivery]:
        """The unacknowledged directives numbered above ``sequence``, oldest first."""
        return [d for d in self._pending if d.sequence > sequence]

    def acknowledge(self, sequence: int) -> None:
        """The worker applied every directive up to ``sequence``: forget them. ValueError when
        ``sequence`` is above the newest number (it cannot have applied what was never sent)."""
        check_int("acked_sequence", sequence, low=0)
        if sequence > self.last_sequence:
            raise ValueError(
                f"`acked_sequence` must be <= {self.last_sequence} (the newest sent), got {sequence}"
            )
        while self._pending and self._pending[0].sequence <= sequence:
            self._pending.popleft()
