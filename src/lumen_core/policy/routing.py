"""Recovery routing (mechanism 2, Algorithm 2) and its baselines.

At a failure every request that ran on the failed worker gets exactly one decision, in
request id order, and the monitor is updated after each one (``assign``: Q +1 on the target;
a restore also consumes the target's copy), so later decisions see the load earlier ones
added. ``Rebalance`` (S&R) re-prefills everything on the least-loaded survivor;
``AllToHolder`` (FC) restores everything on its holder; ``LocalityAware`` (LUMEN) restores on
the holder if ``L(h) <= theta`` or ``|C_r| > tau``, otherwise re-prefills on the least-loaded
survivor and drops the checkpoint. A request whose holders are all dead, or whose checkpoint
is missing, evicted, refused, stale or empty, is re-prefilled on the least-loaded survivor.

``Router.move`` decides for one request whose worker is alive (a planned drain, later a
rebalance) by the same rule, with theta over the workers serving now; the request's own
worker is never its target.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

from lumen_core._validate import check_bool, check_instance, check_int, check_number
from lumen_core.policy.events import RecoveryAction, RouteDecision, WorkerState
from lumen_core.policy.load import LoadMonitor, RequestView


@dataclass(frozen=True)
class RouterConfig:
    """theta_multiple: theta = theta_multiple * mean L (queue-equivalents) before the failure.
    tau_tokens: a checkpointed prefix longer than this is restored on its holder whatever
        the holder's load (re-prefilling it would cost more than queueing there).
    remote_restore: beyond the paper: when the holder is over theta and the prefix is over
        tau, let the least-loaded survivor pull the checkpoint if the pull is cheaper than a
        re-prefill of the prefix.
    reprefill_tokens_per_s: prefill throughput of a survivor (tokens/s), for that comparison.
    pull_bytes_per_s: holder -> survivor bandwidth (bytes/s; 25 Gb/s NIC by default).
    """

    theta_multiple: float = 2.0
    tau_tokens: int = 512
    remote_restore: bool = False
    reprefill_tokens_per_s: float = 8000.0
    pull_bytes_per_s: float = 3.125e9

    def __post_init__(self) -> None:
        check_number("theta_multiple", self.theta_multiple, low=0)
        check_int("tau_tokens", self.tau_tokens, low=0)
        check_bool("remote_restore", self.remote_restore)
        check_number("reprefill_tokens_per_s", self.reprefill_tokens_per_s, positive=True)
        check_number("pull_bytes_per_s", self.pull_bytes_per_s, positive=True)


def usable_copies(request: RequestView) -> tuple[list[tuple[int, int]], str]:
    """(holder_id, durable_tokens) of the request's copies a restore can use, and, when there
    is none, why: its holders died, it has no checkpoint, or its copies are empty.

    The monitor keeps copies only on serving holders (a failed holder's copies are dropped
    with it, and reports about a copy it no longer records, stale ones, are ignored), so
    every recorded copy with durable tokens is usable.
    """
    usable = [(h, d) for h, d in request.durable_tokens if d > 0]
    if usable:
        return usable, ""
    if request.durable_tokens:
        return [], "checkpoint empty (no durable tokens yet)"
    if request.lost_holder_ids:
        return [], f"no checkpoint: holders {list(request.lost_holder_ids)} died with it"
    return [], "no checkpoint (not placed, released, evicted or refused)"


class Router(ABC):
    """Decides where each interrupted request of a failed worker resumes.

    ``route`` returns one decision per request that ran on the worker, in request id order,
    and mutates the monitor after each (assign; a re-prefill also releases the request's
    checkpoint copies). Raises TypeError for a non-LoadMonitor monitor or non-int id,
    IndexError for an unknown worker, ValueError when the worker is serving or when
    requests need a target and no worker is serving.
    """

    name: str = ""

    def route(self, monitor: LoadMonitor, failed_worker_id: int) -> list[RouteDecision]:
        check_instance("monitor", monitor, LoadMonitor)
        failed_worker_id = check_int("failed_worker_id", failed_worker_id)
        state = monitor.state(failed_worker_id)
        if state == WorkerState.SERVING:
            raise ValueError(f"`failed_worker_id` must be a failed worker, got {failed_worker_id} (serving)")
        request_ids = monitor.running_on(failed_worker_id)
        if request_ids and not monitor.live_worker_ids():
            raise ValueError(
                f"`monitor` must have a serving worker to route {len(request_ids)} requests to, got none"
            )
        self._begin(monitor, failed_worker_id)
        decisions = []
        for request_id in request_ids:
            decision = self._decide(monitor, monitor.request(request_id))
            if decision.action is RecoveryAction.REPREFILL:
                monitor.release_reservation(request_id)
            monitor.assign(request_id, decision.target_worker_id)
            decisions.append(decision)
        return decisions

    def move(self, monitor: LoadMonitor, request_id: int, *, reprefill: bool = False) -> RouteDecision:
        """One decision for one running request moved off the worker it runs on (alive:
        draining, or serving), mutating the monitor as ``route`` does. ``reprefill``: skip the
        checkpoint (a drain's deadline passed), re-prefill on the least-loaded other worker.
        Raises TypeError for a non-LoadMonitor monitor or non-int id, IndexError for an
        unknown request, ValueError when no other worker is serving."""
        check_instance("monitor", monitor, LoadMonitor)
        check_bool("reprefill", reprefill)
        request = monitor.request(check_int("request_id", request_id))
        if monitor.least_loaded(exclude=(request.worker_id,)) is None:
            raise ValueError(
                f"`monitor` must have a serving worker other than {request.worker_id} to move "
                f"request {request_id} to, got none"
            )
        self._begin_move(monitor)
        if reprefill:
            decision = self._reprefill(monitor, request, "moved without its checkpoint")
        else:
            decision = self._decide(monitor, request)
        if decision.action is RecoveryAction.REPREFILL:
            monitor.release_reservation(request_id)
        monitor.assign(request_id, decision.target_worker_id)
        return decision

    def _begin(self, monitor: LoadMonitor, failed_worker_id: int) -> None:  # noqa: B027 (optional hook)
        """Hook run once per failure before the first decision (LocalityAware sets theta)."""

    def _begin_move(self, monitor: LoadMonitor) -> None:  # noqa: B027 (optional hook)
        """Hook run before a ``move`` decision (LocalityAware sets theta from the load now)."""

    @abstractmethod
    def _decide(self, monitor: LoadMonitor, request: RequestView) -> RouteDecision:
        """One decision for one interrupted request; the monitor reflects earlier ones."""

    def _reprefill(self, monitor: LoadMonitor, request: RequestView, why: str) -> RouteDecision:
        # A request is never re-prefilled where it runs (a moved one's worker is alive).
        target_id = monitor.least_loaded(exclude=(request.worker_id,))
        assert target_id is not None  # route() and move() checked that a worker is serving
        return RouteDecision(
            request.request_id,
            target_id,
            RecoveryAction.REPREFILL,
            None,
            0,
            f"{self.name}: {why}; re-prefill on least-loaded survivor {target_id} "
            f"(L={monitor.load(target_id):.3f})",
        )


class Rebalance(Router):
    """Stop-and-Restart: every interrupted request re-prefills on the least-loaded survivor."""

    name = "S&R"

    def _decide(self, monitor: LoadMonitor, request: RequestView) -> RouteDecision:
        return self._reprefill(monitor, request, "stop-and-restart keeps no checkpoint")


class AllToHolder(Router):
    """Fixed-Checkpointing: every interrupted request restores on its holder, whatever its load.

    With several usable copies: the longest, then the lowest holder id. Without one:
    re-prefill on the least-loaded survivor.
    """

    name = "FC"

    def _decide(self, monitor: LoadMonitor, request: RequestView) -> RouteDecision:
        usable, why = usable_copies(request)
        if not usable:
            return self._reprefill(monitor, request, why)
        holder_id, durable_tokens = min(usable, key=lambda c: (-c[1], c[0]))
        return RouteDecision(
            request.request_id,
            holder_id,
            RecoveryAction.RESTORE,
            holder_id,
            durable_tokens,
            f"FC: restore {durable_tokens} tokens on holder {holder_id}",
        )


class LocalityAware(Router):
    """LUMEN (Algorithm 2): restore on the holder if ``L(h) <= theta`` or ``|C_r| > tau``.

    ``theta = theta_multiple * mean L`` over the workers serving just before the failure.
    Among usable copies, those on holders with ``L <= theta`` are preferred (longest prefix,
    then lowest L, then lowest id); otherwise the longest copy decides: over tau it restores
    on its holder (or, with ``remote_restore``, is pulled by the least-loaded survivor when
    that is cheaper than re-prefilling it), else it is dropped and the request re-prefills on
    the least-loaded survivor.
    """

    name = "LUMEN"

    def __init__(self, config: RouterConfig = RouterConfig()) -> None:
        check_instance("config", config, RouterConfig)
        self.config = config
        self._theta = 0.0

    def _begin(self, monitor: LoadMonitor, failed_worker_id: int) -> None:
        self._theta = self.config.theta_multiple * monitor.mean_load_before_failure(failed_worker_id)

    def _begin_move(self, monitor: LoadMonitor) -> None:
        self._theta = self.config.theta_multiple * monitor.mean_load()

    def _decide(self, monitor: LoadMonitor, request: RequestView) -> RouteDecision:
        usable, why = usable_copies(request)
        if not usable:
            return self._reprefill(monitor, request, why)
        theta = self._theta
        tau = self.config.tau_tokens
        loads = {h: monitor.load(h) for h, _ in usable}
        below = [c for c in usable if loads[c[0]] <= theta]
        if below:
            holder_id, durable_tokens = min(below, key=lambda c: (-c[1], loads[c[0]], c[0]))
            return RouteDecision(
                request.request_id,
                holder_id,
                RecoveryAction.RESTORE,
                holder_id,
                durable_tokens,
                f"LUMEN: restore {durable_tokens} tokens on holder {holder_id}: "
                f"L={loads[holder_id]:.3f} <= theta={theta:.3f}",
            )
        holder_id, durable_tokens = min(usable, key=lambda c: (-c[1], loads[c[0]], c[0]))
        if durable_tokens <= tau:
            return self._reprefill(
                monitor,
                request,
                f"holder {holder_id} overloaded (L={loads[holder_id]:.3f} > theta={theta:.3f}) "
                f"and prefix short ({durable_tokens} <= tau={tau} tokens): checkpoint dropped",
            )
        overload = (
            f"|C_r|={durable_tokens} > tau={tau} tokens (holder L={loads[holder_id]:.3f} > theta={theta:.3f})"
        )
        if self.config.remote_restore:
            remote = self._remote(monitor, request, holder_id, durable_tokens, overload)
            if remote is not None:
                return remote
        return RouteDecision(
            request.request_id,
            holder_id,
            RecoveryAction.RESTORE,
            holder_id,
            durable_tokens,
            f"LUMEN: restore {durable_tokens} tokens on holder {holder_id}: {overload}",
        )

    def _remote(
        self, monitor: LoadMonitor, request: RequestView, holder_id: int, durable_tokens: int, overload: str
    ) -> RouteDecision | None:
        target_id = monitor.least_loaded(exclude=(*request.holder_ids, request.worker_id))
        if target_id is None or monitor.load(target_id) >= monitor.load(holder_id):
            return None
        pull_s = durable_tokens * monitor.config.kv_bytes_per_token / self.config.pull_bytes_per_s
        reprefill_s = durable_tokens / self.config.reprefill_tokens_per_s
        if pull_s >= reprefill_s:
            return None
        return RouteDecision(
            request.request_id,
            target_id,
            RecoveryAction.REMOTE_RESTORE,
            holder_id,
            durable_tokens,
            f"LUMEN: {overload}; least-loaded survivor {target_id} (L={monitor.load(target_id):.3f}) "
            f"pulls {durable_tokens} tokens from holder {holder_id} in {pull_s:.3f} s "
            f"< re-prefill {reprefill_s:.3f} s",
        )
