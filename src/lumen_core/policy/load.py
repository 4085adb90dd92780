"""LoadMonitor: the coordinator's view of worker load, requests and checkpoint reservations.

``L(w) = alpha * held_tokens(w) / mean_request_tokens + beta * Q_w`` in queue-equivalents
(docs/policies.md): a held checkpoint of an average request weighs like one queued request
when ``alpha = 1``; ``Q_w`` is running plus waiting requests. The monitor is fed events
(heartbeat aggregates and the coordinator's own decisions, never per token) and keeps every
per-worker quantity incrementally, so one event costs O(1) and one argmin over the workers is
a few vectorised numpy operations.

Accounting rules:
- ``Q_w``: a heartbeat sets ``num_running`` and ``num_waiting``; between heartbeats every
  admission or assignment to ``w`` adds one running request and every finish or move away
  removes one (never below zero).
- ``held_tokens(w)``: each checkpoint copy ``w`` holds counts ``max(durable_tokens,
  prompt_tokens)``: the prompt's KV streams right after prefill, so a fresh placement weighs
  on its holder at once and a burst of placements between heartbeats spreads.
- Budget: each copy reserves bytes on its holder (placement reserves the expected size);
  ``reserved_bytes <= budget_bytes`` holds for every reservation; growth the holder accepted
  beyond the reservation raises the reservation to the durable size.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Collection
from dataclasses import dataclass
from typing import Any

import numpy as np

from lumen_core._validate import check_instance, check_int, check_number
from lumen_core.policy.events import (
    CheckpointEvicted,
    CheckpointGrew,
    CheckpointRefused,
    CheckpointReleased,
    CheckpointReserved,
    Event,
    Heartbeat,
    RequestAdmitted,
    RequestFinished,
    WorkerDraining,
    WorkerFailed,
    WorkerJoined,
    WorkerRecovering,
    WorkerState,
)

_NOTHING: frozenset[int] = frozenset()


@dataclass(frozen=True)
class LoadConfig:
    """Weights and units of ``L(w)``.

    alpha: weight of held checkpoint KV (queue-equivalents per mean-sized request held).
    beta: weight of the queue depth ``Q_w`` (running + waiting requests).
    mean_request_tokens: tokens of a mean request (Splitwise-Conv: 1154.7 prompt + 211.1 output).
    kv_bytes_per_token: KV bytes of one token over all layers (Qwen3-32B bf16: 256 KiB); converts
        reservations between tokens and bytes.
    """

    alpha: float = 1.0
    beta: float = 1.0
    mean_request_tokens: float = 1366.0
    kv_bytes_per_token: int = 262_144

    def __post_init__(self) -> None:
        check_number("alpha", self.alpha, low=0)
        check_number("beta", self.beta, low=0)
        check_number("mean_request_tokens", self.mean_request_tokens, positive=True)
        check_int("kv_bytes_per_token", self.kv_bytes_per_token, low=1)


@dataclass(frozen=True)
class WorkerView:
    """Snapshot of one worker's accounting."""

    worker_id: int
    state: WorkerState
    domain: str
    budget_bytes: int
    reserved_bytes: int
    held_tokens: int
    num_running: int
    num_waiting: int


@dataclass(frozen=True)
class RequestView:
    """Snapshot of one request: where it runs and where its checkpoint copies are."""

    request_id: int
    worker_id: int
    prompt_tokens: int
    expected_output_tokens: int
    holder_ids: tuple[int, ...]
    durable_tokens: tuple[tuple[int, int], ...]  # (holder_id, durable tokens), holder order
    lost_holder_ids: tuple[int, ...] = ()  # holders that died holding a copy


class _Copy:
    """One checkpoint copy of a request on one holder."""

    __slots__ = ("reserved_bytes", "durable_tokens", "counted_tokens")

    def __init__(self, reserved_bytes: int, counted_tokens: int) -> None:
        self.reserved_bytes = reserved_bytes
        self.durable_tokens = 0
        self.counted_tokens = counted_tokens  # what this copy adds to its holder's held_tokens


