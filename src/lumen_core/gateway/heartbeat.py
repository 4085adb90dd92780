"""HeartbeatLoop: a worker process's lease keeper, on a thread of its own.

Every ``heartbeat_s`` it asks the worker for a ``WorkerReport``, heartbeats, tells
``on_reported`` (if given) which report the gateway received, and hands the directives of the
reply to ``on_directives``. A report that did not reach the gateway is not acknowledged, so
one-off news in it (refused holds, evictions) can go out again with the next one. When the gateway answers ``reregister`` (it
restarted) it registers again with the report's running requests and held checkpoints. It
calls ``on_fenced(reason)`` once and stops when the lease is lost: the reply says ``fenced``,
or the gateway cannot be reached until the worker's own lease deadline passes (so a worker
cut off from the gateway stops serving on its own), or ``report`` or ``on_directives`` raised
(a worker that cannot report or act on its directives must not keep serving; the loop stops
heartbeating, so the gateway fails it at lease expiry).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass

from lumen_core.gateway.client import GatewayClient, GatewayError
from lumen_core.gateway.coordinator import Directive, HeldReport, RunningReport


@dataclass(frozen=True)
class WorkerReport:
    """What a worker reports at a heartbeat; ``running`` is sent only when re-registering."""

    num_running: int = 0
    num_waiting: int = 0
    held_bytes: int = 0
    held: tuple[HeldReport, ...] = ()
    refused_request_ids: tuple[int, ...] = ()
    evicted_request_ids: tuple[int, ...] = ()
    assist_steps: int = 0
    proposed_draft_tokens: int = 0
    accepted_draft_tokens: int = 0
    running: tuple[RunningReport, ...] = ()


class HeartbeatLoop:
    """Keeps a registered GatewayClient's lease. ``start`` / ``stop`` (joins the thread).

    ``on_directives``, ``on_reported`` and ``on_fenced`` run on the loop's thread. ``num_errors`` counts
    heartbeats that did not reach the gateway; ``last_num_draft_tokens`` is the draft length
    of the last reply (assisting workers).
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
    ) -> None:
        if not isinstance(client, GatewayClient):
            raise TypeError(f"client must be a GatewayClient, got {type(client).__name__}")
        if client.worker_id < 0:
            raise ValueError("client must be registered before its heartbeats start")
        period = client.heartbeat_s if heartbeat_s is None else heartbeat_s
        if isinstance(period, bool) or not isinstance(period, (int, float)) or not period > 0:
            raise ValueError(f"heartbeat_s must be a number > 0, got {period!r}")
        self._client = client
        self._report = report
        self._on_directives = on_directives
        self._on_fenced = on_fenced
        self._on_reported = on_reported
        self.heartbeat_s = float(period)
        self._stop = threading.Event()
        self._thread = threading.Thread(
            target=self._run, name=f"lumen-heartbeat-{client.worker_id}", daemon=True
        )
        self.num_errors = 0
        self.last_num_draft_tokens = 0
        self.fence_reason = ""

    def start(self) -> HeartbeatLoop:
        self._thread.start()
        return self

    def stop(self, timeout_s: float = 10.0) -> None:
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout_s)

    @property
    def running(self) -> bool:
        return self._thread.is_alive()

    def _run(self) -> None:
        client = self._client
        while not self._stop.wait(self.heartbeat_s):
            try:
                report = self._report()
            except Exception as exc:  # noqa: BLE001 - a worker that cannot report must not serve
                self._fence(f"worker report failed: {type(exc).__name__}: {exc}")
                return
            try:
                reply = client.heartbeat(
                    num_running=report.num_running,
                    num_waiting=report.num_waiting,
                    held_bytes=report.held_bytes,
                    held=report.held,
                    refused_request_ids=report.refused_request_ids,
                    evicted_request_ids=report.evicted_request_ids,
                    assist_steps=report.assist_steps,
                    proposed_draft_tokens=report.proposed_draft_tokens,
                    accepted_draft_tokens=report.accepted_draft_tokens,
                )
                if reply.reregister:
                    registration = client.register_again(running=report.running, held=report.held)
                    directives = registration.directives
                else:
                    directives = reply.directives
                    self.last_num_draft_tokens = reply.num_draft_tokens
            except GatewayError:
                self.num_errors += 1
                directives = ()
            else:
                if not reply.reregister and self._on_reported is not None:
                    try:
                        self._on_reported(report)
                    except Exception as exc:  # noqa: BLE001 - as a failed report
                        self._fence(f"worker report failed: {type(exc).__name__}: {exc}")
                        return
            if directives:
                try:
                    self._on_directives(directives)
                except Exception as exc:  # noqa: BLE001 - the worker cannot act on its directives
                    self._fence(f"directive handler failed: {type(exc).__name__}: {exc}")
                    return
            if not client.lease_valid():
                self._fence(
                    client.fence_reason
                    or f"lease of worker {client.worker_id} epoch {client.epoch} expired: no heartbeat "
                    f"acknowledged for {client.lease_s} s"
                )
                return

    def _fence(self, reason: str) -> None:
        self.fence_reason = reason
        self._client.fence(reason)
        self._on_fenced(reason)
