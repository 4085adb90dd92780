"""One driver of the policies: the failure protocol, assist pairing and switch-over, and
join-shortest-queue admission, written once for the gateway (``gateway.coordinator``) and the
simulator (``sim.cluster``).

``RecoveryDriver`` owns the ``LoadMonitor`` and the policy set (``presets``); it takes the
time as an argument, records every event it feeds, every policy call with its decisions and
every gain query through an injected ``Recorder`` (``lumen_core.eventlog.EventLog`` is one),
and returns plans. Callers turn plans into effects: the coordinator into directives for its
workers, the simulator into restores, re-prefills and checkpoint streams. Pure: no I/O, no
clock, no threads.

The protocol, in the order both drivers follow:
- admission: ``RequestAdmitted`` then ``place``;
- a failure of workers ``F`` detected together: for each ``w`` in ``F`` end its pairings
  (``release_survivor``, ``finish``), then ``WorkerFailed(w)`` for each; if no worker is left
  serving, their requests are parked (see below); else for each ``w``, ``route(w)``
  followed by ``place`` of every re-routed request left without a holder; then ``replace(w)``
  for each; with no worker left serving, their requests are parked instead (within the
  bounds ``park_s`` and ``max_parked``; the rest are lost), and ``unpark`` re-admits them
  once a worker serves again: restored on a worker that came back holding a copy
  (``hold_parked``: a fenced worker keeps its holder up and registers again), else
  re-prefilled on the least-loaded worker (after ``holder_wait_s`` for holders not back yet);
- a planned drain of worker ``w`` (``drain``): end its pairings, ``WorkerDraining(w)``, then
  ``replace(w)`` (the copies it held go elsewhere); then each of its requests is moved;
- a move of one running request off a live worker (``move``): ``route``'s rule for that
  request alone, then ``place`` if it is left without a holder;
- a restarted worker: ``WorkerRecovering`` then ``pair`` (again at its heartbeats while it is
  unpaired);
- its full model loaded (switch-over): ``finish`` then ``WorkerJoined``.
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from dataclasses import dataclass, replace
from typing import Protocol

from lumen_core._validate import check_int, check_number
from lumen_core.policy.assist import GainFn, make_acceptance_gain
from lumen_core.policy.events import (
    AssistDecision,
    Event,
    PlacementDecision,
    RecoveryAction,
    RequestAdmitted,
    RequestFinished,
    RouteDecision,
    WorkerDraining,
    WorkerFailed,
    WorkerJoined,
    WorkerRecovering,
    WorkerState,
)
from lumen_core.policy.load import LoadConfig, LoadMonitor
from lumen_core.policy.presets import (
    DEFAULT_ACCEPTANCE_RATE,
    DEFAULT_VERIFY_COST_PER_DRAFT_TOKEN,
    PolicyFactory,
    PolicySet,
)


class Recorder(Protocol):
    """Where a driver's events, policy calls and gain queries are written, in the order made
    (``lumen_core.eventlog.EventLog`` writes them as JSON lines a replay can check)."""

    def event(self, event: Event) -> None: ...

    def decision(self, op: str, args: dict[str, int], result: object) -> None: ...

    def gain(self, survivor_id: int, num_draft_tokens: int, value: float) -> None: ...


@dataclass(frozen=True)
class AdmissionPlan:
    """A new request's serving worker and its checkpoint placement; ``parked``: no worker
    served, it waits for ``unpark`` (``worker_id`` -1, placed nowhere)."""

    request_id: int
    worker_id: int
    placement: PlacementDecision
    parked: bool = False


@dataclass(frozen=True)
class Unpairing:
    """The assist pairings a dead worker was in, ended."""

    worker_id: int
    freed_assistant_id: int | None  # its assistant (it was a survivor), free to pair again
    freed_survivor_id: int | None  # the survivor it assisted, to stop verifying its drafts


@dataclass(frozen=True)
class Reroute:
    """One interrupted request: its route and where its checkpoint is now.

    ``placement`` is the placement made because the route left it without a holder (None when
    holders survived, or when its target is doomed); ``holder_ids`` are its holders once
    routed (and placed).
    """

    route: RouteDecision
    placement: PlacementDecision | None
    holder_ids: tuple[int, ...]


@dataclass(frozen=True)
class FailurePlan:
    """Every decision of one failure (workers detected together), in the order made."""

    time_s: float
    worker_ids: tuple[int, ...]
    unpairings: tuple[Unpairing, ...]
    reroutes: tuple[Reroute, ...]
    replacements: tuple[PlacementDecision, ...]  # checkpoints the failed workers held
    lost_request_ids: tuple[int, ...]  # no worker was left serving and parking was full
    cause: str
    parked_request_ids: tuple[int, ...] = ()  # no worker was left serving: kept for ``unpark``

    @property
    def routes(self) -> tuple[RouteDecision, ...]:
        return tuple(r.route for r in self.reroutes)

    @property
    def placements(self) -> tuple[PlacementDecision, ...]:
        """Placements of re-routed requests left without a holder."""
        return tuple(r.placement for r in self.reroutes if r.placement is not None)


@dataclass(frozen=True)
class Parked:
    """A request kept while no worker serves: what re-admitting it needs, and its deadline.
    ``holder_ids``: the workers that held durable tokens of it when it was parked (one may
    come back with its copy); ``held``: the (holder, durable tokens) copies reported since;
    ``awaited_s``: when ``unpark`` first waited for a holder to come back."""

    request_id: int
    prompt_tokens: int
    expected_output_tokens: int
    parked_s: float
    deadline_s: float
    holder_ids: tuple[int, ...] = ()
    held: tuple[tuple[int, int], ...] = ()
    awaited_s: float | None = None


@dataclass(frozen=True)
class UnparkPlan:
    """Parked requests moved to serving workers (each a restore or re-prefill ``Reroute``),
    those lost because their deadline passed, and the reported copies no move restores from
    (request id, holder id), to be released."""

    time_s: float
    reroutes: tuple[Reroute, ...]
    expired: tuple[Parked, ...]
    unused_copies: tuple[tuple[int, int], ...] = ()


@dataclass(frozen=True)
class DrainPlan:
    """The decisions of a drain's start: the pairings ended, the checkpoints the worker held
    placed again, and the requests it runs (each to be moved)."""

    time_s: float
    worker_id: int
    unpairing: Unpairing
    replacements: tuple[PlacementDecision, ...]
    request_ids: tuple[int, ...]


class RecoveryDriver:
    """The monitor, the policy set and the protocol over them; every effect is a plan.

    ``policy`` builds the policy set, given the (recorded) gain function; ``gain_fn`` prices an
    assist pairing (default: ``make_acceptance_gain`` at the presets' defaults). Raises
    TypeError when ``policy`` does not build a ``PolicySet``; the policy objects raise for bad
    ids and states (a ``place`` for a request on a non-serving worker, a ``route`` of a
    serving worker...).
    """

    def __init__(
        self,
        policy: PolicyFactory,
        load_config: LoadConfig,
        *,
        gain_fn: GainFn | None = None,
        recorder: Recorder | None = None,
        park_s: float = 0.0,
        max_parked: int = 0,
    ) -> None:
        self._park_s = check_number("park_s", park_s, low=0.0)
        self._max_parked = check_int("max_parked", max_parked, low=0)
        self._parked: dict[int, Parked] = {}  # by request id, in park order
        if gain_fn is None:
            gain_fn = make_acceptance_gain(DEFAULT_ACCEPTANCE_RATE, DEFAULT_VERIFY_COST_PER_DRAFT_TOKEN)
        self._gain_fn = gain_fn
        self._recorder = recorder
        self.monitor = LoadMonitor(load_config)
        self.policy = policy(self._recorded_gain)
        if not isinstance(self.policy, PolicySet):
            raise TypeError(f"`policy` must build a PolicySet, got {type(self.policy).__name__}")

    @property
    def assists(self) -> bool:
        """Whether the policy pairs recovering workers with survivors (LUMEN)."""
        return self.policy.planner is not None

    # ---- recording ---------------------------------------------------------------------------
    def _recorded_gain(self, monitor: LoadMonitor, survivor_id: int, num_draft_tokens: int) -> float:
        gain = float(self._gain_fn(monitor, survivor_id, num_draft_tokens))
        if self._recorder is not None:
            self._recorder.gain(survivor_id, num_draft_tokens, gain)
        return gain

    def _record(self, op: str, args: dict[str, int], result: object) -> None:
        if self._recorder is not None:
            self._recorder.decision(op, args, result)

    def apply(self, event: Event) -> None:
        """Feed one event to the monitor (and the recorder). Raises as ``LoadMonitor.apply``."""
        self.monitor.apply(event)
        if self._recorder is not None:
            self._recorder.event(event)

    # ---- admission ---------------------------------------------------------------------------
    def choose_worker(self, queue_depth: Callable[[int], int] | None = None) -> int | None:
        """Join-shortest-queue over the serving workers (ties: lowest id); None when none serves.

        ``queue_depth(worker_id)`` measures a queue; default: running + waiting as the last
        heartbeat reported them (what a gateway knows; the simulator passes its exact queues).
        """
        depth = self._reported_queue_depth if queue_depth is None else queue_depth
        live = self.monitor.live_worker_ids()
        if not live:
            return None
        return min(live, key=lambda w: (depth(w), w))

    def _reported_queue_depth(self, worker_id: int) -> int:
        view = self.monitor.worker(worker_id)
        return view.num_running + view.num_waiting

    def admit(
        self, now_s: float, request_id: int, worker_id: int, prompt_tokens: int, expected_output_tokens: int
    ) -> AdmissionPlan:
        """A new request runs on ``worker_id``: ``RequestAdmitted`` then ``place``."""
        self.apply(RequestAdmitted(now_s, request_id, worker_id, prompt_tokens, expected_output_tokens))
        return AdmissionPlan(request_id, worker_id, self.place(request_id))

    def place(self, request_id: int) -> PlacementDecision:
        """Top the request's checkpoint up to its replicas (after an admission or a refusal)."""
        decision = self.policy.placement.place(self.monitor, request_id)
        self._record("place", {"request_id": request_id}, [decision])
        return decision

    def finish(self, now_s: float, request_id: int) -> tuple[int, ...]:
        """The request is complete (or lost): ``RequestFinished``. Returns the holders whose
        copies are released."""
        holder_ids = self.monitor.request(request_id).holder_ids
        self.apply(RequestFinished(now_s, request_id))
        return holder_ids

    # ---- failures ----------------------------------------------------------------------------
    def fail(
        self, now_s: float, worker_ids: Collection[int], *, cause: str = "", doomed_ids: Collection[int] = ()
    ) -> FailurePlan:
        """Workers detected failed together, in the protocol's order (module docstring).

        ``doomed_ids``: workers the caller knows to be dead though no failure of theirs was
        reported yet (only the simulator knows that): a request routed to one is not placed,
        since it is lost again when that failure is detected.
        """
        failed = tuple(worker_ids)
        unpairings = tuple(self.end_pairings(w) for w in failed)
        for worker_id in failed:
            self.apply(WorkerFailed(now_s, worker_id))
        lost: list[int] = []
        parked: list[int] = []
        if not self.monitor.live_worker_ids():  # nowhere to go: park what fits, lose the rest
            for worker_id in failed:
                for request_id in self.monitor.running_on(worker_id):
                    if self._park(now_s, request_id):
                        parked.append(request_id)
                    else:
                        lost.append(request_id)
                    self.finish(now_s, request_id)
        reroutes: list[Reroute] = []
        for worker_id in failed:
            decisions = self.policy.router.route(self.monitor, worker_id)
            self._record("route", {"failed_worker_id": worker_id}, decisions)
            reroutes.extend(self._placed(decision, doomed_ids) for decision in decisions)
        replacements: list[PlacementDecision] = []
        for worker_id in failed:
            replaced = self.policy.placement.replace(self.monitor, worker_id)
            self._record("replace", {"lost_holder_id": worker_id}, replaced)
            replacements.extend(replaced)
        return FailurePlan(
            now_s, failed, unpairings, tuple(reroutes), tuple(replacements), tuple(lost), cause, tuple(parked)
        )

    # ---- parking -----------------------------------------------------------------------------
    def _park(self, now_s: float, request_id: int) -> bool:
        """Keep an interrupted request for ``unpark`` (False: parking is off or full)."""
        view = self.monitor.request(request_id)
        # Their copies were dropped as the holders failed with every other worker.
        holder_ids = tuple(view.lost_holder_ids)
        return self._keep(now_s, request_id, view.prompt_tokens, view.expected_output_tokens, holder_ids)

    def _keep(
        self,
        now_s: float,
        request_id: int,
        prompt_tokens: int,
        expected_output_tokens: int,
        holder_ids: tuple[int, ...] = (),
    ) -> bool:
        if self._park_s <= 0.0 or len(self._parked) >= self._max_parked:
            return False
        deadline_s = now_s + self._park_s
        parked = Parked(request_id, prompt_tokens, expected_output_tokens, now_s, deadline_s, holder_ids)
        self._parked[request_id] = parked
        return True

    def park_admission(
        self, now_s: float, request_id: int, prompt_tokens: int, expected_output_tokens: int
    ) -> AdmissionPlan | None:
        """A new request while no worker serves (they all failed): park it for ``unpark``, as
        an interrupted one. None when parking is off or full; ValueError when a worker serves."""
        live = self.monitor.live_worker_ids()
        if live:
            raise ValueError(f"request {request_id} must be admitted: worker {live[0]} serves")
        if not self._keep(now_s, request_id, prompt_tokens, expected_output_tokens):
            return None
        placement = PlacementDecision(request_id, -1, (), 0, "parked: no worker is serving")
        return AdmissionPlan(request_id, -1, placement, parked=True)

    @property
    def parked(self) -> tuple[Parked, ...]:
        """The requests parked now, in park order."""
        return tuple(self._parked.values())

    def forget_parked(self, request_id: int) -> Parked | None:
        """A parked request ended (its client gave up): drop it (its reported copies are the
        caller's to release). None: it was not parked."""
        return self._parked.pop(request_id, None)

    def hold_parked(self, request_id: int, holder_id: int, durable_tokens: int) -> bool:
        """A worker that registered again holds a copy of a parked request (``durable_tokens``
        at the request's epoch): ``unpark`` may restore it there. False: not parked."""
        parked = self._parked.get(request_id)
        if parked is None:
            return False
        held = (*[c for c in parked.held if c[0] != holder_id], (holder_id, durable_tokens))
        self._parked[request_id] = replace(parked, held=held)
        return True

    def unpark(self, now_s: float, holder_wait_s: float = 0.0) -> UnparkPlan:
        """Re-admit the parked requests on serving workers (none serving: only the expiry),
        placed as a failover's reroute: restored on the serving worker with the longest
        reported copy, else re-prefilled on the least-loaded one, a request whose park-time
        holders are not back yet waiting up to ``holder_wait_s`` for them first. Those past
        their deadline are lost (``RequestFinished`` was applied when parked). The
        re-admission is recorded as its ``RequestAdmitted`` event, not as a policy call: no
        policy decides it, so a replay (``lumen_core.eventlog``) has nothing to re-run."""
        check_number("holder_wait_s", holder_wait_s, low=0.0)
        lost: list[Parked] = []
        unused: list[tuple[int, int]] = []
        for parked in list(self._parked.values()):
            if now_s >= parked.deadline_s:
                del self._parked[parked.request_id]
                lost.append(parked)
                unused += [(parked.request_id, h) for h, _ in parked.held]
        reroutes: list[Reroute] = []
        live = set(self.monitor.live_worker_ids())
        for parked in list(self._parked.values()) if live else []:
            copies = [(h, durable) for h, durable in parked.held if h in live and durable > 0]
            if not copies and any(h not in live for h in parked.holder_ids):
                awaited_s = now_s if parked.awaited_s is None else parked.awaited_s
                if now_s < awaited_s + holder_wait_s:
                    self._parked[parked.request_id] = replace(parked, awaited_s=awaited_s)
                    continue
            del self._parked[parked.request_id]
            waited = f"parked {now_s - parked.parked_s:.1f} s with no worker serving"
            if copies:
                target_id, durable = min(copies, key=lambda c: (-c[1], c[0]))
                decision = RouteDecision(
                    parked.request_id,
                    target_id,
                    RecoveryAction.RESTORE,
                    target_id,
                    durable,
                    f"{waited}; restore {durable} tokens on worker {target_id}, back with its holder",
                )
            else:
                least = self.monitor.least_loaded()
                assert least is not None  # a worker serves
                target_id = least
                decision = RouteDecision(
                    parked.request_id,
                    target_id,
                    RecoveryAction.REPREFILL,
                    None,
                    0,
                    f"{waited}; re-prefill on least-loaded worker {target_id} "
                    f"(L={self.monitor.load(target_id):.3f})",
                )
            unused += [(parked.request_id, h) for h, _ in parked.held if h != decision.source_holder_id]
            self.apply(
                RequestAdmitted(
                    now_s, parked.request_id, target_id, parked.prompt_tokens, parked.expected_output_tokens
                )
            )
            reroutes.append(self._placed(decision))
        return UnparkPlan(now_s, tuple(reroutes), tuple(lost), tuple(unused))

    def _placed(self, decision: RouteDecision, doomed_ids: Collection[int] = ()) -> Reroute:
        """A routed request's reroute, placing its checkpoint if the route left it none."""
        holder_ids = self.monitor.request(decision.request_id).holder_ids
        placement = None
        if not holder_ids and decision.target_worker_id not in doomed_ids:
            placement = self.place(decision.request_id)
            holder_ids = placement.holder_ids
        return Reroute(decision, placement, holder_ids)

    # ---- drains and moves ---------------------------------------------------------------------
    def drain(self, now_s: float, worker_id: int) -> DrainPlan:
        """Take a serving worker out (module docstring's order). Raises ValueError when it is
        not serving, IndexError for an unknown worker."""
        if self.monitor.state(worker_id) != WorkerState.SERVING:
            raise ValueError(
                f"`worker_id` must be a serving worker, got {worker_id} ({self.monitor.state(worker_id)})"
            )
        unpairing = self.end_pairings(worker_id)
        self.apply(WorkerDraining(now_s, worker_id))
        replaced = self.policy.placement.replace(self.monitor, worker_id)
        self._record("replace", {"lost_holder_id": worker_id}, replaced)
        return DrainPlan(
            now_s, worker_id, unpairing, tuple(replaced), tuple(self.monitor.running_on(worker_id))
        )

    def move(self, now_s: float, request_id: int, *, reprefill: bool = False) -> Reroute:
        """Move one running request off the live worker it runs on (``Router.move``), placing
        its checkpoint if the move left it none. ``reprefill``: without its checkpoint. Raises
        as ``Router.move`` (ValueError when no other worker serves)."""
        decision = self.policy.router.move(self.monitor, request_id, reprefill=reprefill)
        self._record("move", {"request_id": request_id, "reprefill": int(reprefill)}, [decision])
        return self._placed(decision)

    # ---- assist pairing and switch-over --------------------------------------------------------
    def end_pairings(self, worker_id: int) -> Unpairing:
        """A worker is dead: unpair it from its assistant (``release_survivor``) and from the
        survivor it assisted (``finish``). ``fail`` does this first; the simulator, which
        knows a failure when it happens, calls it then."""
        planner = self.policy.planner
        freed_assistant = freed_survivor = None
        if planner is not None:
            if planner.assistant_of(worker_id) is not None:
                freed_assistant = planner.release_survivor(worker_id)
                self._record("release_survivor", {"survivor_id": worker_id}, freed_assistant)
            if planner.survivor_of(worker_id) is not None:
                freed_survivor = planner.finish(worker_id)
                self._record("finish", {"assistant_id": worker_id}, freed_survivor)
        return Unpairing(worker_id, freed_assistant, freed_survivor)

    def recover(self, now_s: float, worker_id: int) -> AssistDecision | None:
        """A failed worker restarted with its draft model: ``WorkerRecovering``, then ``pair``
        (None when the policy does not assist)."""
        self.apply(WorkerRecovering(now_s, worker_id))
        return self.pair(worker_id) if self.assists else None

    def pair(self, assistant_id: int) -> AssistDecision:
        """Pair a recovering worker with a survivor (``SpecAssistPlanner.pair``). Raises
        ValueError when the policy does not assist."""
        planner = self.policy.planner
        if planner is None:
            raise ValueError(f"`policy` must assist to pair workers, got {self.policy.name!r}")
        decision = planner.pair(self.monitor, assistant_id)
        self._record("pair", {"assistant_id": assistant_id}, [decision])
        return decision

    def survivor_of(self, assistant_id: int) -> int | None:
        """The survivor a recovering worker assists, or None."""
        planner = self.policy.planner
        return None if planner is None else planner.survivor_of(assistant_id)

    def num_draft_tokens(self, assistant_id: int, steps_done: int) -> int:
        """Draft length of a paired assistant's next step; 0 when it assists nobody."""
        planner = self.policy.planner
        if planner is None or planner.survivor_of(assistant_id) is None:
            return 0
        return planner.num_draft_tokens(assistant_id, steps_done)

    def switch_over(self, now_s: float, worker_id: int, budget_bytes: int, domain: str = "") -> int | None:
        """A recovering worker's full model is loaded: ``finish`` its pairing, then
        ``WorkerJoined`` (it serves again with L = 0). Returns the survivor freed, or None."""
        freed = None
        if self.policy.planner is not None:
            freed = self.policy.planner.finish(worker_id)
            self._record("finish", {"assistant_id": worker_id}, freed)
        self.apply(WorkerJoined(now_s, worker_id, budget_bytes, domain))
        return freed