class _Request:
    __slots__ = ("worker_id", "prompt_tokens", "expected_output_tokens", "copies", "refused_ids", "lost_ids")

    def __init__(self, worker_id: int, prompt_tokens: int, expected_output_tokens: int) -> None:
        self.worker_id = worker_id
        self.prompt_tokens = prompt_tokens
        self.expected_output_tokens = expected_output_tokens
        self.copies: dict[int, _Copy] = {}
        self.refused_ids: set[int] = set()
        self.lost_ids: list[int] = []  # holders that died holding a copy, in order


class LoadMonitor:
    """Per-worker load, request placement and checkpoint reservations, kept from events.

    Workers live in dense slots sorted by worker id, so a first-occurrence argmin over the
    slots breaks ties by the lowest worker id. Per-slot integers are Python lists (fast
    scalar updates); ``L``, free bytes, liveness and domain codes are numpy arrays (fast
    vector argmin). Every method raises TypeError for a non-int id and IndexError for an
    unknown worker or request id unless stated otherwise.
    """

    def __init__(self, config: LoadConfig = LoadConfig()) -> None:
        check_instance("config", config, LoadConfig)
        self.config = config
        self._held_weight = config.alpha / config.mean_request_tokens
        self._beta = config.beta
        self._slot: dict[int, int] = {}
        self._n = 0
        # per-slot Python scalars
        self._state: list[WorkerState] = []
        self._domain_name: list[str] = []
        self._budget: list[int] = []
        self._reserved: list[int] = []
        self._held: list[int] = []
        self._running: list[int] = []
        self._waiting: list[int] = []
        # per-slot numpy vectors (capacity >= _n)
        self._ids = np.zeros(0, dtype=np.int64)
        self._load = np.zeros(0, dtype=np.float64)
        self._avail = np.zeros(0, dtype=np.float64)  # L where serving, inf elsewhere
        self._free = np.zeros(0, dtype=np.int64)
        self._live = np.zeros(0, dtype=bool)
        self._domain = np.zeros(0, dtype=np.int64)
        self._domain_code: dict[str, int] = {}
        self._domain_size: dict[int, int] = {}
        self._live_ids: list[int] = []
        self._requests: dict[int, _Request] = {}
        self._running_ids: dict[int, set[int]] = {}
        self._held_ids: dict[int, set[int]] = {}
        self._affected_ids: dict[int, set[int]] = {}
        self._mean_before_failure: dict[int, float] = {}
        # Each handler takes the event type it is keyed by (``apply`` dispatches on the type).
        self._handlers: dict[type, Callable[[Any], None]] = {
            WorkerJoined: self._on_worker_joined,
            WorkerFailed: self._on_worker_failed,
            WorkerDraining: self._on_worker_draining,
            WorkerRecovering: self._on_worker_recovering,
            Heartbeat: self._on_heartbeat,
            RequestAdmitted: self._on_request_admitted,
            RequestFinished: self._on_request_finished,
            CheckpointReserved: self._on_checkpoint_reserved,
            CheckpointGrew: self._on_checkpoint_grew,
            CheckpointReleased: self._on_checkpoint_released,
            CheckpointEvicted: self._on_checkpoint_dropped,
            CheckpointRefused: self._on_checkpoint_refused,
        }

    # ---- events --------------------------------------------------------------------------
    def apply(self, event: Event) -> None:
        """Update the accounting with one event (any type of ``policy.events``).

        Raises TypeError for an object that is not an event, IndexError for an unknown worker
        (and for RequestFinished of an unknown request), ValueError for an impossible transition
        (joining a serving worker, draining one that is not serving, admitting to a worker that
        is not serving, negative sizes). Reports that arrive late are ignored: a heartbeat of a
        worker that is not serving, growth, release, eviction or refusal of a copy the monitor
        no longer records (that copy is stale: it was dropped, released or lost with its
        holder).
        A second WorkerFailed for a failed worker is a no-op.
        """
        handler = self._handlers.get(type(event))
        if handler is None:
            raise TypeError(f"`event` must be one of policy.events' types, got {type(event).__name__}")
        handler(event)

    def _on_worker_joined(self, event: WorkerJoined) -> None:
        worker_id = check_int("worker_id", event.worker_id, low=0)
        budget = check_int("budget_bytes", event.budget_bytes, low=0)
        check_instance("domain", event.domain, str)
        slot = self._slot.get(worker_id)
        if slot is None:
            slot = self._new_slot(worker_id)
        elif self._state[slot] == WorkerState.SERVING:
            raise ValueError(f"`worker_id` must be a worker that is not serving, got {worker_id} (serving)")
        else:
            self._remove_domain(slot)
        # A (re)joining worker starts empty: its host memory was lost with it (L = 0).
        self._state[slot] = WorkerState.SERVING
        self._budget[slot] = budget
        self._reserved[slot] = 0
        self._held[slot] = 0
        self._running[slot] = len(self._running_ids[worker_id])
        self._waiting[slot] = 0
        self._free[slot] = budget
        self._live[slot] = True
        self._set_domain(slot, worker_id, event.domain)
        bisect.insort(self._live_ids, worker_id)
        self._affected_ids.pop(worker_id, None)
        self._mean_before_failure.pop(worker_id, None)
        self._touch(slot)

    def _on_worker_failed(self, event: WorkerFailed) -> None:
        worker_id = check_int("worker_id", event.worker_id)
        slot = self._slot_of(worker_id)
        if self._state[slot] == WorkerState.FAILED:
            return
        self._mean_before_failure[worker_id] = self.mean_load()
        if self._state[slot] == WorkerState.SERVING:
            self._live_ids.remove(worker_id)
        self._state[slot] = WorkerState.FAILED
        self._live[slot] = False
        self._avail[slot] = np.inf
        affected = self._affected_ids.setdefault(worker_id, set())
        affected.update(self._running_ids[worker_id])
        for request_id in list(self._held_ids[worker_id]):
            request = self._requests[request_id]
            self._drop_copy(request, request_id, worker_id)
            request.lost_ids.append(worker_id)
            affected.add(request_id)

    def _on_worker_draining(self, event: WorkerDraining) -> None:
        worker_id = check_int("worker_id", event.worker_id)
        slot = self._serving_slot(worker_id)
        self._live_ids.remove(worker_id)
        self._state[slot] = WorkerState.DRAINING
        self._live[slot] = False
        self._avail[slot] = np.inf
        # Its copies go (as a failed holder's, but not lost): placement's replace re-places them.
        affected = self._affected_ids.setdefault(worker_id, set())
        for request_id in list(self._held_ids[worker_id]):
            self._drop_copy(self._requests[request_id], request_id, worker_id)
            affected.add(request_id)

    def _on_worker_recovering(self, event: WorkerRecovering) -> None:
        worker_id = check_int("worker_id", event.worker_id)
        slot = self._slot_of(worker_id)
        if self._state[slot] != WorkerState.FAILED:
            raise ValueError(f"`worker_id` must be a failed worker, got {worker_id} ({self._state[slot]})")
        self._state[slot] = WorkerState.RECOVERING

    def _on_heartbeat(self, event: Heartbeat) -> None:
        slot = self._slot_of(check_int("worker_id", event.worker_id))
        num_running = check_int("num_running", event.num_running, low=0)
        num_waiting = check_int("num_waiting", event.num_waiting, low=0)
        if self._state[slot] != WorkerState.SERVING:
            return
        self._running[slot] = num_running
        self._waiting[slot] = num_waiting
        self._touch(slot)

    def _on_request_admitted(self, event: RequestAdmitted) -> None:
        request_id = check_int("request_id", event.request_id)
        worker_id = check_int("worker_id", event.worker_id)
        request = self._requests.get(request_id)
        if request is not None:
            if request.worker_id != worker_id:
                self.assign(request_id, worker_id)
            return
        prompt_tokens = check_int("prompt_tokens", event.prompt_tokens, low=0)
        output_tokens = check_int("expected_output_tokens", event.expected_output_tokens, low=0)
        slot = self._serving_slot(worker_id)
        self._requests[request_id] = _Request(worker_id, prompt_tokens, output_tokens)
        self._running_ids[worker_id].add(request_id)
        self._running[slot] += 1
        self._touch(slot)

    def _on_request_finished(self, event: RequestFinished) -> None:
        request_id = check_int("request_id", event.request_id)
        request = self._request_of(request_id)
        self.release_reservation(request_id)
        self._leave(request_id, request.worker_id)
        del self._requests[request_id]

    def _on_checkpoint_reserved(self, event: CheckpointReserved) -> None:
        self.reserve(event.request_id, event.holder_ids, event.reserved_bytes)

    def _on_checkpoint_grew(self, event: CheckpointGrew) -> None:
        request = self._requests.get(check_int("request_id", event.request_id))
        holder_id = check_int("holder_id", event.holder_id)
        durable_tokens = check_int("durable_tokens", event.durable_tokens, low=0)
        copy = None if request is None else request.copies.get(holder_id)
        if copy is None or durable_tokens <= copy.durable_tokens:
            return
        copy.durable_tokens = durable_tokens
        slot = self._slot[holder_id]
        durable_bytes = durable_tokens * self.config.kv_bytes_per_token
        if durable_bytes > copy.reserved_bytes:
            self._add_reserved(slot, durable_bytes - copy.reserved_bytes)
            copy.reserved_bytes = durable_bytes
        if durable_tokens > copy.counted_tokens:
            self._held[slot] += durable_tokens - copy.counted_tokens
            copy.counted_tokens = durable_tokens
            self._touch(slot)

    def _on_checkpoint_released(self, event: CheckpointReleased) -> None:
        request_id = check_int("request_id", event.request_id)
        if request_id in self._requests:
            self.release_reservation(request_id)

    def _on_checkpoint_dropped(self, event: CheckpointEvicted | CheckpointRefused) -> None:
        request_id = check_int("request_id", event.request_id)
        holder_id = check_int("holder_id", event.holder_id)
        request = self._requests.get(request_id)
        if request is not None and holder_id in request.copies:
            self._drop_copy(request, request_id, holder_id)

    def _on_checkpoint_refused(self, event: CheckpointRefused) -> None:
        self._on_checkpoint_dropped(event)
        request = self._requests.get(event.request_id)
        if request is not None:
            request.refused_ids.add(event.holder_id)

    # ---- queries -------------------------------------------------------------------------
    def load(self, worker_id: int) -> float:
        """``L(w)`` in queue-equivalents (meaningful for serving workers)."""
        return float(self._load[self._slot_of(check_int("worker_id", worker_id))])

    def live_worker_ids(self) -> list[int]:
        """Ids of the serving workers (not failed, not recovering), sorted."""
        return list(self._live_ids)

    def worker_ids(self) -> list[int]:
        """Ids of every worker the monitor knows, in any state, sorted."""
        return [int(w) for w in self._ids[: self._n]]

    def state(self, worker_id: int) -> WorkerState:
        """The worker's state."""
        return self._state[self._slot_of(check_int("worker_id", worker_id))]

    def worker(self, worker_id: int) -> WorkerView:
        slot = self._slot_of(check_int("worker_id", worker_id))
        return WorkerView(
            worker_id=int(worker_id),
            state=self._state[slot],
            domain=self._domain_name[slot],
            budget_bytes=self._budget[slot],
            reserved_bytes=self._reserved[slot],
            held_tokens=self._held[slot],
            num_running=self._running[slot],
            num_waiting=self._waiting[slot],
        )

    def request(self, request_id: int) -> RequestView:
        request = self._request_of(check_int("request_id", request_id))
        return RequestView(
            request_id=int(request_id),
            worker_id=request.worker_id,
            prompt_tokens=request.prompt_tokens,
            expected_output_tokens=request.expected_output_tokens,
            holder_ids=tuple(request.copies),
            durable_tokens=tuple((h, c.durable_tokens) for h, c in request.copies.items()),
            lost_holder_ids=tuple(request.lost_ids),
        )

    def request_footprint(self, request_id: int) -> tuple[int, int, tuple[int, ...]]:
        """(serving worker id, expected tokens = prompt + expected output, holder ids): what
        placement needs, without building a RequestView."""
        request = self._request_of(check_int("request_id", request_id))
        return (
            request.worker_id,
            request.prompt_tokens + request.expected_output_tokens,
            tuple(request.copies),
        )

    def has_request(self, request_id: int) -> bool:
        return check_int("request_id", request_id) in self._requests

    def request_ids(self) -> list[int]:
        """Ids of every tracked request, sorted."""
        return sorted(self._requests)

    def running_on(self, worker_id: int) -> list[int]:
        """Request ids assigned to the worker (interrupted ones, if it failed), sorted."""
        self._slot_of(check_int("worker_id", worker_id))
        return sorted(self._running_ids[int(worker_id)])

    def held_by(self, worker_id: int) -> list[int]:
        """Request ids whose checkpoint this worker holds, sorted."""
        self._slot_of(check_int("worker_id", worker_id))
        return sorted(self._held_ids[int(worker_id)])

    def affected_by(self, worker_id: int) -> list[int]:
        """Request ids that ran on this worker or had a checkpoint copy on it when it failed
        (cleared when it rejoins), sorted; includes requests that have finished since."""
        self._slot_of(check_int("worker_id", worker_id))
        return sorted(self._affected_ids.get(int(worker_id), ()))

    def refused_by(self, request_id: int) -> frozenset[int]:
        """Holders that refused this request's checkpoint (placement avoids them)."""
        refused_ids = self._request_of(check_int("request_id", request_id)).refused_ids
        return frozenset(refused_ids) if refused_ids else _NOTHING

    def mean_load(self) -> float:
        """Mean ``L`` over the serving workers (0.0 when none)."""
        live = self._live[: self._n]
        if not live.any():
            return 0.0
        return float(self._load[: self._n][live].mean())

    def mean_load_before_failure(self, worker_id: int) -> float:
        """Mean ``L`` over the serving workers just before ``worker_id`` last failed.

        Raises ValueError if the worker has not failed since it last joined.
        """
        worker_id = check_int("worker_id", worker_id)
        self._slot_of(worker_id)
        if worker_id not in self._mean_before_failure:
            raise ValueError(f"`worker_id` must be a worker that failed, got {worker_id}")
        return self._mean_before_failure[worker_id]

    def free_bytes(self, worker_id: int) -> int:
        """Budget minus reservations of the worker (may be negative after accepted growth)."""
        slot = self._slot_of(check_int("worker_id", worker_id))
        return self._budget[slot] - self._reserved[slot]

    def shares_domain(self, worker_id: int, other_id: int) -> bool:
        """Whether two distinct workers are in one failure domain ("" is a domain of its own)."""
        slot = self._slot_of(check_int("worker_id", worker_id))
        other = self._slot_of(check_int("other_id", other_id))
        return slot != other and self._domain[slot] == self._domain[other]

    def least_loaded(
        self,
        *,
        exclude: Collection[int] = (),
        min_free_bytes: int = 0,
        avoid_domains_of: Collection[int] = (),
    ) -> int | None:
        """Serving worker with the lowest ``L`` (ties: lowest id), or None if none qualifies.

        exclude: worker ids never chosen. min_free_bytes: only workers with at least this many
        free budget bytes. avoid_domains_of: prefer workers sharing no failure domain with any
        of these workers; fall back to the others when no such worker qualifies.
        O(workers) in numpy, O(1) Python work per argument.
        """
        n = self._n
        if n == 0:
            return None
        shared_codes = self._shared_domain_codes(avoid_domains_of) if avoid_domains_of else []
        # Fast path: the unfiltered argmin (lowest id among ties) usually qualifies.
        slot = int(self._avail[:n].argmin())
        worker_id = int(self._ids[slot])
        if (
            self._avail[slot] != np.inf
            and worker_id not in exclude
            and self._budget[slot] - self._reserved[slot] >= min_free_bytes
            and int(self._domain[slot]) not in shared_codes
        ):
            return worker_id
        if min_free_bytes > 0:
            masked = np.where(self._free[:n] >= min_free_bytes, self._avail[:n], np.inf)
        else:
            masked = self._avail[:n].copy()
        for worker_id in exclude:
            excluded_slot = self._slot.get(worker_id)
            if excluded_slot is not None:
                masked[excluded_slot] = np.inf
        if shared_codes:
            domains = self._domain[:n]
            conflict = domains == shared_codes[0]
            for code in shared_codes[1:]:
                conflict |= domains == code
            preferred = np.where(conflict, np.inf, masked)
            slot = int(preferred.argmin())
            if preferred[slot] != np.inf:
                return int(self._ids[slot])
        slot = int(masked.argmin())
        if masked[slot] == np.inf:
            return None
        return int(self._ids[slot])

    def _shared_domain_codes(self, worker_ids: Collection[int]) -> list[int]:
        """Domain codes of these workers that some other worker shares."""
        codes = {int(self._domain[self._slot[w]]) for w in worker_ids if w in self._slot}
        return [code for code in codes if self._domain_size[code] > 1]

    def max_free_bytes(self, *, exclude: Collection[int] = ()) -> int:
        """Largest free budget over serving workers outside ``exclude`` (0 when none)."""
        n = self._n
        free = np.where(self._live[:n], self._free[:n], 0)
        for worker_id in exclude:
            slot = self._slot.get(worker_id)
            if slot is not None:
                free[slot] = 0
        return int(free.max()) if n else 0

    # ---- decisions the coordinator applies -----------------------------------------------
    def assign(self, request_id: int, worker_id: int) -> None:
        """Move a request's accounting to a serving worker (Q -1 on the old one, +1 on it).

        A copy the new worker held is dropped: a worker never holds a checkpoint of a request
        it serves (a restore consumes it). Other copies stay valid: the KV of a prefix does not
        depend on which worker computes it. Raises ValueError if the worker is not serving.
        """
        request_id = check_int("request_id", request_id)
        worker_id = check_int("worker_id", worker_id)
        request = self._request_of(request_id)
        slot = self._serving_slot(worker_id)
        if request.worker_id == worker_id:
            return
        if worker_id in request.copies:
            self._drop_copy(request, request_id, worker_id)
        self._leave(request_id, request.worker_id)
        request.worker_id = worker_id
        self._running_ids[worker_id].add(request_id)
        self._running[slot] += 1
        self._touch(slot)

    def reserve(self, request_id: int, holder_ids: Collection[int], reserved_bytes: int) -> None:
        """Reserve ``reserved_bytes`` on each holder for a copy of the request's checkpoint.

        Raises ValueError if a holder is not serving, is the request's serving worker,
        already holds a copy, is listed twice, or lacks the free budget; nothing is reserved
        then.
        """
        request_id = check_int("request_id", request_id)
        request = self._request_of(request_id)
        reserved_bytes = check_int("reserved_bytes", reserved_bytes, low=0)
        if not isinstance(holder_ids, (tuple, list)):
            raise TypeError(f"`holder_ids` must be a tuple or list, got {type(holder_ids).__name__}")
        holders = [check_int("holder_ids", h) for h in holder_ids]
        if len(holders) > 1 and len(set(holders)) != len(holders):
            raise ValueError(f"`holder_ids` must be distinct, got {holders}")
        slots = []
        for holder_id in holders:
            slot = self._serving_slot(holder_id)
            if holder_id == request.worker_id:
                raise ValueError(
                    f"holder_ids must not contain the serving worker, got {holder_id} "
                    f"for request {request_id}"
                )
            if holder_id in request.copies:
                raise ValueError(f"`holder_ids` must be new holders, got {holder_id} (already holds)")
            free_bytes = self._budget[slot] - self._reserved[slot]
            if free_bytes < reserved_bytes:
                raise ValueError(
                    f"reserved_bytes must fit the holder's free budget, got {reserved_bytes} "
                    f"> {free_bytes} free on worker {holder_id}"
                )
            slots.append(slot)
        counted = request.prompt_tokens
        for holder_id, slot in zip(holders, slots):
            request.copies[holder_id] = _Copy(reserved_bytes, counted)
            self._held_ids[holder_id].add(request_id)
            self._add_reserved(slot, reserved_bytes)
            self._held[slot] += counted
            self._touch(slot)

    def release_reservation(self, request_id: int) -> None:
        """Drop every checkpoint copy of the request (its reservations and held tokens)."""
        request_id = check_int("request_id", request_id)
        request = self._request_of(request_id)
        for holder_id in list(request.copies):
            self._drop_copy(request, request_id, holder_id)

    # ---- internals -----------------------------------------------------------------------
    def _touch(self, slot: int) -> None:
        # Recomputed from integers every time, so L never drifts and ties stay exact.
        load = self._held_weight * self._held[slot] + self._beta * (self._running[slot] + self._waiting[slot])
        self._load[slot] = load
        self._avail[slot] = load if self._state[slot] == WorkerState.SERVING else np.inf

    def _add_reserved(self, slot: int, delta_bytes: int) -> None:
        reserved = self._reserved[slot] + delta_bytes
        self._reserved[slot] = reserved
        self._free[slot] = self._budget[slot] - reserved

    def _drop_copy(self, request: _Request, request_id: int, holder_id: int) -> None:
        copy = request.copies.pop(holder_id)
        slot = self._slot[holder_id]
        self._held_ids[holder_id].discard(request_id)
        self._add_reserved(slot, -copy.reserved_bytes)
        self._held[slot] -= copy.counted_tokens
        self._touch(slot)

    def _leave(self, request_id: int, worker_id: int) -> None:
        slot = self._slot[worker_id]
        self._running_ids[worker_id].discard(request_id)
        if self._running[slot] > 0:
            self._running[slot] -= 1
        elif self._waiting[slot] > 0:
            self._waiting[slot] -= 1
        self._touch(slot)

    def _slot_of(self, worker_id: int) -> int:
        slot = self._slot.get(worker_id)
        if slot is None:
            raise IndexError(f"worker_id {worker_id} is not a known worker")
        return slot

    def _serving_slot(self, worker_id: int) -> int:
        slot = self._slot_of(worker_id)
        if self._state[slot] != WorkerState.SERVING:
            raise ValueError(f"`worker_id` must be a serving worker, got {worker_id} ({self._state[slot]})")
        return slot

    def _request_of(self, request_id: int) -> _Request:
        request = self._requests.get(request_id)
        if request is None:
            raise IndexError(f"request_id {request_id} is not a tracked request")
        return request

    def _new_slot(self, worker_id: int) -> int:
        n = self._n
        position = int(np.searchsorted(self._ids[:n], worker_id))
        if len(self._ids) == n:
            capacity = max(8, 2 * n)
            for name in ("_ids", "_load", "_avail", "_free", "_live", "_domain"):
                old = getattr(self, name)
                grown = np.zeros(capacity, dtype=old.dtype)
                grown[:n] = old[:n]
                setattr(self, name, grown)
        for name in ("_ids", "_load", "_avail", "_free", "_live", "_domain"):
            array = getattr(self, name)
            array[position + 1 : n + 1] = array[position:n].copy()
        self._ids[position] = worker_id
        self._state.insert(position, WorkerState.FAILED)
        self._domain_name.insert(position, "")
        for name in ("_budget", "_reserved", "_held", "_running", "_waiting"):
            getattr(self, name).insert(position, 0)
        self._n = n + 1
        if position < n:
            self._slot = {int(w): s for s, w in enumerate(self._ids[: self._n])}
        else:
            self._slot[worker_id] = position
        self._running_ids[worker_id] = set()
        self._held_ids[worker_id] = set()
        return position

    def _set_domain(self, slot: int, worker_id: int, domain: str) -> None:
        # "" is a domain of its own: a unique negative code per worker.
        code = self._domain_code.setdefault(domain, len(self._domain_code)) if domain else -1 - worker_id
        self._domain_name[slot] = domain
        self._domain[slot] = code
        self._domain_size[code] = self._domain_size.get(code, 0) + 1

    def _remove_domain(self, slot: int) -> None:
        self._domain_size[int(self._domain[slot])] -= 1
