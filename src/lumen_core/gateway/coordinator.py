"""The gateway's decision path: one plain, single-threaded object over the policy objects.

``Coordinator`` drives the policies through ``policy.driver.RecoveryDriver`` (the simulator's
driver too: one failure protocol, one pairing and switch-over, one join-shortest-queue
admission) and keeps what only a live cluster needs: worker epochs and leases, per-request
epochs and capabilities, the tokens each request has emitted (de-duplicated by position), and
per-worker outboxes of numbered directives (``gateway.outbox``), into which it turns the
driver's plans. It takes the time
(``now_s``) as an argument and never reads a clock, opens a socket or starts a thread: the
gRPC servicer (``gateway.server``) is a thin layer over it. With an ``EventLog``
(``lumen_core.eventlog``) the driver writes every event, call and gain query in the
simulator's format.

Epochs: each registration of a worker gets a new worker epoch (above any it reports having
held); a worker whose lease expired, whose process exited, or that registered again is
failed, and its old epoch is fenced: heartbeats get ``fenced`` and token reports are refused.
Each request has an epoch too, bumped whenever it is re-routed; capabilities are bound to it.
The coordinator's ``CapabilityIssuer`` signs them with a key only the gateway holds, each for
one holder (by worker id): workers cannot mint one, so epochs advance only through here. Its
expiries are read on the issuer's wall clock, the one clock this module does not take as an
argument; when to renew them (``renew_capabilities``) is decided on ``now_s``, from when each
request's grants were last issued.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import numpy as np

from lumen_core._validate import check_int, check_number
from lumen_core.auth import CapabilityIssuer, Rights, check_secret
from lumen_core.gateway.config import GatewayConfig
from lumen_core.gateway.directives import (
    GREEDY,
    AssistDraft,
    AssistStop,
    AssistVerify,
    Cancel,
    Delivery,
    Directive,
    Flush,
    Hold,
    HolderGrant,
    Release,
    Renew,
    Resume,
    Run,
    Sampling,
    Stop,
    Stream,
)
from lumen_core.gateway.errors import StaleEpochError
from lumen_core.gateway.outbox import DirectiveOutbox
from lumen_core.gateway.protocol import bound_error
from lumen_core.gateway.renewals import RenewalQueue
from lumen_core.gateway.reports import HeldReport, RunningReport, WorkerReport
from lumen_core.metrics import RequestRecords, acceptance_rate, checkpoint_coverage, holder_balance_ratio
from lumen_core.policy.assist import GainFn
from lumen_core.policy.driver import AdmissionPlan, FailurePlan, Recorder, RecoveryDriver, Reroute
from lumen_core.policy.events import (
    AssistDecision,
    CheckpointEvicted,
    CheckpointGrew,
    CheckpointRefused,
    CheckpointReserved,
    Heartbeat,
    PlacementDecision,
    RequestAdmitted,
    RouteDecision,
    WorkerFailed,
    WorkerJoined,
    WorkerState,
)
from lumen_core.policy.load import LoadMonitor
from lumen_core.policy.presets import preset


class NoWorkerError(Exception):
    """No worker is serving: a request cannot be admitted (or re-routed)."""


@dataclass(frozen=True)
class Registration:
    worker_id: int
    epoch: int
    assist: AssistDecision | None  # the pairing made for a worker registering as recovering
    credential: bytes = b""  # signed for the identity key it registered with (none: b"")


@dataclass(frozen=True)
class LeaseStatus:
    """What a heartbeat learns about its lease."""

    fenced: bool
    reregister: bool
    reason: str


@dataclass(frozen=True)
class TokenAck:
    num_new: int
    num_conflicts: int
    next_position: int


@dataclass(frozen=True)
class GatewayMetrics:
    """The gauges the metrics endpoint exports (defined in docs/design.md, Metrics).

    coverage: fraction of running requests whose durable checkpoint covers all but the last
    16 tokens. holder_balance: max/min held checkpoint tokens over serving workers.
    acceptance: accepted / proposed draft tokens over all assist rounds reported.
    recovery_s: for the last failure, from its detection until every interrupted request
    emitted its next token (NaN while one is still waiting; the rolling-window recovery time
    of ``metrics.recovery_time_s`` needs a failure-free baseline run, which the demo has).
    """

    coverage: float
    holder_balance: float
    acceptance: float
    recovery_s: float
    replay_ttft_s: float
    num_failures: int
    num_parked: int  # requests parked now (no worker was left serving), waiting for one
    num_parked_total: int  # requests parked since the gateway started
    worker_load: dict[int, float]
    worker_queue_depth: dict[int, int]
    worker_held_bytes: dict[int, int]
    worker_state: dict[int, WorkerState]


@dataclass(frozen=True)
class DrainStatus:
    """A drain's progress. ``state``: "flushing" (waiting for the worker's flush; its
    requests still run there), "stopped" (every request moved, the worker told to stop) or
    "failed" (it died mid-drain: the failure path moved what was left). Times on the
    gateway's clock; ``finished_s`` is NaN while flushing. ``num_reprefilled``: requests
    moved without their checkpoint because the deadline passed before the flush."""

    worker_id: int
    state: str
    started_s: float
    deadline_s: float
    num_requests: int
    num_moved: int
    num_reprefilled: int
    finished_s: float


@dataclass
class _Drain:
    worker_id: int
    epoch: int  # the incarnation drained
    started_s: float
    deadline_s: float  # absolute, on the gateway's clock
    num_requests: int
    state: str = "flushing"
    num_moved: int = 0
    num_reprefilled: int = 0
    finished_s: float = math.nan

    def status(self) -> DrainStatus:
        return DrainStatus(
            self.worker_id,
            self.state,
            self.started_s,
            self.deadline_s,
            self.num_requests,
            self.num_moved,
            self.num_reprefilled,
            self.finished_s,
        )


class _Worker:
    __slots__ = (
        "worker_id",
        "epoch",
        "state",
        "lease_deadline_s",
        "holder_address",
        "num_shards",
        "bound",
        "held_bytes",
        "proposed_draft_tokens",
        "accepted_draft_tokens",
        "fence_reason",
    )

    def __init__(
        self, worker_id: int, epoch: int, address: str, num_shards: int, lease_deadline_s: float
    ) -> None:
        self.worker_id = worker_id
        self.epoch = epoch
        self.state = WorkerState.SERVING
        self.lease_deadline_s = lease_deadline_s
        self.holder_address = address
        self.num_shards = num_shards
        self.bound = False  # it proves an identity to holders: its capabilities name it
        self.held_bytes = 0
        self.proposed_draft_tokens = 0
        self.accepted_draft_tokens = 0
        self.fence_reason = ""


@dataclass
class _Request:
    request_id: int
    prompt_token_ids: tuple[int, ...]
    max_new_tokens: int
    expected_output_tokens: int
    worker_id: int
    epoch: int
    arrival_s: float
    tokens: list[int] = field(default_factory=list)
    # When the serving worker's capabilities were last issued (-inf: unknown; inf: none yet).
    granted_s: float = math.inf
    sampling: Sampling = GREEDY
    finished: bool = False
    lost: bool = False
    first_token_s: float = math.nan
    finish_s: float = math.nan
    interrupted_at_s: float = math.nan
    replay_token_s: float = math.nan
    lost_reason: str = ""
    refused: bool = False  # lost because its worker refused it (the request, not the cluster)
    failed_moves: int = 0  # moves because a worker failed it (at most MAX_FAILED_MOVES)


# A request its worker failed (the server's own error, e.g. vLLM's mid-stream internal error)
# is moved to another worker at most this many times, then lost: an error that follows the
# request from worker to worker is its own, and must not bounce it around the cluster forever.
MAX_FAILED_MOVES = 2


def _check_tokens(name: str, token_ids: Iterable[int]) -> tuple[int, ...]:
    out = tuple(token_ids)
    for token in out:
        if isinstance(token, bool) or not isinstance(token, (int, np.integer)) or token < 0:
            raise ValueError(f"{name} must hold token ids >= 0, got {token!r}")
    return out


class Coordinator:
    """Policy decisions, epochs, leases, capabilities, token de-duplication and directives.

    Not thread-safe (the server holds a lock around every call). Raises TypeError/ValueError
    for malformed arguments, IndexError for an unknown request, StaleEpochError for a fenced
    worker epoch or an outdated request epoch, NoWorkerError when nothing is serving.
    """

    def __init__(
        self,
        config: GatewayConfig,
        secret: bytes,
        *,
        gain_fn: GainFn | None = None,
        event_log: Recorder | None = None,
        first_request_id: int = 1,
        issuer: CapabilityIssuer | None = None,
    ) -> None:
        if not isinstance(config, GatewayConfig):
            raise TypeError(f"config must be a GatewayConfig, got {type(config).__name__}")
        self.config = config
        self._secret = check_secret(secret)
        if issuer is not None and not isinstance(issuer, CapabilityIssuer):
            raise TypeError(f"issuer must be a CapabilityIssuer, got {type(issuer).__name__}")
        if issuer is not None and issuer.ttl_s != config.capability_ttl_s:
            raise ValueError(
                f"issuer.ttl_s must be config.capability_ttl_s ({config.capability_ttl_s}), "
                f"got {issuer.ttl_s}"
            )
        # None: a fresh key for this gateway run (holders learn it when they register).
        self._issuer = issuer or CapabilityIssuer.generate(ttl_s=config.capability_ttl_s)
        policy = preset(
            config.policy,
            placement_config=config.placement_config,
            router_config=config.router_config,
            assist_config=config.assist_config,
        )
        self.driver = RecoveryDriver(
            policy,
            config.load_config,
            gain_fn=gain_fn,
            recorder=event_log,
            park_s=config.park_leases * config.lease_s,
            max_parked=config.max_parked,
        )
        self._workers: dict[int, _Worker] = {}
        self._requests: dict[int, _Request] = {}
        self._outboxes: dict[int, DirectiveOutbox] = {}
        # held checkpoints reported (gateway restart) before their request: (holder, report, since)
        self._pending_holds: dict[int, list[tuple[int, HeldReport, float]]] = {}
        self._next_request_id = check_int("first_request_id", first_request_id, low=0)
        self._failures: list[FailurePlan] = []
        self._last_interrupted: list[int] = []
        self._drains: dict[int, _Drain] = {}  # by worker id: the drain of its current incarnation
        self._num_parked_total = 0
        self._renewals = RenewalQueue()  # the unfinished requests granted capabilities, by when
        # The finished requests kept, a heap by when they ended (forget_finished pops the old).
        self._ended: list[tuple[float, int]] = []
        self._num_finished = 0

    @property
    def issuer_public_key(self) -> bytes:
        """The key holders verify this gateway's capabilities with (sent at registration)."""
        return self._issuer.public_key

    @property
    def monitor(self) -> LoadMonitor:
        """The driver's monitor (read it; feed it only through the driver)."""
        return self.driver.monitor

    def _send_pairing(self, decision: AssistDecision) -> None:
        """ASSIST_DRAFT to the assistant and ASSIST_VERIFY to the survivor of a pairing made."""
        worker_id = decision.assistant_id
        if decision.survivor_id is not None:
            survivor = self._workers[decision.survivor_id]
            assistant = self._workers[worker_id]
            k = decision.num_draft_tokens
            self._send(
                worker_id, AssistDraft(decision.survivor_id, survivor.holder_address, k, decision.reason)
            )
            self._send(
                decision.survivor_id, AssistVerify(worker_id, assistant.holder_address, k, decision.reason)
            )

    # ---- directives ------------------------------------------------------------------------
    def _send(self, worker_id: int, directive: Directive) -> None:
        if worker_id in self._workers and self._workers[worker_id].state != WorkerState.FAILED:
            self._outboxes[worker_id].put(directive)

    def directives_after(self, worker_id: int, sequence: int) -> list[Delivery]:
        """The worker's unacknowledged directives numbered above ``sequence``, oldest first
        (what its pushed stream sends next); none for a failed incarnation."""
        outbox = self._outboxes.get(check_int("worker_id", worker_id, low=0))
        return [] if outbox is None else outbox.after(sequence)

    def take_directives(self, worker_id: int) -> list[Directive]:
        """Every unacknowledged directive of the worker, oldest first, acknowledged at once
        (for a consumer in this process: tests, benchmarks)."""
        outbox = self._outboxes.get(check_int("worker_id", worker_id, low=0))
        if outbox is None:
            return []
        deliveries = outbox.after(0)
        outbox.acknowledge(outbox.last_sequence)
        return [d.directive for d in deliveries]

    def _grant(
        self, holder_id: int, request: _Request, rights: Rights = Rights.WRITE | Rights.READ
    ) -> HolderGrant:
        """A holder's address and the capabilities of the request's checkpoint at its current
        epoch on that holder, one per shard of the serving worker (each tensor-parallel rank
        streams its own)."""
        worker = self._workers[request.worker_id]
        bearer = request.worker_id if worker.bound else None
        capabilities = tuple(
            self._issuer.issue(
                request.request_id, shard, request.epoch, holder_id=holder_id, rights=rights, bearer=bearer
            )
            for shard in range(worker.num_shards)
        )
        return HolderGrant(holder_id, self._workers[holder_id].holder_address, capabilities)

    def _hold(self, request: _Request, holder_ids: Sequence[int], reserved_bytes: int, reason: str) -> None:
        for holder_id in holder_ids:
            grant = self._grant(holder_id, request)
            self._send(
                holder_id,
                Hold(request.request_id, request.epoch, grant, reserved_bytes, request.worker_id, reason),
            )

    def _grants(self, request: _Request, holder_ids: Sequence[int]) -> tuple[HolderGrant, ...]:
        return tuple(self._grant(h, request) for h in holder_ids)

    def _granted(self, request: _Request, granted_s: float) -> None:
        """The serving worker got the request's capabilities at ``granted_s``: renewed from then."""
        request.granted_s = granted_s
        self._renewals.push(request.request_id, granted_s)

    # ---- workers -----------------------------------------------------------------------------
    def register(
        self,
        now_s: float,
        worker_id: int,
        *,
        state: str = WorkerState.SERVING,
        budget_bytes: int = 0,
        domain: str = "",
        holder_address: str = "",
        num_shards: int = 1,
        last_epoch: int = 0,
        running: Sequence[RunningReport] = (),
        held: Sequence[HeldReport] = (),
        identity_key: bytes = b"",
    ) -> Registration:
        """A worker process starts (serving or recovering) or re-registers with a restarted
        gateway, reporting what it runs and holds. A live earlier incarnation is failed first
        (its process restarted before its lease expired). Returns the new epoch and, for a
        recovering worker, its assist pairing. With ``identity_key`` (the worker's Ed25519
        public key) it also returns the worker's credential, and every capability granted for
        its requests from then on is bound to it (docs/security.md, "Worker identity")."""
        worker_id = check_int("worker_id", worker_id, low=0)
        if state not in (WorkerState.SERVING, WorkerState.RECOVERING):
            raise ValueError(f"state must be 'serving' or 'recovering', got {str(state)!r}")
        num_shards = check_int("num_shards", num_shards, low=0)
        if num_shards < 1:
            raise ValueError(f"num_shards must be >= 1, got {num_shards}")
        if state == WorkerState.RECOVERING and running:
            raise ValueError(f"running must be empty for a recovering worker, got {len(running)} requests")
        check_int("budget_bytes", budget_bytes, low=0)
        if not isinstance(domain, str) or not isinstance(holder_address, str):
            raise TypeError(
                f"domain and holder_address must be str, got {type(domain).__name__}, "
                f"{type(holder_address).__name__}"
            )
        old = self._workers.get(worker_id)
        if old is not None and old.state != WorkerState.FAILED:
            self._end([worker_id], now_s, f"worker {worker_id} registered again (epoch {old.epoch} is gone)")
        epoch = max(old.epoch if old is not None else 0, check_int("last_epoch", last_epoch, low=0)) + 1
        credential = b""
        if identity_key:
            credential = self._issuer.issue_credential(worker_id, epoch, identity_key)
        worker = _Worker(worker_id, epoch, holder_address, num_shards, now_s + self.config.lease_s)
        worker.bound = bool(credential)
        self._workers[worker_id] = worker
        self._outboxes[worker_id] = DirectiveOutbox()  # a new epoch numbers its directives anew
        known = worker_id in self.monitor.worker_ids()
        assist = None
        if state == WorkerState.SERVING:
            self.driver.apply(WorkerJoined(now_s, worker_id, budget_bytes, domain))
        else:
            worker.state = WorkerState.RECOVERING
            if not known:  # a restarted gateway meets a worker that is mid-recovery
                self.driver.apply(WorkerJoined(now_s, worker_id, budget_bytes, domain))
                self.driver.apply(WorkerFailed(now_s, worker_id))
            assist = self.driver.recover(now_s, worker_id)
            if assist is not None:
                self._send_pairing(assist)
        for running_report in running:
            self._adopt(now_s, worker_id, running_report)
        for held_report in held:
            self._adopt_held(now_s, worker_id, held_report)
        if state == WorkerState.SERVING and self.driver.parked:
            self.unpark(now_s)
        return Registration(worker_id, epoch, assist, credential)

    def _adopt(self, now_s: float, worker_id: int, report: RunningReport) -> None:
        """A running request reported by a re-registering worker (gateway restart)."""
        request_id = check_int("request_id", report.request_id, low=0)
        known = self._requests.get(request_id)
        if known is not None:
            if (known.worker_id, known.epoch) != (worker_id, report.epoch):
                self._send(worker_id, Cancel(request_id, "served elsewhere now"))
            return
        prompt = _check_tokens("prompt_token_ids", report.prompt_token_ids)
        request = _Request(
            request_id,
            prompt,
            report.max_new_tokens,
            report.expected_output_tokens,
            worker_id,
            report.epoch,
            now_s,
            list(_check_tokens("output_token_ids", report.output_token_ids)),
        )
        self._requests[request_id] = request
        self._granted(request, -math.inf)  # signed before the gateway restarted, when is unknown: renew soon
        self._next_request_id = max(self._next_request_id, request_id + 1)
        self.driver.apply(
            RequestAdmitted(now_s, request_id, worker_id, len(prompt), report.expected_output_tokens)
        )
        for holder_id, held, _ in self._pending_holds.pop(request_id, []):
            self._adopt_held(now_s, holder_id, held)

    def _adopt_held(self, now_s: float, holder_id: int, report: HeldReport) -> None:
        request = self._requests.get(report.request_id)
        if request is None:
            self._pending_holds.setdefault(report.request_id, []).append((holder_id, report, now_s))
            return
        if not request.finished and not self.monitor.has_request(request.request_id):  # parked
            usable = report.epoch == request.epoch and self._workers[holder_id].state == WorkerState.SERVING
            if not (usable and self.driver.hold_parked(request.request_id, holder_id, report.durable_tokens)):
                self._send(holder_id, Release(request.request_id, reason="stale checkpoint"))
            return
        if request.finished:
            self._send(holder_id, Release(request.request_id, reason="its request ended"))
            return
        view = self.monitor.request(request.request_id)
        if (
            report.epoch != request.epoch
            or holder_id == request.worker_id
            or holder_id in view.holder_ids
            or self._workers[holder_id].state != WorkerState.SERVING
        ):
            self._send(holder_id, Release(request.request_id, reason="stale checkpoint"))
            return
        expected = (
            len(request.prompt_token_ids) + request.expected_output_tokens
        ) * self.config.load_config.kv_bytes_per_token
        reserved = max(0, min(expected, self.monitor.free_bytes(holder_id)))
        self.driver.apply(CheckpointReserved(now_s, request.request_id, (holder_id,), reserved))
        self.driver.apply(CheckpointGrew(now_s, request.request_id, holder_id, report.durable_tokens))

    def drop_orphaned_holds(self, now_s: float) -> int:
        """Release the held checkpoints reported (after a gateway restart) for requests that no
        worker reported running within ``lease_s``: by then every live worker has registered
        again, so their serving worker died while no gateway ran. Returns how many."""
        horizon_s = now_s - self.config.lease_s
        dropped = 0
        for request_id in [r for r, holds in self._pending_holds.items() if holds[0][2] < horizon_s]:
            for holder_id, _, _ in self._pending_holds.pop(request_id):
                self._send(holder_id, Release(request_id, reason="its request is gone"))
                dropped += 1
        return dropped

    def renew_lease(self, now_s: float, worker_id: int, epoch: int) -> LeaseStatus:
        """Extend the lease of (worker, epoch), or say that it is fenced or unknown."""
        worker = self._workers.get(check_int("worker_id", worker_id, low=0))
        if worker is None:
            return LeaseStatus(
                False, True, f"worker {worker_id} is not registered (gateway restarted?): re-register"
            )
        if epoch != worker.epoch:
            return LeaseStatus(True, False, f"epoch {epoch} is stale (current epoch {worker.epoch})")
        if worker.state == WorkerState.FAILED:
            return LeaseStatus(True, False, worker.fence_reason)
        worker.lease_deadline_s = now_s + self.config.lease_s
        return LeaseStatus(False, False, "")

    def report_load(self, now_s: float, worker_id: int, num_running: int, num_waiting: int) -> None:
        if self._workers[worker_id].state == WorkerState.SERVING:
            self.driver.apply(Heartbeat(now_s, worker_id, num_running, num_waiting))

    def report_checkpoint(
        self, now_s: float, holder_id: int, request_id: int, epoch: int, durable_tokens: int
    ) -> None:
        """A holder's durable length of a checkpoint. Reports of an unknown request or an older
        request epoch are dropped here; the monitor ignores those of copies it no longer keeps
        (a finished request's, an evicted one's)."""
        request = self._requests.get(request_id)
        if request is None or epoch != request.epoch:
            return
        self.driver.apply(CheckpointGrew(now_s, request_id, holder_id, durable_tokens))

    def report_dropped(
        self, now_s: float, holder_id: int, request_id: int, *, refused: bool
    ) -> PlacementDecision | None:
        """The holder refused (budget) or evicted a checkpoint; a refused one is placed again
        (placement avoids holders that refused) and streamed to the new holder in full. When
        no holder is left to take it, the request degrades to no checkpoint: its serving
        worker is told to stream it nowhere (STREAM without holders), and a failure
        re-prefills it. A refusal reported again changes nothing."""
        request = self._requests.get(request_id)
        if request is None or request.finished:
            return None
        if not refused:
            self.driver.apply(CheckpointEvicted(now_s, request_id, holder_id))
            return None
        if holder_id in self.monitor.refused_by(request_id):
            return None  # reported again (a heartbeat whose reply was lost): handled already
        self.driver.apply(CheckpointRefused(now_s, request_id, holder_id))
        if self._workers[request.worker_id].state != WorkerState.SERVING:
            return None
        decision = self.driver.place(request_id)
        if decision.new_holder_ids:
            self._stream_to_new(now_s, request, decision)
        elif not self.monitor.request(request_id).holder_ids:
            self._send(request.worker_id, Stream(request_id, request.epoch, (), decision.reason))
        return decision

    def report_lost(
        self, now_s: float, worker_id: int, request_id: int, holder_id: int
    ) -> PlacementDecision | None:
        """The serving worker's streamer lost the replica on ``holder_id`` for good (gave up on
        an unreachable holder, or was refused): handled as that holder's refusal (placed
        again, avoiding it), and the holder is told to release what it kept of the copy. A
        report from a worker that does not serve the request (a stale incarnation), about an
        unknown holder, or reported again changes nothing."""
        request = self._requests.get(request_id)
        if (
            request is None
            or request.finished
            or request.worker_id != worker_id
            or holder_id not in self._workers
            or holder_id in self.monitor.refused_by(request_id)
        ):
            return None
        self._send(holder_id, Release(request_id, request.epoch, "replica lost: placed again"))
        return self.report_dropped(now_s, holder_id, request_id, refused=True)

    def _stream_to_new(self, now_s: float, request: _Request, decision: PlacementDecision) -> None:
        """HOLD to the new holders; STREAM to the serving worker naming every holder the
        request has now (the surviving replicas too: the worker streams to the list it is
        given)."""
        if not decision.new_holder_ids:
            return
        self._hold(request, decision.new_holder_ids, decision.reserved_bytes, decision.reason)
        self._granted(request, now_s)
        self._send(
            request.worker_id,
            Stream(
                request.request_id, request.epoch, self._grants(request, decision.holder_ids), decision.reason
            ),
        )

    def assist_report(self, now_s: float, worker_id: int, *, steps: int, proposed: int, accepted: int) -> int:
        """A recovering worker's heartbeat: pair it if unpaired, record its cumulative draft
        counters; returns the draft length for its next steps (0 when it assists nobody)."""
        worker = self._workers[worker_id]
        if worker.state != WorkerState.RECOVERING or not self.driver.assists:
            return 0
        if accepted > proposed:
            raise ValueError(f"accepted must be <= proposed, got {accepted} > {proposed}")
        worker.proposed_draft_tokens = proposed
        worker.accepted_draft_tokens = accepted
        if self.driver.survivor_of(worker_id) is None:
            self._send_pairing(self.driver.pair(worker_id))
        return self.driver.num_draft_tokens(worker_id, steps)

    def heartbeat(
        self,
        now_s: float,
        worker_id: int,
        epoch: int,
        report: WorkerReport,
        *,
        state: str = WorkerState.SERVING,
        acked_sequence: int = 0,
    ) -> tuple[LeaseStatus, list[Delivery], int]:
        """Renew the lease, take the report and acknowledge the directives up to
        ``acked_sequence``; returns (lease status, the unacknowledged directives after it,
        draft length). Raises TypeError for a report that is not a WorkerReport, ValueError
        when ``state`` is not the state the gateway has for the worker or ``acked_sequence``
        is above the last directive sent."""
        lease = self.renew_lease(now_s, worker_id, epoch)
        if lease.fenced or lease.reregister:
            return lease, [], 0
        worker = self._workers[worker_id]
        # A draining worker still reports the state it serves in.
        registered = WorkerState.SERVING if worker.state == WorkerState.DRAINING else worker.state
        if state != registered:
            raise ValueError(
                f"state must be the registered state {str(registered)!r} (ModelLoaded switches over), "
                f"got {str(state)!r}"
            )
        if not isinstance(report, WorkerReport):
            raise TypeError(f"report must be a WorkerReport, got {type(report).__name__}")
        outbox = self._outboxes[worker_id]
        outbox.acknowledge(acked_sequence)
        worker.held_bytes = check_int("held_bytes", report.held_bytes, low=0)
        self.report_load(now_s, worker_id, report.num_running, report.num_waiting)
        for held in report.held:
            self.report_checkpoint(now_s, worker_id, held.request_id, held.epoch, held.durable_tokens)
        for request_id in report.refused_request_ids:
            self.report_dropped(now_s, worker_id, request_id, refused=True)
        for request_id in report.evicted_request_ids:
            self.report_dropped(now_s, worker_id, request_id, refused=False)
        for lost in report.lost_replicas:
            self.report_lost(now_s, worker_id, lost.request_id, lost.holder_worker_id)
        k = self.assist_report(
            now_s,
            worker_id,
            steps=report.assist_steps,
            proposed=report.proposed_draft_tokens,
            accepted=report.accepted_draft_tokens,
        )
        if report.flushed:
            # Its own word on what its holders have: the holders' reports may still be on their way.
            for streamed in report.streamed:
                request = self._requests.get(streamed.request_id)
                if request is not None and request.worker_id == worker_id:
                    self.report_checkpoint(
                        now_s,
                        streamed.holder_worker_id,
                        streamed.request_id,
                        streamed.epoch,
                        streamed.durable_tokens,
                    )
            self._finish_drain(now_s, worker_id, reprefill=False)
        return lease, outbox.after(acked_sequence), k

    def model_loaded(
        self, now_s: float, worker_id: int, epoch: int, budget_bytes: int, domain: str = ""
    ) -> int | None:
        """Switch-over: a recovering worker's full model is loaded. Ends its assist pairing
        (the freed survivor is told) and it serves again with L = 0. Returns the survivor."""
        worker = self._workers.get(check_int("worker_id", worker_id, low=0))
        if worker is None or epoch != worker.epoch or worker.state == WorkerState.FAILED:
            raise StaleEpochError(f"worker {worker_id} epoch {epoch} is not a live incarnation")
        if worker.state != WorkerState.RECOVERING:
            raise ValueError(f"worker_id must be a recovering worker, got {worker_id} ({worker.state})")
        check_int("budget_bytes", budget_bytes, low=0)
        if not isinstance(domain, str):
            raise TypeError(f"domain must be a str, got {type(domain).__name__}")
        worker.state = WorkerState.SERVING
        freed = self.driver.switch_over(now_s, worker_id, budget_bytes, domain)
        if freed is not None:
            self._send(freed, AssistStop(worker_id, "assistant switched over"))
        if self.driver.parked:
            self.unpark(now_s)
        return freed

    def expire_leases(self, now_s: float) -> FailurePlan | None:
        """Fail every live worker whose lease ran out (all detected together)."""
        expired = sorted(
            w.worker_id
            for w in self._workers.values()
            if w.state != WorkerState.FAILED and w.lease_deadline_s < now_s
        )
        if not expired:
            return None
        return self._end(expired, now_s, "lease expired")

    def process_exited(
        self, now_s: float, worker_id: int, epoch: int, reason: str = ""
    ) -> FailurePlan | None:
        """A worker process exited. Fails that incarnation unless it is already failed or has
        been superseded (an older epoch): returns the outcome, or None."""
        worker = self._workers.get(check_int("worker_id", worker_id, low=0))
        if worker is None or worker.epoch != epoch or worker.state == WorkerState.FAILED:
            return None
        return self._end([worker_id], now_s, f"process exited{': ' + reason if reason else ''}")

    def _end(self, worker_ids: Sequence[int], now_s: float, cause: str) -> FailurePlan | None:
        """Incarnations that are gone: a drained one (told to stop) is retired, the others
        fail together. Returns the failure's plan, or None when every one was drained."""
        retired = [w for w in worker_ids if self._drain_state(w) == "stopped"]
        for worker_id in retired:
            worker = self._workers[worker_id]
            worker.state = WorkerState.FAILED
            worker.fence_reason = f"epoch {worker.epoch} retired at {now_s:.3f} (drained): {cause}"
            self._outboxes.pop(worker_id, None)
            self.driver.apply(WorkerFailed(now_s, worker_id))  # it runs and holds nothing
        failed = [w for w in worker_ids if w not in retired]
        return self.fail(now_s, failed, cause=cause) if failed else None

    def _drain_state(self, worker_id: int) -> str | None:
        """The state of the drain of the worker's current incarnation (None: not drained)."""
        drain = self._drains.get(worker_id)
        if drain is None or drain.epoch != self._workers[worker_id].epoch:
            return None
        return drain.state

    # ---- failures ----------------------------------------------------------------------------
    def fail(self, now_s: float, worker_ids: Sequence[int], *, cause: str) -> FailurePlan:
        """Workers failed together: fence them, have the driver plan the failure (end their
        pairings, mark each failed, route each one's requests placing those left without a
        holder, re-place the checkpoints each held) and queue the plan's directives."""
        failed = [w for w in dict.fromkeys(check_int("worker_ids", w, low=0) for w in worker_ids)]
        for worker_id in failed:
            worker = self._workers.get(worker_id)
            if worker is None or worker.state == WorkerState.FAILED:
                raise ValueError(f"worker_ids must be live registered workers, got {worker_id}")
        for worker_id in failed:
            worker = self._workers[worker_id]
            worker.state = WorkerState.FAILED
            worker.fence_reason = f"epoch {worker.epoch} fenced at {now_s:.3f}: {cause}"
            drain = self._drains.get(worker_id)
            if drain is not None and drain.state == "flushing":  # died mid-drain: the failure path moves
                drain.state = "failed"
                drain.finished_s = now_s
            self._outboxes.pop(worker_id, None)  # a failed incarnation is told nothing more
        plan = self.driver.fail(now_s, failed, cause=cause)
        for unpairing in plan.unpairings:
            worker_id = unpairing.worker_id
            if unpairing.freed_assistant_id is not None:
                self._send(unpairing.freed_assistant_id, AssistStop(worker_id, "survivor failed"))
            if unpairing.freed_survivor_id is not None:
                self._send(unpairing.freed_survivor_id, AssistStop(worker_id, "assistant failed"))
        for request_id in plan.lost_request_ids:  # their holders failed with them: none to release
            request = self._requests[request_id]
            request.lost = True
            request.lost_reason = (
                f"no worker was left serving and max_parked {self.config.max_parked} reached"
                if self.config.park_leases > 0
                else "no worker was left serving (park_leases 0: parking is off)"
            )
            self._close(now_s, request)
        interrupted: list[int] = []
        for request_id in plan.parked_request_ids:  # the stream stays open: ``unpark`` moves them
            self._requests[request_id].interrupted_at_s = now_s
            interrupted.append(request_id)
        self._num_parked_total += len(plan.parked_request_ids)
        for reroute in plan.reroutes:
            request = self._requests[reroute.route.request_id]
            self._move(now_s, request, reroute, "failover")
            interrupted.append(request.request_id)
        for placed in plan.replacements:
            self._stream_to_new(now_s, self._requests[placed.request_id], placed)
        self._failures.append(plan)
        self._last_interrupted = interrupted
        return plan

    def unpark(self, now_s: float) -> int:
        """Move the parked requests to serving workers (RESUME with the prompt and the tokens
        the client has at a new epoch, as a failover's reroute: restored on a worker that
        registered again holding a copy, else re-prefilled) and lose those
        parked past ``park_leases`` leases, their reason naming the bound. Called when a
        worker can serve (registered serving, or switched over) and by the reaper. Returns how
        many were moved or lost."""
        # A fenced worker lingers with its holder and registers again (worker.process): wait
        # up to a lease for the holders of a parked request before re-prefilling it.
        plan = self.driver.unpark(now_s, holder_wait_s=self.config.lease_s)
        for request_id, holder_id in plan.unused_copies:  # before any HOLD of the moves below
            self._send(holder_id, Release(request_id, self._requests[request_id].epoch, "not restored from"))
        for parked in plan.expired:
            request = self._requests[parked.request_id]
            request.lost = True
            request.lost_reason = (
                f"parked {now_s - parked.parked_s:.1f} s (park_leases {self.config.park_leases} x lease "
                f"{self.config.lease_s} s): no worker registered"
            )
            self._close(now_s, request)
        for reroute in plan.reroutes:  # its old worker is gone (or a new incarnation): not told
            self._move(now_s, self._requests[reroute.route.request_id], reroute, "unparked", cancel=False)
        return len(plan.reroutes) + len(plan.expired)

    def lost_reason(self, request_id: int) -> str:
        """Why a request was lost ("" when it was not)."""
        return self._request(request_id).lost_reason

    def refused(self, request_id: int) -> bool:
        """Whether the request was lost because its worker refused it (an error of the
        request's own, which a retry would meet again; other losses are the cluster's)."""
        return self._request(request_id).refused

    def _request(self, request_id: int) -> _Request:
        """The request of ``request_id``; IndexError for an unknown one."""
        request = self._requests.get(check_int("request_id", request_id, low=0))
        if request is None:
            raise IndexError(f"request_id {request_id} is not a known request")
        return request

    def move(self, now_s: float, request_id: int, reason: str, *, reprefill: bool = False) -> Reroute:
        """Move a running request to where the router decides (restore on a holder, remote
        restore, or re-prefill; ``reprefill`` skips the checkpoint): CANCEL where it runs
        (unless it is draining: flushed, it steps no more), its epoch advanced (the old worker's
        reports and appends are refused from here on), HOLD to its holders at the new epoch and
        RESUME on the target with the prompt and the tokens the client already has, so its
        stream continues with none repeated or missing. The failure path moves each interrupted
        request the same way (``reason`` "failover");
        a drain moves with "drain". Workers leave a cancelled request's checkpoint on its
        holders (the gateway releases those the move drops), so the target restores what the
        old worker streamed. Returns the driver's reroute.
        Raises IndexError for an unknown request, ValueError for a finished one or when no
        other worker serves."""
        request = self._request(request_id)
        if not isinstance(reason, str):
            raise TypeError(f"reason must be a str, got {type(reason).__name__}")
        if request.finished:
            raise ValueError(f"request_id must be a running request, got {request_id} (finished)")
        holders_before = self.monitor.request(request.request_id).holder_ids
        reroute = self.driver.move(now_s, request.request_id, reprefill=reprefill)
        dropped = set(holders_before) - set(reroute.holder_ids) - {reroute.route.target_worker_id}
        for holder_id in sorted(dropped):  # a re-prefill keeps no old copy
            self._send(
                holder_id, Release(request.request_id, request.epoch, f"moved ({reason}): re-prefilled")
            )
        self._move(now_s, request, reroute, reason)
        return reroute

    def _move(
        self, now_s: float, request: _Request, reroute: Reroute, reason: str, *, cancel: bool = True
    ) -> None:
        """The directives of one move the driver decided (a failed old worker is told nothing:
        ``_send`` drops what it would get)."""
        decision = reroute.route
        if cancel and self._workers[request.worker_id].state != WorkerState.DRAINING:
            # A drained worker is not told: it steps no more and is told to STOP.
            self._send(request.worker_id, Cancel(request.request_id, f"moved ({reason})"))
        request.epoch += 1
        request.worker_id = decision.target_worker_id
        self._granted(request, now_s)
        request.interrupted_at_s = now_s
        request.replay_token_s = math.nan
        if reroute.placement is not None:
            placement = reroute.placement
            self._hold(request, placement.new_holder_ids, placement.reserved_bytes, placement.reason)
        else:  # surviving holders: same copy, new epoch (older appends are fenced)
            self._hold(request, reroute.holder_ids, 0, "epoch bumped")
        self._send(request.worker_id, self._resume(request, decision, reroute.holder_ids))

    def _resume(self, request: _Request, decision: RouteDecision, holder_ids: Sequence[int]) -> Resume:
        source = None
        if decision.source_holder_id is not None:
            source = self._grant(decision.source_holder_id, request, Rights.READ)
        return Resume(
            request.request_id,
            request.epoch,
            decision.action,
            self._grants(request, holder_ids),
            source,
            request.prompt_token_ids,
            tuple(request.tokens),
            request.max_new_tokens,
            decision.reason,
            request.sampling,
        )

    # ---- drains ------------------------------------------------------------------------------
    def drain(self, now_s: float, worker_id: int, deadline_s: float) -> DrainStatus:
        """Take a serving worker out for maintenance: it is admitted nothing more, the
        checkpoints it holds are placed again (HOLD + STREAM to their workers, RELEASE here),
        and it is told to FLUSH. When its heartbeat says it flushed, each of its requests is
        moved (``move(request, "drain")``: restored where the router decides, the stream
        continuing) and it is told to STOP; its exit then retires it (no failure). Past
        ``deadline_s`` seconds without a flush, its requests are moved without their
        checkpoints (re-prefilled, counted). A worker dying mid-drain is failed as any other.
        Calling it again for the same incarnation returns the progress (the first deadline
        stands), also after it was retired or failed. Raises IndexError for an unknown worker,
        ValueError for one that is not serving or a deadline that is not > 0, NoWorkerError
        when its requests have nowhere to go."""
        worker = self._workers.get(check_int("worker_id", worker_id, low=0))
        if worker is None:
            raise IndexError(f"worker_id {worker_id} is not a registered worker")
        drain = self._drains.get(worker_id)
        if drain is not None and drain.epoch == worker.epoch:  # also once retired or failed
            return drain.status()
        deadline_s = check_number("deadline_s", deadline_s, positive=True)
        if worker.state != WorkerState.SERVING:
            raise ValueError(f"worker_id must be a serving worker, got {worker_id} ({worker.state})")
        running = self.monitor.running_on(worker_id)
        if running and not [w for w in self.monitor.live_worker_ids() if w != worker_id]:
            raise NoWorkerError(
                f"no other worker is serving: the {len(running)} requests of {worker_id} stay"
            )
        held = self.monitor.held_by(worker_id)
        worker.state = WorkerState.DRAINING
        plan = self.driver.drain(now_s, worker_id)
        unpairing = plan.unpairing
        if unpairing.freed_assistant_id is not None:
            self._send(unpairing.freed_assistant_id, AssistStop(worker_id, "survivor drained"))
        if unpairing.freed_survivor_id is not None:
            self._send(unpairing.freed_survivor_id, AssistStop(worker_id, "assistant drained"))
        for placed in plan.replacements:
            self._stream_to_new(now_s, self._requests[placed.request_id], placed)
        for request_id in held:
            self._send(worker_id, Release(request_id, self._requests[request_id].epoch, "holder drained"))
        drain = _Drain(worker_id, worker.epoch, now_s, now_s + deadline_s, len(plan.request_ids))
        self._drains[worker_id] = drain
        self._send(worker_id, Flush(f"drain: deadline {deadline_s:.3f} s"))
        return drain.status()

    def drain_status(self, worker_id: int) -> DrainStatus | None:
        """The progress of the worker's last drain (None if it was never drained)."""
        drain = self._drains.get(check_int("worker_id", worker_id, low=0))
        return None if drain is None else drain.status()

    def expire_drains(self, now_s: float) -> int:
        """Drains whose deadline passed before their worker flushed: move what is left
        without its checkpoint (re-prefilled) and stop the worker. Returns how many."""
        late = [d.worker_id for d in self._drains.values() if d.state == "flushing" and d.deadline_s < now_s]
        for worker_id in late:
            self._finish_drain(now_s, worker_id, reprefill=True)
        return len(late)

    def _finish_drain(self, now_s: float, worker_id: int, *, reprefill: bool) -> None:
        """Move every request still on the drained worker, then STOP it (once)."""
        drain = self._drains.get(worker_id)
        if (
            self._drain_state(worker_id) != "flushing"
            or self._workers[worker_id].state != WorkerState.DRAINING
        ):
            return
        assert drain is not None
        if self.monitor.running_on(worker_id) and not self.monitor.live_worker_ids():
            return  # nowhere to move them now: the drain waits (a failure would route them)
        reason = "drain deadline" if reprefill else "drain"
        for request_id in self.monitor.running_on(worker_id):
            self.move(now_s, request_id, reason, reprefill=reprefill)
            drain.num_moved += 1
            drain.num_reprefilled += int(reprefill)
        drain.state = "stopped"
        drain.finished_s = now_s
        self._send(worker_id, Stop(f"drained: {drain.num_moved} requests moved"))

    # ---- requests ----------------------------------------------------------------------------
    def choose_worker(self) -> int:
        """Join-shortest-queue over the serving workers (queue depth as the monitor knows it,
        ties: lowest id). Raises NoWorkerError when none serves."""
        worker_id = self.driver.choose_worker()
        if worker_id is None:
            raise NoWorkerError("no worker is serving")
        return worker_id

    def admit(
        self,
        now_s: float,
        prompt_token_ids: Sequence[int],
        max_new_tokens: int,
        *,
        expected_output_tokens: int = 0,
        worker_id: int | None = None,
        request_id: int | None = None,
        sampling: Sampling = GREEDY,
    ) -> AdmissionPlan:
        """Admit a client request on ``worker_id`` (default: join-shortest-queue), place its
        checkpoint and queue RUN to the worker and HOLD to its holders. ``sampling`` goes with
        the request wherever it is moved (RUN and every RESUME carry it)."""
        if not isinstance(sampling, Sampling):
            raise TypeError(f"sampling must be a Sampling, got {type(sampling).__name__}")
        prompt = _check_tokens("prompt_token_ids", prompt_token_ids)
        if not prompt:
            raise ValueError("prompt_token_ids must not be empty, got 0 tokens")
        max_new_tokens = check_int("max_new_tokens", max_new_tokens, low=0)
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        expected = check_int("expected_output_tokens", expected_output_tokens, low=0) or max_new_tokens
        if request_id is None:
            request_id = self._next_request_id
        elif check_int("request_id", request_id, low=0) in self._requests:
            raise ValueError(f"request_id must be new, got {request_id}")
        if worker_id is None:
            chosen = self.driver.choose_worker()
            if chosen is None and not self._workers:
                raise NoWorkerError("no worker is serving")
            if chosen is None:  # every registered worker failed: park it as their requests
                return self._park_admission(now_s, request_id, prompt, max_new_tokens, expected, sampling)
            worker_id = chosen
        else:
            worker_id = check_int("worker_id", worker_id, low=0)
        self._next_request_id = max(self._next_request_id, request_id + 1)
        plan = self.driver.admit(now_s, request_id, worker_id, len(prompt), expected)
        request = _Request(
            request_id, prompt, max_new_tokens, expected, worker_id, 1, now_s, sampling=sampling
        )
        self._requests[request_id] = request
        self._granted(request, now_s)
        placement = plan.placement
        self._hold(request, placement.new_holder_ids, placement.reserved_bytes, placement.reason)
        self._send(
            worker_id,
            Run(
                request_id,
                request.epoch,
                self._grants(request, placement.holder_ids),
                prompt,
                max_new_tokens,
                placement.reason,
                sampling,
            ),
        )
        return plan

    def _park_admission(
        self,
        now_s: float,
        request_id: int,
        prompt: tuple[int, ...],
        max_new_tokens: int,
        expected: int,
        sampling: Sampling,
    ) -> AdmissionPlan:
        """A new request while no worker serves: parked (its stream stays open) for ``unpark``.
        Raises NoWorkerError when parking is off or full."""
        plan = self.driver.park_admission(now_s, request_id, len(prompt), expected)
        if plan is None:
            raise NoWorkerError(f"no worker is serving and max_parked {self.config.max_parked} reached")
        self._next_request_id = max(self._next_request_id, request_id + 1)
        self._requests[request_id] = _Request(
            request_id, prompt, max_new_tokens, expected, -1, 1, now_s, sampling=sampling
        )  # granted nothing until ``unpark`` moves it
        self._num_parked_total += 1
        return plan

    def report_tokens(
        self,
        now_s: float,
        worker_id: int,
        worker_epoch: int,
        request_id: int,
        epoch: int,
        start_position: int,
        token_ids: Sequence[int],
        *,
        finished: bool = False,
        error: str = "",
        failed: bool = False,
    ) -> TokenAck:
        """Output tokens ``token_ids`` at positions ``start_position...`` of a request from
        the worker serving it at ``epoch``. Positions already known are dropped (a duplicate
        that differs is counted as a conflict; the first report wins, the client has it);
        a gap is refused. ``finished`` ends the request and releases its checkpoints. A
        non-empty ``error`` (the worker refused the request) ends it as lost instead, its
        reason naming the worker and the error (``protocol.bound_error``), and releases its
        checkpoints; a request that had ended already stays as it was. With ``failed`` (the
        worker failed it: its server's own error) the request is moved to another worker as
        a failover would move it (``move(request, "failed")``), at most ``MAX_FAILED_MOVES``
        times; past that, or with no other worker serving, it is lost, not refused."""
        error = bound_error(error)
        if failed and not error:
            raise ValueError("failed needs the error that failed the request, got none")
        self.check_worker_epoch(worker_id, worker_epoch)
        request = self._request(request_id)
        if request.worker_id != worker_id or request.epoch != epoch:
            raise StaleEpochError(
                f"request {request_id} epoch {epoch} on worker {worker_id} is stale "
                f"(now epoch {request.epoch} on worker {request.worker_id})"
            )
        tokens = _check_tokens("token_ids", token_ids)
        start = check_int("start_position", start_position, low=0)
        known = len(request.tokens)
        if start > known:
            raise ValueError(f"start_position must be <= {known} (no gaps), got {start}")
        if start + len(tokens) > request.max_new_tokens:
            raise ValueError(
                f"token_ids must end by max_new_tokens={request.max_new_tokens}, "
                f"got {start + len(tokens)} tokens"
            )
        overlap = tokens[: known - start]
        conflicts = sum(1 for i, t in enumerate(overlap) if request.tokens[start + i] != t)
        new = tokens[known - start :]
        if new:
            if not request.tokens:
                request.first_token_s = now_s
            if not math.isnan(request.interrupted_at_s) and math.isnan(request.replay_token_s):
                request.replay_token_s = now_s
            request.tokens.extend(new)
        if error and not request.finished:
            if failed and request.failed_moves < MAX_FAILED_MOVES and self._move_failed(now_s, request):
                return TokenAck(len(new), conflicts, len(request.tokens))
            request.lost = True
            request.lost_reason = f"worker {worker_id} {'failed' if failed else 'refused'} it: {error}"
            request.refused = not failed
            self.finish_request(now_s, request_id)
        elif finished and not request.finished:
            self.finish_request(now_s, request_id)
        return TokenAck(len(new), conflicts, len(request.tokens))

    def _move_failed(self, now_s: float, request: _Request) -> bool:
        """Move a request its worker failed; False when no other worker serves."""
        request.failed_moves += 1
        try:
            self.move(now_s, request.request_id, "failed")
        except ValueError:
            return False
        return True

    def check_worker_epoch(self, worker_id: int, worker_epoch: int) -> None:
        """Raise StaleEpochError unless (worker, epoch) is a live incarnation."""
        worker = self._workers.get(check_int("worker_id", worker_id, low=0))
        if worker is None or worker.epoch != worker_epoch or worker.state == WorkerState.FAILED:
            raise StaleEpochError(f"worker {worker_id} epoch {worker_epoch} is fenced")

    def finish_request(self, now_s: float, request_id: int) -> None:
        """The request is complete: account it and release its checkpoints."""
        request = self._request(request_id)
        self._close(now_s, request)
        if not self.monitor.has_request(request_id):  # parked: the monitor forgot it
            parked = self.driver.forget_parked(request_id)
            for holder_id, _ in parked.held if parked is not None else ():
                self._send(holder_id, Release(request_id, request.epoch, "finished"))
            return
        for holder_id in self.driver.finish(now_s, request_id):
            self._send(holder_id, Release(request_id, request.epoch, "finished"))

    def renew_capabilities(self, now_s: float) -> int:
        """RENEW to the serving worker of each running request whose capabilities have used
        ``capability_renew_share`` of their lifetime since they were issued: fresh ones for
        each of its holders at the same epoch. Requests finished, parked, without a holder or on
        a failed worker are skipped (a moved request's grants are as new as its RESUME). Returns
        how many were renewed (the gateway's reaper calls it with the lease checks).

        Only the requests due are looked at, not every request kept: each grant queues its
        request by when it was issued (``gateway.renewals``), so a pass costs O((d + s) log n)
        for d requests due and s stale entries popped (grants superseded, requests ended; each
        entry is popped once), with n <= 2 x the unfinished requests + ``RenewalQueue.SLACK``,
        whatever the finished requests kept. A parked request leaves the queue (only its
        unpark's RESUME grants it again, and queues it); one due without a holder or on a failed
        worker stays queued, due, as it stayed due before (a holder may come without a grant: a
        restarted gateway adopting a held copy)."""
        due_s = now_s - self.config.capability_renew_share * self.config.capability_ttl_s
        renewed = 0
        for request_id in self._renewals.pop_due(due_s):
            request = self._requests[request_id]  # queued requests are unfinished, so kept
            if not self.monitor.has_request(request_id):  # parked: the monitor forgot it
                continue
            holder_ids = self.monitor.request(request_id).holder_ids
            if not holder_ids or self._workers[request.worker_id].state == WorkerState.FAILED:
                self._renewals.push(request_id, request.granted_s)
                continue
            self._granted(request, now_s)
            grants = self._grants(request, holder_ids)
            self._send(request.worker_id, Renew(request_id, request.epoch, grants, "before expiry"))
            renewed += 1
        return renewed

    def cancel(self, now_s: float, request_id: int, reason: str) -> bool:
        """The client gave up on a request (it disconnected, or the front door ended it at a
        stop sequence): CANCEL to its serving worker, RELEASE to its holders (a checkpoint is
        released only on the gateway's word), and the request ends with the tokens it has.
        Returns False when it had ended already. Raises IndexError for an unknown request."""
        request = self._request(request_id)
        if request.finished:
            return False
        self._send(request.worker_id, Cancel(request_id, reason))
        self.finish_request(now_s, request_id)
        return True

    def _close(self, now_s: float, request: _Request) -> None:
        """A request's own accounting at its end (finished or lost)."""
        if not request.finished:
            heapq.heappush(self._ended, (now_s, request.request_id))
            self._num_finished += 1
        request.finished = True
        request.finish_s = now_s
        self._renewals.discard(request.request_id)
        if not math.isnan(request.interrupted_at_s) and math.isnan(request.replay_token_s):
            request.replay_token_s = now_s

    def forget_finished(self, now_s: float) -> int:
        """Drop requests that finished more than ``finished_retention_s`` ago (except those of
        the last failure, which its metrics still read); returns how many were dropped. Looks
        at the requests that ended before the horizon only (a heap by end time), not at every
        request kept: the reaper calls it every tick."""
        horizon_s = now_s - self.config.finished_retention_s
        keep = set(self._last_interrupted)
        kept: list[tuple[float, int]] = []
        dropped = 0
        while self._ended and self._ended[0][0] < horizon_s:
            entry = heapq.heappop(self._ended)
            request = self._requests[entry[1]]
            if request.request_id in keep:
                kept.append(entry)  # looked at again next time: at most the last failure's
            elif request.finish_s >= horizon_s:  # closed again later: due at that time
                heapq.heappush(self._ended, (request.finish_s, request.request_id))
            else:
                del self._requests[request.request_id]
                self._num_finished -= 1
                dropped += 1
        for entry in kept:
            heapq.heappush(self._ended, entry)
        return dropped

    def tokens(self, request_id: int, from_position: int = 0) -> tuple[tuple[int, ...], bool, bool]:
        """(tokens from ``from_position``, finished, lost) of a request."""
        request = self._request(request_id)
        return tuple(request.tokens[from_position:]), request.finished, request.lost

    def has_request(self, request_id: int) -> bool:
        return request_id in self._requests

    def num_prompt_tokens(self, request_id: int) -> int:
        return len(self._request(request_id).prompt_token_ids)

    # ---- observation -------------------------------------------------------------------------
    def worker_epoch(self, worker_id: int) -> int:
        return self._workers[check_int("worker_id", worker_id, low=0)].epoch

    def worker_state(self, worker_id: int) -> WorkerState:
        return self._workers[check_int("worker_id", worker_id, low=0)].state

    def worker_ids(self) -> list[int]:
        return sorted(self._workers)

    def request_worker(self, request_id: int) -> tuple[int, int]:
        """(serving worker id, request epoch)."""
        request = self._requests[check_int("request_id", request_id, low=0)]
        return request.worker_id, request.epoch

    @property
    def failures(self) -> tuple[FailurePlan, ...]:
        return tuple(self._failures)

    @property
    def num_requests(self) -> int:
        return len(self._requests)

    @property
    def num_finished(self) -> int:
        return self._num_finished

    def metrics(self) -> GatewayMetrics:
        """Current gauges, computed by ``lumen_core.metrics`` (the simulator's module)."""
        monitor = self.monitor
        live = monitor.live_worker_ids()
        contexts, durables = [], []
        for request_id in monitor.request_ids():  # the monitor forgets finished requests
            request = self._requests[request_id]
            if request.worker_id not in live:
                continue
            view = monitor.request(request_id)
            contexts.append(len(request.prompt_token_ids) + len(request.tokens))
            durables.append(max((d for _, d in view.durable_tokens), default=0))
        coverage = checkpoint_coverage(np.array(contexts), np.array(durables))
        balance = holder_balance_ratio(np.array([monitor.worker(w).held_tokens for w in live]))
        proposed = sum(w.proposed_draft_tokens for w in self._workers.values())
        accepted = sum(w.accepted_draft_tokens for w in self._workers.values())
        recovery_s = replay_ttft_s = math.nan
        if self._failures and self._last_interrupted:
            failure_s = self._failures[-1].time_s
            requests = [self._requests[r] for r in self._last_interrupted]
            n = len(requests)
            records = RequestRecords(
                arrival_s=np.array([r.arrival_s for r in requests]),
                first_token_s=np.array([r.first_token_s for r in requests]),
                finish_s=np.array([r.finish_s for r in requests]),
                num_output_tokens=np.array([len(r.tokens) for r in requests]),
                interrupted=np.ones(n, dtype=bool),
                replay_token_s=np.array([r.replay_token_s for r in requests]),
            )
            replay = records.replay_ttft_s(failure_s)
            if not np.isnan(replay).any():
                recovery_s = float(replay.max())
                replay_ttft_s = float(replay.mean())
        elif self._failures:
            recovery_s = replay_ttft_s = 0.0
        return GatewayMetrics(
            coverage=coverage,
            holder_balance=balance,
            acceptance=acceptance_rate(accepted, proposed),
            recovery_s=recovery_s,
            replay_ttft_s=replay_ttft_s,
            num_failures=len(self._failures),
            num_parked=len(self.driver.parked),
            num_parked_total=self._num_parked_total,
            worker_load={w: monitor.load(w) for w in monitor.worker_ids()},
            worker_queue_depth={
                w: monitor.worker(w).num_running + monitor.worker(w).num_waiting for w in monitor.worker_ids()
            },
            worker_held_bytes={w.worker_id: w.held_bytes for w in self._workers.values()},
            worker_state={w.worker_id: w.state for w in self._workers.values()},
        )
