"""Checkpoint placement (mechanism 1, Algorithm 1) and its baselines.

``LoadAware`` (LUMEN) puts a request's checkpoint on ``argmin_{w != w_r} L(w)``;
``FixedNeighbour`` (FC, DejaVu) on the next live worker in id order; ``NoCheckpoint`` (S&R)
nowhere. A placement reserves the checkpoint's expected size, ``(prompt + expected output)
* kv_bytes_per_token``, on every holder it picks, so ``sum |KV_r| <= M_budget(w)`` holds; a
checkpoint that fits no candidate is not placed and the request alone degrades to re-prefill.
Beyond the paper: ``replicas`` distinct holders, failure domains (a holder shares no domain
with the serving worker when another candidate fits), and re-placement of the checkpoints a
dead holder held.
"""

from __future__ import annotations

import bisect
from abc import ABC, abstractmethod
from dataclasses import dataclass

from lumen_core.policy.events import PlacementDecision, WorkerState
from lumen_core.policy.load import LoadMonitor, check_id


@dataclass(frozen=True)
class PlacementConfig:
    """replicas: distinct holders per checkpoint (1 = the paper; 2 survives a holder loss).
    respect_domains: never put a holder in the serving worker's failure domain (rack) while
    a candidate outside it fits; when none does, the domain is shared and the reason says so.
    """

    replicas: int = 1
    respect_domains: bool = True

    def __post_init__(self) -> None:
        if isinstance(self.replicas, bool) or not isinstance(self.replicas, int) or self.replicas < 1:
            raise ValueError(f"replicas must be an int >= 1, got {self.replicas!r}")
        if not isinstance(self.respect_domains, bool):
            raise TypeError(f"respect_domains must be a bool, got {type(self.respect_domains).__name__}")


def _check_monitor(monitor: object) -> LoadMonitor:
    if not isinstance(monitor, LoadMonitor):
        raise TypeError(f"monitor must be a LoadMonitor, got {type(monitor).__name__}")
    return monitor


class Placement(ABC):
    """Chooses checkpoint holders and reserves their budget in the monitor.

    ``place`` tops a request up to ``replicas`` holders; ``replace`` does so for every request
    a failed worker affected (it held their checkpoint, or served them and they were re-routed
    without one). Both mutate the monitor (reservations) and return decisions that carry a
    human-readable reason. Raise TypeError for a non-LoadMonitor monitor or non-int id,
    IndexError for an unknown request or worker, ValueError when the request's serving worker
    is not serving (place) or the worker is not failed (replace).
    """

    name: str = ""

    def __init__(self, config: PlacementConfig = PlacementConfig()) -> None:
        if not isinstance(config, PlacementConfig):
            raise TypeError(f"config must be a PlacementConfig, got {type(config).__name__}")
        self.config = config

    def place(self, monitor: LoadMonitor, request_id: int) -> PlacementDecision:
        """Choose and reserve holders for an admitted request (up to ``replicas`` in all)."""
        monitor = _check_monitor(monitor)
        request_id = check_id("request_id", request_id)
        serving_id, expected_tokens, holder_ids = monitor.request_footprint(request_id)
        state = monitor.state(serving_id)
        if state != WorkerState.SERVING:
            raise ValueError(
                f"request_id must be a request on a serving worker, got {request_id} "
                f"on worker {serving_id} ({state})"
            )
        return self._place(monitor, request_id, serving_id, expected_tokens, holder_ids)

    def replace(self, monitor: LoadMonitor, lost_holder_id: int) -> list[PlacementDecision]:
        """Re-place the checkpoints lost with a failed worker, in request id order.

        Call after ``Router.route`` for the same worker: requests it held checkpoints of, and
        requests re-routed from it that are left with fewer than ``replicas`` holders, get new
        holders (streamed in full from their serving worker). Requests that finished, still
        sit on a dead worker, or already have enough holders get no decision.
        """
        monitor = _check_monitor(monitor)
        lost_holder_id = check_id("lost_holder_id", lost_holder_id)
        state = monitor.state(lost_holder_id)
        if state == WorkerState.SERVING:
            raise ValueError(f"lost_holder_id must be a failed worker, got {lost_holder_id} (serving)")
        decisions = []
        for request_id in monitor.affected_by(lost_holder_id):
            if not monitor.has_request(request_id):
                continue
            serving_id, expected_tokens, holder_ids = monitor.request_footprint(request_id)
            if len(holder_ids) >= self.config.replicas or monitor.state(serving_id) != WorkerState.SERVING:
                continue
            decisions.append(self._place(monitor, request_id, serving_id, expected_tokens, holder_ids))
        return decisions

    def _place(
        self,
        monitor: LoadMonitor,
        request_id: int,
        serving_id: int,
        expected_tokens: int,
        holder_ids: tuple[int, ...],
    ) -> PlacementDecision:
        needed = self.config.replicas - len(holder_ids)
        if needed <= 0:
            return PlacementDecision(
                request_id,
                serving_id,
                holder_ids,
                0,
                f"{self.name}: already has {len(holder_ids)} of {self.config.replicas} holders",
            )
        size_bytes = expected_tokens * monitor.config.kv_bytes_per_token
        chosen, reason = self._choose(monitor, request_id, serving_id, holder_ids, needed, size_bytes)
        if chosen:
            monitor.reserve(request_id, chosen, size_bytes)
        return PlacementDecision(
            request_id,
            serving_id,
            holder_ids + tuple(chosen),
            size_bytes if chosen else 0,
            f"{self.name}: {reason}",
            tuple(chosen),
        )

    @abstractmethod
    def _choose(
        self,
        monitor: LoadMonitor,
        request_id: int,
        serving_id: int,
        holder_ids: tuple[int, ...],
        needed: int,
        size_bytes: int,
    ) -> tuple[list[int], str]:
        """Return up to ``needed`` new holders (each with ``size_bytes`` free) and the reason."""

    def _domain_note(self, monitor: LoadMonitor, serving_id: int, holder_id: int) -> str:
        if self.config.respect_domains and monitor.shares_domain(holder_id, serving_id):
            domain = monitor.worker(holder_id).domain
            return f" (shares domain {domain!r} with serving worker {serving_id}: no other candidate fits)"
        return ""


