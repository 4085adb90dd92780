"""DirectiveInbox: a worker's side of the directive sequence (gateway/outbox.py is the other).

Directives come by two paths, the pushed stream and heartbeat replies (the fallback), and
the same number may come by both. The inbox hands each number of the current worker epoch to
the handler once and in order: a number at or below the last one applied is skipped, and a
number past a gap stops the batch (it cannot happen on one ordered path; the next heartbeat
reply, which starts after the acknowledged number, fills the gap). The highest number
applied is what the next heartbeat acknowledges.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence

from lumen_core.gateway.directives import Delivery, Directive

DirectiveHandler = Callable[[tuple[Directive, ...]], None]


class DirectiveInbox:
    """Thread-safe: the stream thread and the heartbeat thread both deliver into it."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._epoch = 0
        self._sequence = 0
        self.num_repeated = 0  # deliveries skipped: that number had come the other way

    @property
    def sequence(self) -> int:
        """The highest number applied in the current epoch (0: none)."""
        with self._lock:
            return self._sequence

    def position(self) -> tuple[int, int]:
        """(worker epoch, highest number applied in it), read together: where a stream opened
        now must start."""
        with self._lock:
            return self._epoch, self._sequence

    def reset(self, epoch: int) -> None:
        """A new registration (worker epoch): its directives are numbered from 1 again."""
        with self._lock:
            self._epoch = epoch
            self._sequence = 0

    def accept(
        self, epoch: int, deliveries: Sequence[Delivery], on_directives: DirectiveHandler | None = None
    ) -> tuple[Directive, ...]:
        """The directives of ``deliveries`` not applied yet, in order; ``on_directives`` (if
        given) is called with them under the inbox's lock, so batches from the two paths
        never interleave. Deliveries of another epoch (a stream of an older incarnation) are
        dropped. What ``on_directives`` raises propagates; its directives count as applied."""
        with self._lock:
            if epoch != self._epoch:
                return ()
            new: list[Directive] = []
            for delivery in deliveries:
                if delivery.sequence <= self._sequence:
                    self.num_repeated += 1
                    continue
                if delivery.sequence != self._sequence + 1:
                    break
                new.append(delivery.directive)
                self._sequence = delivery.sequence
            if new and on_directives is not None:
                on_directives(tuple(new))
            return tuple(new)
