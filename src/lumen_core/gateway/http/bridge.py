"""``CoordinatorBridge``: the front door's one way into the gateway's Coordinator.

Every call runs under the GatewayServer's lock and notifies its condition afterwards, as the
gRPC handlers do (so the pushed directive streams send what a call decided at once). Streams
wait without a thread each: one watcher thread waits on the condition and, while it still holds
the lock, wakes the event loop's waiting streams (so no notification falls between its waits).
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from typing import TypeVar

from lumen_core.gateway.coordinator import Coordinator
from lumen_core.gateway.server import GatewayServer

T = TypeVar("T")
_WATCH_POLL_S = 0.25  # the watcher re-checks for its own stop this often


class CoordinatorBridge:
    """Use ``start`` on the event loop's thread before the first ``wait_tokens``, ``stop`` at
    the end (it joins the watcher)."""

    def __init__(self, gateway: GatewayServer) -> None:
        self._gateway = gateway
        self._loop: asyncio.AbstractEventLoop | None = None
        self._changed = asyncio.Event()
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
        self._changed = asyncio.Event()
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
                condition.wait(_WATCH_POLL_S)
                self._loop.call_soon_threadsafe(self._wake)
        self._loop.call_soon_threadsafe(self._wake)

    def _wake(self) -> None:
        changed, self._changed = self._changed, asyncio.Event()
        changed.set()

    @property
    def stopping(self) -> bool:
        return self._stopping or self._gateway.stopping

    async def wait_tokens(self, request_id: int, position: int) -> tuple[tuple[int, ...], bool, bool]:
        """(tokens from ``position``, finished, lost) of a request once there is something new
        (or the gateway stops: then possibly nothing). Raises IndexError for an unknown request."""
        while True:
            changed = self._changed  # taken before reading: a change after the read sets it
            tokens, finished, lost = self.read(lambda c: c.tokens(request_id, position))
            if tokens or finished or lost or self.stopping:
                return tokens, finished, lost
            await changed.wait()
