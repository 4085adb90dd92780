"""``CoordinatorBridge``: the front door's one way into the gateway's Coordinator.

Every call runs under the GatewayServer's lock and notifies its condition afterwards, as the
gRPC handlers do (so the pushed directive streams send what a call decided at once). Streams
wait without a thread each: one watcher thread waits on the condition and, while it still holds
the lock, schedules one wake-up on the event loop (so no notification falls between its waits;
notifications before that wake-up ran share it). The wake-up reads every waiting stream's
tokens in one hold of the lock and resolves those with news (a worker's step reports tokens
for many streams at once). Measured no faster than a read per stream (bench/RESULTS.md,
relay delay): the lock was not the relay's cost; it is kept as the simpler wake-up.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from typing import NamedTuple, TypeVar

from lumen_core.gateway.coordinator import Coordinator
from lumen_core.gateway.server import GatewayServer

T = TypeVar("T")
_WATCH_POLL_S = 0.25  # the watcher re-checks for its own stop this often


class TokenUpdate(NamedTuple):
    """What ``wait_tokens`` found: the tokens from the position asked, whether the request has
    finished or was lost, its epoch (1 at admission; it grows with every move), and the
    wake-up that read it (``wake``; 0: the stream's own read)."""

    tokens: tuple[int, ...]
    finished: bool
    lost: bool
    epoch: int
    wake: int = 0

    def news(self, stopping: bool) -> bool:
        """Whether a waiting stream has something to act on."""
        return bool(self.tokens) or self.finished or self.lost or stopping


def _update(coordinator: Coordinator, request_id: int, position: int, wake: int = 0) -> TokenUpdate:
    tokens, finished, lost = coordinator.tokens(request_id, position)
    return TokenUpdate(tokens, finished, lost, coordinator.request_worker(request_id)[1], wake)


class CoordinatorBridge:
    """Use ``start`` on the event loop's thread before the first ``wait_tokens``, ``stop`` at
    the end (it joins the watcher)."""

    def __init__(self, gateway: GatewayServer) -> None:
        self._gateway = gateway
        self._loop: asyncio.AbstractEventLoop | None = None
        self._waiting: dict[asyncio.Future[TokenUpdate], tuple[int, int]] = {}  # -> (request, position)
        self._wake_pending = False  # a wake-up is scheduled and has not read yet (under the lock)
        self._wakes = 0  # wake-ups that have read, on the event loop's thread
        self._stopping = False
        self._watcher: threading.Thread | None = None

    @property
    def now_s(self) -> float:
        return self._gateway.now_s()

    def call(self, fn: Callable[[Coordinator], T]) -> T:
        """``fn(coordinator)`` under the gateway's lock; its waiters are notified after it."""
        with self._gateway.condition:
            result = fn(self._gateway.coordinator)
            self._gateway.condition.notify_all()
            return result

    def read(self, fn: Callable[[Coordinator], T]) -> T:
        """``fn(coordinator)`` under the lock, for a call that decides nothing (no notify)."""
        with self._gateway.condition:
            return fn(self._gateway.coordinator)

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._watcher = threading.Thread(target=self._watch, name="lumen-gateway-http-watch", daemon=True)
        self._watcher.start()

    def stop(self) -> None:
        """Wake every waiting stream to end it and join the watcher (again: a no-op)."""
        with self._gateway.condition:
            self._stopping = True
            self._gateway.condition.notify_all()
        if self._watcher is not None:
            self._watcher.join(timeout=5.0)
            self._watcher = None

    def _watch(self) -> None:
        assert self._loop is not None
        condition = self._gateway.condition
        with condition:
            while not self._stopping and not self._gateway.stopping:
                if condition.wait(_WATCH_POLL_S) and not self._wake_pending:
                    self._wake_pending = True
                    self._loop.call_soon_threadsafe(self._wake)
        self._loop.call_soon_threadsafe(self._wake)

    def _wake(self) -> None:
        """On the event loop: every waiting stream's news in one hold of the lock."""
        waiting = [(f, key) for f, key in self._waiting.items() if not f.done()]
        found: list[tuple[asyncio.Future[TokenUpdate], TokenUpdate | IndexError]] = []
        with self._gateway.condition:
            self._wake_pending = False  # a notification from here on schedules another wake-up
            self._wakes += 1
            coordinator = self._gateway.coordinator
            for future, (request_id, position) in waiting:
                try:
                    found.append((future, _update(coordinator, request_id, position, self._wakes)))
                except IndexError as exc:
                    found.append((future, exc))
        stopping = self.stopping
        for future, update in found:
            if isinstance(update, IndexError):
                future.set_exception(update)
            elif update.news(stopping):
                future.set_result(update)

    @property
    def stopping(self) -> bool:
        return self._stopping or self._gateway.stopping

    async def wait_tokens(self, request_id: int, position: int, last_wake: int = 0) -> TokenUpdate:
        """The request's tokens from ``position`` once there is something new (or the gateway
        stops: then possibly nothing). ``last_wake``: the ``wake`` of the update the stream
        acted on last, from which ``position`` follows. Raises IndexError for an unknown
        request."""
        # While no wake-up has read since the one that gave the stream its last update, any
        # change since that read has scheduled a wake-up yet to run, which reads for this
        # future too: the stream waits without a read of its own (one hold of the lock fewer
        # a stream a step).
        if not last_wake or last_wake != self._wakes:
            update = self.read(lambda c: _update(c, request_id, position))
            if update.news(self.stopping):
                return update
        assert self._loop is not None
        # Registered after the read, on the loop: a change since the read has notified the
        # watcher, whose wake-up runs after this and reads for this future too.
        future: asyncio.Future[TokenUpdate] = self._loop.create_future()
        self._waiting[future] = (request_id, position)
        try:
            return await future
        finally:
            del self._waiting[future]