class NoCheckpoint(Placement):
    """Stop-and-Restart: no checkpoints; every interrupted request is re-prefilled."""

    name = "S&R"

    def _choose(
        self,
        monitor: LoadMonitor,
        request_id: int,
        serving_id: int,
        holder_ids: tuple[int, ...],
        needed: int,
        size_bytes: int,
    ) -> tuple[list[int], str]:
        return [], "not checkpointed (stop-and-restart keeps no checkpoints)"

    def replace(self, monitor: LoadMonitor, lost_holder_id: int) -> list[PlacementDecision]:
        """S&R holds nothing, so nothing is re-placed (arguments are still validated)."""
        monitor = _check_monitor(monitor)
        monitor.worker(check_id("lost_holder_id", lost_holder_id))
        return []


class FixedNeighbour(Placement):
    """Fixed-Checkpointing (DejaVu): worker ``i`` streams to ``i+1 mod N`` among live workers.

    With ``replicas = 2`` the next two live workers; with domains, the next live workers
    outside the serving worker's domain (if any). Fixed means fixed: a neighbour without room
    is not replaced by another worker, that copy is not kept.
    """

    name = "FC"

    def _choose(
        self,
        monitor: LoadMonitor,
        request_id: int,
        serving_id: int,
        holder_ids: tuple[int, ...],
        needed: int,
        size_bytes: int,
    ) -> tuple[list[int], str]:
        skip = {serving_id, *holder_ids, *monitor.refused_by(request_id)}
        live_ids = monitor.live_worker_ids()
        start = bisect.bisect_right(live_ids, serving_id)
        outside: list[int] = []
        inside: list[int] = []  # same domain as the serving worker: used only to fill up
        for w in live_ids[start:] + live_ids[:start]:
            if w in skip:
                continue
            if self.config.respect_domains and monitor.shares_domain(w, serving_id):
                inside.append(w)
                continue
            outside.append(w)
            if len(outside) == needed:
                break
        neighbours = (outside + inside)[:needed]
        if not neighbours:
            return [], f"not checkpointed: no live neighbour of worker {serving_id}; re-prefill on failure"
        chosen = [w for w in neighbours if monitor.free_bytes(w) >= size_bytes]
        full = [w for w in neighbours if w not in chosen]
        parts = [
            f"neighbour {w} of worker {serving_id}{self._domain_note(monitor, serving_id, w)}" for w in chosen
        ]
        parts += [
            f"neighbour {w} is full ({monitor.free_bytes(w)} of {size_bytes} bytes free), copy not kept"
            for w in full
        ]
        if not chosen:
            parts.append("not checkpointed: re-prefill on failure")
        return chosen, "; ".join(parts)


class LoadAware(Placement):
    """LUMEN (Algorithm 1): the least-loaded live worker other than the serving one.

    ``h_r = argmin_{w != w_r} L(w)`` over serving workers with room for the expected size,
    ties broken by the lowest worker id, outside the serving worker's domain when possible.
    Holders that refused this request are skipped. O(workers) numpy work per holder.
    """

    name = "LUMEN"

    def _choose(
        self,
        monitor: LoadMonitor,
        request_id: int,
        serving_id: int,
        holder_ids: tuple[int, ...],
        needed: int,
        size_bytes: int,
    ) -> tuple[list[int], str]:
        exclude = {serving_id, *holder_ids, *monitor.refused_by(request_id)}
        avoid = (serving_id,) if self.config.respect_domains else ()
        chosen: list[int] = []
        parts = []
        for _ in range(needed):
            holder_id = monitor.least_loaded(
                exclude=exclude, min_free_bytes=size_bytes, avoid_domains_of=avoid
            )
            if holder_id is None:
                largest = monitor.max_free_bytes(exclude=exclude)
                parts.append(
                    f"no live worker outside {sorted(exclude)} has {size_bytes} bytes free "
                    f"(largest free: {largest}); "
                    + ("copy not kept" if chosen or holder_ids else "not checkpointed, re-prefill on failure")
                )
                break
            parts.append(
                f"least-loaded worker {holder_id} (L={monitor.load(holder_id):.3f})"
                f"{self._domain_note(monitor, serving_id, holder_id)}"
            )
            chosen.append(holder_id)
            exclude.add(holder_id)
        return chosen, "; ".join(parts)
