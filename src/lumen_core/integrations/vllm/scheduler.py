"""The scheduler side of LumenConnector: per-request control, non-blocking restore lookups,
the per-step plan of what to restore and save (``LumenMetadata``), and the local control
channel's commands (``control.py``), answered from what this side knows or queued for the
next step's plan."""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections import Counter, deque
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from lumen_core.connector import RestoreLookup, RestoreSource
from lumen_core.integrations.vllm.control import ControlServer
from lumen_core.integrations.vllm.metadata import LoadSpec, LumenMetadata, OpenSpec, RenewSpec, SaveSpec
from lumen_core.integrations.vllm.params import ConnectorConfig, CredentialGrant, Renewal, RequestControl
from lumen_core.integrations.vllm.stats import DURABLE_LAG, FLUSH_LAG, FLUSH_MARK

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks, KVCacheManager
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request

__all__ = ["LookupTiming", "SchedulerSide"]

logger = logging.getLogger(__name__)

MAX_FLUSH_S = 30.0  # bound on one `flush` command's wait
ABANDON_WAIT_S = 3.0  # bound on an `abandon`'s wait for the step that takes it (< ask's 5 s)
_MAX_LOOKUP_TIMINGS = 1024  # the latest ones kept for `stats`


@dataclass(frozen=True)
class LookupTiming:
    """One restoring request's way into this engine, on the host's monotonic clock (one clock
    for every process of a host, so the agent's and the gateway's times line up with it):
    ``arrived_s`` vLLM's arrival time (its API server took the request: input processing
    begins), ``added_s`` the scheduler's ``add_request`` (the engine has it: waiting; its
    lookup starts), ``asked_s`` its first look at it (``get_num_new_matched_tokens``),
    ``planned_s`` the look that found the lookup's answer, ``matched`` the tokens it will
    restore (0: recomputed)."""

    request_id: str
    arrived_s: float
    added_s: float
    asked_s: float
    planned_s: float
    matched: int


