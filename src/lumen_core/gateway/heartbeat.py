"""HeartbeatLoop: a worker process's lease keeper and directive receiver, on threads of its own.

Every ``heartbeat_s`` it asks the worker for a ``WorkerReport``, heartbeats, tells
``on_reported`` (if given) which report the gateway received, and hands the directives of the
reply to ``on_directives``. With ``pushed`` (the default) a second thread keeps the
gateway's directive stream open (reopening it after a break, backing off up to 1 s) and hands
each directive to ``on_directives`` as it arrives; the heartbeat replies then carry only what
the stream had not delivered yet (the fallback: a stream that is down costs latency, never a
directive). The client's inbox passes each directive on once and in order, whichever thread
received it. A report that did not reach the gateway is not acknowledged, so one-off news in
it (refused holds, evictions) can go out again with the next one. When the gateway answers
``reregister`` (it restarted) it registers again with the report's held checkpoints and the
requests it runs: ``running()`` when given (asked only then: a snapshot of every prompt and
output is not worth taking every heartbeat), else the report's own ``running``. It calls
``on_fenced(reason)`` once and stops when the lease is lost: the reply says ``fenced``, or
the gateway cannot be reached until the worker's own lease deadline passes (so a worker cut
off from the gateway stops serving on its own), or ``report``, ``on_reported`` or
``on_directives`` raised (a worker that cannot report or act on its directives must not keep
serving; the loop stops heartbeating, so the gateway fails it at lease expiry).
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Callable

from lumen_core._validate import check_number
from lumen_core.gateway.client import GatewayClient
from lumen_core.gateway.directives import Directive
from lumen_core.gateway.errors import GatewayError
from lumen_core.gateway.reports import RunningReport, WorkerReport

logger = logging.getLogger(__name__)

_REOPEN_MIN_S = 0.05  # a broken directive stream is reopened after this, doubling up to
_REOPEN_MAX_S = 1.0  # this (the gateway restarting, or refusing streams: heartbeats deliver)


class HeartbeatLoop:
    """Keeps a registered GatewayClient's lease. ``start`` / ``stop`` (joins the threads).

    ``on_directives``, ``on_reported`` and ``on_fenced`` run on the loop's threads (never two
    at once for ``on_directives``). ``num_errors`` counts heartbeats that did not reach the
    gateway, ``num_stream_errors`` directive streams that could not open or broke;
    ``last_num_draft_tokens`` is the draft length of the last reply (assisting workers).
    """

    def __init__(
        self,
        client: GatewayClient,
        report: Callable[[], WorkerReport],
        on_directives: Callable[[tuple[Directive, ...]], None],
        on_fenced: Callable[[str], None],
        *,
        heartbeat_s: float | None = None,
        on_reported: Callable[[WorkerReport], None] | None = None,
        pushed: bool = True,
        running: Callable[[], tuple[RunningReport, ...]] | None = None,
    ) -> None:
        if not isinstance(client, GatewayClient):
            raise TypeError(f"client must be a GatewayClient, got {type(client).__name__}")
        if client.worker_id < 0:
            raise ValueError("client must be registered before its heartbeats start")
        period = client.heartbeat_s if heartbeat_s is None else heartbeat_s
        check_number("heartbeat_s", period, positive=True)
        self._client = client
        self._report = report
        self._on_directives = on_directives
        self._on_fenced = on_fenced
        self._on_reported = on_reported
        self._running = running
        self.heartbeat_s = float(period)
        self._stop = threading.Event()
        self._wake = threading.Event()  # beat_now: the next heartbeat goes at once
        self._fence_lock = threading.Lock()
        self._thread = threading.Thread(
            target=self._run, name=f"lumen-heartbeat-{client.worker_id}", daemon=True
        )
        self._receiver = (
            threading.Thread(
                target=self._receive, name=f"lumen-heartbeat-{client.worker_id}-push", daemon=True
            )
            if pushed
            else None
        )
        self.num_errors = 0
        self.num_stream_errors = 0
        self.last_num_draft_tokens = 0
        self.fence_reason = ""

    def start(self) -> HeartbeatLoop:
        self._thread.start()
        if self._receiver is not None:
            self._receiver.start()
        return self

    def _with_running(self, report: WorkerReport) -> WorkerReport:
        """The report a registration after a gateway restart sends. A ``running`` that raises
        registers the worker without its requests (the gateway cannot adopt them; their
        reports are then refused and they end), as a worker that reports nothing."""
        if self._running is None:
            return report
        try:
            return dataclasses.replace(report, running=self._running())
        except Exception as exc:  # noqa: BLE001 - the registration itself must go out
            logger.warning("worker %d: running requests not reported: %s: %s",
                           self._client.worker_id, type(exc).__name__, exc)  # fmt: skip
            return report

    def beat_now(self) -> None:
        """Send the next heartbeat now rather than at the end of the period (a report the
        gateway waits for: a drained worker's ``flushed``)."""
        self._wake.set()

    def stop(self, timeout_s: float = 10.0) -> None:
        self._stop.set()
        self._wake.set()
        self._client.cancel_directives()
        for thread in (self._thread, self._receiver):
            if thread is not None and thread.is_alive() and thread is not threading.current_thread():
                thread.join(timeout_s)

    @property
    def running(self) -> bool:
        return self._thread.is_alive()

    def _deliver(self, directives: tuple[Directive, ...]) -> None:
        """``on_directives``, fencing (instead of raising into the client) when it fails."""
        if self._stop.is_set():
            return
        try:
            self._on_directives(directives)
        except Exception as exc:  # noqa: BLE001 - the worker cannot act on its directives
            self._fence(f"directive handler failed: {type(exc).__name__}: {exc}")

    def _receive(self) -> None:
        wait_s = _REOPEN_MIN_S
        while not self._stop.is_set():
            opened_s = time.monotonic()
            try:
                self._client.receive_directives(self._deliver, self._stop)
            except GatewayError:
                self.num_stream_errors += 1
            if time.monotonic() - opened_s > _REOPEN_MAX_S:
                wait_s = _REOPEN_MIN_S  # it was up for a while: reopen quickly
            self._stop.wait(wait_s)
            wait_s = min(2 * wait_s, _REOPEN_MAX_S)

    def _run(self) -> None:
        client = self._client
        while not self._stop.is_set():
            self._wake.wait(self.heartbeat_s)
            self._wake.clear()
            if self._stop.is_set():
                return
            try:
                report = self._report()
            except Exception as exc:  # noqa: BLE001 - a worker that cannot report must not serve
                self._fence(f"worker report failed: {type(exc).__name__}: {exc}")
                return
            try:
                reply = client.heartbeat(report, on_directives=self._deliver)
                if reply.reregister:
                    client.register_again(self._with_running(report), on_directives=self._deliver)
                    client.cancel_directives()  # the stream of the old epoch: reopen for the new one
                else:
                    self.last_num_draft_tokens = reply.num_draft_tokens
            except GatewayError:
                self.num_errors += 1
            else:
                if not reply.reregister and self._on_reported is not None:
                    try:
                        self._on_reported(report)
                    except Exception as exc:  # noqa: BLE001 - as a failed report
                        self._fence(f"worker report failed: {type(exc).__name__}: {exc}")
                        return
            if self._stop.is_set():  # fenced by a directive handler
                return
            if not client.lease_valid():
                self._fence(
                    client.fence_reason
                    or f"lease of worker {client.worker_id} epoch {client.epoch} expired: no heartbeat "
                    f"acknowledged for {client.lease_s} s"
                )
                return

    def _fence(self, reason: str) -> None:
        """Once, from whichever thread finds the lease lost first; both threads then stop."""
        with self._fence_lock:
            if self._stop.is_set():
                return
            self._stop.set()
            self._wake.set()
        self.fence_reason = reason
        self._client.fence(reason)
        self._client.cancel_directives()
        self._on_fenced(reason)