class SchedulerSide:
    """State the scheduler process keeps (see LumenConnector). ``record_bytes`` is the token
    record size of this engine's cache (the lookup reads one record's header)."""

    def __init__(self, config: ConnectorConfig, block_size: int, record_bytes: int) -> None:
        self.config = config
        self.block_size = block_size
        self.record_bytes = record_bytes
        self.kv_cache_manager: KVCacheManager | None = None
        self._controls: dict[str, RequestControl] = {}
        self._requests: dict[str, Request] = {}
        self._sources: dict[str, RestoreSource] = {}  # requests to resume
        self._pending_loads: dict[str, int] = {}  # req_id -> tokens to restore this step
        self._opened: set[str] = set()
        self._added_s: dict[str, float] = {}  # restoring requests not yet planned: when added
        self._asked_s: dict[str, float] = {}  # of those, looked up: when first looked up
        self.identity = config.identity()
        # Lookups run on the lookup's own thread, never on the scheduler's.
        self._lookup = RestoreLookup(
            config.secret,
            record_bytes=record_bytes,
            tls=config.tls,
            connect_timeout_s=config.connect_timeout_s,
            encrypt=config.encrypt,
            identity=self.identity,
        )
        # What the control channel's threads share with the engine's: under _lock.
        self._lock = threading.Condition()
        self._releases: list[str] = []  # LUMEN ids to stop checkpointing at the next step
        self._renewals: list[Renewal] = []  # applied at the next step
        self._abandon = False  # control `abandon`: at the next step
        self._credential: CredentialGrant | None = None  # control `credential`: to the worker side
        self._worker_totals: Counter[str] = Counter()
        self._lag = -1  # the worker's last durable lag sample (tokens)
        self._num_flushing = 0
        self._flush_asks = 0  # control `flush`es asked so far: the newest one's mark number
        self._flush_lag: tuple[int, int] = (0, -1)  # the worker's (mark number, tokens not durable)
        self._lookup_timings: deque[LookupTiming] = deque(maxlen=_MAX_LOOKUP_TIMINGS)
        self._control = (
            None if config.control_socket is None else ControlServer(config.control_socket, self.control)
        )

    def on_new_request(self, request: Request) -> None:
        """Parse the request's control. A malformed ``kv_transfer_params`` is logged and the
        request served without checkpointing: raising here would stop the engine."""
        try:
            control = RequestControl.parse(request.request_id, request.kv_transfer_params, self.config)
        except (TypeError, ValueError) as error:
            logger.error("lumen: request %s is not checkpointed: %s", request.request_id, error)
            control = RequestControl(request.request_id, 0, 0, (), b"", None)
        self._controls[request.request_id] = control
        self._requests[request.request_id] = request
        if control.restore is not None:
            self._sources[request.request_id] = control.restore
            self._added_s[request.request_id] = time.monotonic()
            # Ask now: the answer comes while the request waits for the scheduler's first look.
            self._lookup.plan(request.request_id, control.key, control.restore)

    # ---- restore --------------------------------------------------------------------------
    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        source = self._sources.get(request.request_id)
        if source is None or num_computed_tokens > 0:
            # Restores fill a request's blocks from position 0; a local prefix hit is kept.
            return 0, False
        control = self._controls[request.request_id]
        now = time.monotonic()
        if request.request_id in self._added_s:  # not planned yet
            self._asked_s.setdefault(request.request_id, now)
        durable = self._lookup.plan(request.request_id, control.key, source)
        if durable is None:  # not known yet: vLLM asks again next step
            return None, False
        # At least one token is computed: vLLM needs a forward to sample from. The load is
        # asynchronous: the request waits for it (WAITING_FOR_REMOTE_KVS) while the others step.
        matched = min(durable, request.num_tokens - 1)
        added_s = self._added_s.pop(request.request_id, None)
        if added_s is not None:  # its first plan (vLLM may ask again: a failed allocation)
            arrived_s = request.arrival_time - time.time() + now  # vLLM's wall clock, mapped
            asked_s = self._asked_s.pop(request.request_id, now)
            timing = LookupTiming(control.request_id, arrived_s, added_s, asked_s, now, matched)
            with self._lock:
                self._lookup_timings.append(timing)
        return matched, matched > 0

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        if num_external_tokens > 0:
            self._pending_loads[request.request_id] = num_external_tokens

    # ---- the step's plan -------------------------------------------------------------------
    def _slots(self, req_id: str, start: int, end: int) -> list[int]:
        assert self.kv_cache_manager is not None
        block_ids = self.kv_cache_manager.get_block_ids(req_id)[0]
        bs = self.block_size
        return [block_ids[p // bs] * bs + p % bs for p in range(start, end)]

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> LumenMetadata:
        """Called before vLLM advances ``num_computed_tokens``: a request computes positions
        ``num_computed_tokens .. + num_scheduled_tokens`` this step."""
        meta = LumenMetadata()
        for req_id, num_tokens in self._pending_loads.items():
            request = self._requests[req_id]
            control = self._controls[req_id]
            slots = self._slots(req_id, 0, num_tokens)
            meta.loads.append(
                LoadSpec(
                    req_id,
                    control.request_id,
                    control.key,
                    slots,
                    list(request.all_token_ids[:num_tokens]),
                    self._sources[req_id],
                )
            )
        self._pending_loads.clear()
        for req_id, num_scheduled in scheduler_output.num_scheduled_tokens.items():
            request = self._requests.get(req_id)
            if request is None:
                continue
            control = self._controls[req_id]
            if not control.holders:
                continue
            start = request.num_computed_tokens
            # Scheduled draft tokens are not in all_token_ids and may be rejected: not saved.
            end = min(start + num_scheduled, request.num_tokens)
            if req_id not in self._opened:
                meta.opens.append(
                    OpenSpec(
                        req_id,
                        control.request_id,
                        control.key,
                        control.holders,
                        control.capabilities,
                        control.epoch,
                        request.num_prompt_tokens + request.max_tokens,
                    )
                )
                self._opened.add(req_id)
                start = 0
            if end > start:
                meta.saves.append(
                    SaveSpec(req_id, start, self._slots(req_id, start, end),
                             list(request.all_token_ids[start:end]))
                )  # fmt: skip
        for req_id in scheduler_output.preempted_req_ids or ():
            if req_id in self._opened:
                meta.preempted_req_ids.append(req_id)
        with self._lock:
            meta.releases, self._releases = self._releases, []
            renewals, self._renewals = self._renewals, []
            meta.flush_mark = self._flush_asks if self._num_flushing > 0 else 0
            meta.abandon, self._abandon = self._abandon, False
            meta.credential, self._credential = self._credential, None
            if meta.abandon:
                self._lock.notify_all()  # the `abandon` waiting for this step answers
        meta.renewals = self._renew(renewals)
        return meta

    def _renew(self, renewals: list[Renewal]) -> list[RenewSpec]:
        """Apply control ``renew``s to the requests they name (at their epoch and holders): a
        request not opened yet opens with the fresh capabilities, an opened one's replicas get
        them from the worker side this step. Others (finished, moved on) are dropped."""
        specs = []
        for renewal in renewals:
            for req_id, control in list(self._controls.items()):
                if control.request_id != renewal.request_id or control.epoch != renewal.epoch:
                    continue
                capabilities = renewal.for_holders(control.holders)
                if capabilities is None:
                    continue
                self._controls[req_id] = dataclasses.replace(control, capabilities=capabilities)
                if req_id in self._opened:
                    specs.append(RenewSpec(control.request_id, capabilities))
        return specs

    def update_connector_output(self, stats: Any) -> None:
        """The worker's figures of the last step (``LumenStats`` or None), kept for ``stats``
        and ``flush``."""
        if stats is None or not stats.data:
            return
        data = dict(stats.data)
        with self._lock:
            if FLUSH_MARK in data:
                self._flush_lag = (int(data.pop(FLUSH_MARK)), int(data.pop(FLUSH_LAG, -1)))
            if DURABLE_LAG in data:
                self._lag = int(data.pop(DURABLE_LAG))
            self._worker_totals.update(data)
            self._lock.notify_all()

    # ---- the control channel (its threads) -------------------------------------------------
    def control(self, request: dict[str, Any]) -> dict[str, Any]:
        """One control command (module docstring of ``control.py``); ValueError for a bad one.

        - ``stats``: ``requests`` (known to the scheduler), ``streaming``, ``restoring``,
          ``worker``: the worker's counter totals since the engine started, with its last
          ``durable_lag_tokens`` (-1 before its first sample), and ``lookups``: the latest
          1,024 restoring requests' ``LookupTiming``.
        - ``release`` ``{"request_id": str}``: stop checkpointing that LUMEN request from the
          next step on and drop its checkpoint on its holders (the gateway's word; the vLLM
          request itself runs on). ``known``: it streams here.
        - ``renew`` ``{"request_id": str, "epoch": int, "holders": [...], "capabilities":
          [hex, ...]}``: fresh capabilities (same epoch, later expiry) for that request's
          replicas from the next step on (the gateway's RENEW). ``known``: it runs here at
          that epoch.
        - ``flush`` ``{"wait_s": number}``: wait (at most ``wait_s``, <= 30, default 5) until the
          worker samples no saved-but-not-durable token; ``flushed`` and the last lag.
        - ``abandon``: the agent was fenced or drained: from the next step on, no request
          streaming now is checkpointed and none of their checkpoints is released (their
          aborts included): the holders keep them for the gateway. Requests opened later
          stream as usual. Answers once a step's plan has taken it (at most
          ``ABANDON_WAIT_S``; ``applied``), so an abort sent after the answer reaches the
          worker after its abandon. ``streaming``: the requests streaming here then.
        - ``credential`` ``{"credential": hex, "issuer_public_key": hex, "worker_id": int}``:
          the agent registered this server (``identity_key_file``); connections opened from
          now on (lookups here, streaming and restores on the worker side from the next step)
          prove it. ValueError if it does not name this server's key, or none is configured.
        """
        command = request.get("command")
        if command == "stats":
            with self._lock:
                worker = dict(self._worker_totals)
                worker[DURABLE_LAG] = self._lag
                lookups = [dataclasses.asdict(t) for t in self._lookup_timings]
            return {
                "requests": len(self._requests),
                "streaming": len(self._opened),
                "restoring": len(self._sources),
                "worker": worker,
                "lookups": lookups,
            }
        if command == "credential":
            if self.identity is None:
                raise ValueError("no `identity_key_file` is configured: this server proves no identity")
            grant = CredentialGrant.parse(request)
            self.identity.accept(grant.credential, grant.issuer_public_key, grant.worker_id)
            with self._lock:
                self._credential = grant
            return {"worker_id": grant.worker_id}
        if command == "release":
            request_id = request.get("request_id")
            if not isinstance(request_id, str) or not request_id:
                raise ValueError(f"`request_id` must be a non-empty str, got {request_id!r}")
            known = any(
                c.request_id == request_id and r in self._opened for r, c in list(self._controls.items())
            )
            with self._lock:
                self._releases.append(request_id)
            return {"request_id": request_id, "known": known}
        if command == "renew":
            renewal = Renewal.parse(request)
            known = any(
                c.request_id == renewal.request_id and c.epoch == renewal.epoch
                for c in list(self._controls.values())
            )
            with self._lock:
                self._renewals.append(renewal)
            return {"request_id": renewal.request_id, "known": known}
        if command == "abandon":
            with self._lock:
                self._abandon = True
                streaming = len(self._opened)
                # Nothing streaming: no step need come (an idle engine takes none), and the
                # flag stays for the next one, which has nothing of now to abandon.
                applied = not streaming or self._lock.wait_for(lambda: not self._abandon, ABANDON_WAIT_S)
            return {"streaming": streaming, "applied": applied}
        if command == "flush":
            wait_s = request.get("wait_s", 5.0)
            if (
                isinstance(wait_s, bool)
                or not isinstance(wait_s, (int, float))
                or not 0 <= wait_s <= MAX_FLUSH_S
            ):
                raise ValueError(f"`wait_s` must be a number in [0, {MAX_FLUSH_S}], got {wait_s!r}")
            return self._flush(float(wait_s))
        raise ValueError(
            f"`command` must be one of 'stats', 'release', 'renew', 'flush', 'abandon', got {command!r}"
        )

    def _flush(self, wait_s: float) -> dict[str, Any]:
        """Wait until every token saved by the first step that sees this call is durable: that
        step marks each stream's saved length, and the worker reports every step how much of
        its mark is not durable yet. Tokens decoded after the mark do not keep the flush
        waiting (a drain's requests decode on until they move). The engine steps while a
        request streams or waits for its last gather; with none there is nothing to flush."""
        if not self._opened:  # nothing streams, nothing waits for its last gather
            return {"flushed": True, DURABLE_LAG: 0}
        deadline = time.monotonic() + wait_s
        with self._lock:
            self._flush_asks += 1
            number = self._flush_asks
            self._num_flushing += 1
            try:
                while True:
                    marked, lag = self._flush_lag
                    if marked >= number and lag == 0:
                        return {"flushed": True, DURABLE_LAG: 0}
                    left = deadline - time.monotonic()
                    if left <= 0:
                        return {"flushed": False, DURABLE_LAG: lag if marked >= number else -1}
                    self._lock.wait(left)
            finally:
                self._num_flushing -= 1

    def request_finished(self, request: Request) -> tuple[bool, dict[str, Any] | None]:
        """Blocks of a streamed request stay allocated until the worker reports its gathers
        done (``get_finished``); the worker then releases its checkpoint."""
        req_id = request.request_id
        self._controls.pop(req_id, None)
        self._requests.pop(req_id, None)
        self._sources.pop(req_id, None)
        self._added_s.pop(req_id, None)
        self._asked_s.pop(req_id, None)
        self._lookup.forget(req_id)
        self._pending_loads.pop(req_id, None)
        if req_id in self._opened:
            self._opened.discard(req_id)
            return True, None
        return False, None

    def shutdown(self) -> None:
        if self._control is not None:
            self._control.close()
        self._lookup.close()
