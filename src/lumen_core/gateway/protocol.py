"""Conversions between the gateway's message dataclasses (``directives``, ``reports``) and
lumen.proto's messages: the one place either side's fields meet the wire. Also who signs
each call (``CLUSTER_SIGNED``, ``WORKER_SIGNED``), what each answers (``REPLIES``) and the
ranges a worker's registration and reports must keep to (``check_registration``,
``check_report``, ``check_model_loaded``): the wire's u64s are wider than the gateway's int64
and float64 arithmetic, so a value outside them is refused where it enters (INVALID_ARGUMENT
for that call alone) instead of breaking a later call of someone else."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from lumen_core._validate import U32_MAX, check_int
from lumen_core.auth import ISSUER_KEY_BYTES, check_exchange_key
from lumen_core.gateway import lumen_pb2 as pb
from lumen_core.gateway.directives import (
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
from lumen_core.gateway.reports import HeldReport, LostReplica, RunningReport, StreamedReplica, WorkerReport
from lumen_core.policy.events import RecoveryAction, WorkerState

SERVICE = "lumen.gateway.v1.Gateway"

# Who signs each call: the cluster secret admits registrations and the client API; every later
# call of a worker is signed with its incarnation's call key, and its request must name that
# incarnation in these fields (worker id, epoch). Hello alone is unsigned.
UNSIGNED = frozenset({"Hello"})
CLUSTER_SIGNED = frozenset({"Register", "Submit", "Watch", "Status", "Drain"})
WORKER_SIGNED: dict[str, tuple[str, str]] = {
    "Heartbeat": ("worker_id", "epoch"),
    "Directives": ("worker_id", "epoch"),
    "ReportTokens": ("worker_id", "worker_epoch"),
    "ReportExit": ("worker_id", "epoch"),
    "ModelLoaded": ("worker_id", "epoch"),
}

# The reply message of each call, and whether it streams. Clients send bytes they serialized
# themselves (what they signed) and decode the replies with these once their MACs verify
# (Hello's, the one unsigned call, directly: ``auth.open_reply``).
REPLIES: dict[str, tuple[Any, bool]] = {
    "Hello": (pb.HelloReply, False),
    "Register": (pb.RegisterReply, False),
    "Heartbeat": (pb.HeartbeatReply, False),
    "Directives": (pb.Directive, True),
    "ReportTokens": (pb.TokenAcks, False),
    "ReportExit": (pb.ExitReply, False),
    "ModelLoaded": (pb.ModelLoadedReply, False),
    "Submit": (pb.TokenChunk, True),
    "Watch": (pb.TokenChunk, True),
    "Status": (pb.StatusReply, False),
    "Drain": (pb.DrainReply, False),
}

# Ranges of the reported quantities: byte counts and counters within 2**53 (exact in the
# float64 load arithmetic, far above any host's memory), token counts within u32 (the wire's
# positions), epochs below u32's top (a re-route adds one), shards within MAX_SHARDS (each
# grant carries a capability per shard), adopted request ids within int64 (the gateway numbers
# new requests above every adopted one, and they must stay u64s).
MAX_REPORTED_BYTES = 2**53
MAX_REPORTED_COUNT = 2**53
MAX_SHARDS = 1024
MAX_WORKER_ID = 2**31 - 1
MAX_REQUEST_ID = 2**63 - 1
# A worker's error for one request reaches its client's stream and the gateway's state: the
# text is cut to this many characters, its non-printables (newlines, escapes) replaced.
MAX_ERROR_CHARS = 512

_ACTION_TO_PB = {
    RecoveryAction.RESTORE: pb.RESTORE,
    RecoveryAction.REMOTE_RESTORE: pb.REMOTE_RESTORE,
    RecoveryAction.REPREFILL: pb.REPREFILL,
}
_ACTION_FROM_PB = {v: k for k, v in _ACTION_TO_PB.items()}
_STATE_TO_PB: dict[WorkerState, pb.WorkerState] = {
    WorkerState.SERVING: pb.SERVING,
    WorkerState.RECOVERING: pb.RECOVERING,
}
_STATE_FROM_PB: dict[int, WorkerState] = {int(v): k for k, v in _STATE_TO_PB.items()}


def method(name: str) -> str:
    """The full gRPC method name of a Gateway RPC (what call authentication signs)."""
    return f"/{SERVICE}/{name}"


def bound_error(error: str) -> str:
    """``error`` as it is sent and kept: its first ``MAX_ERROR_CHARS`` characters, each
    non-printable one as "?". Raises TypeError for a non-str."""
    if not isinstance(error, str):
        raise TypeError(f"error must be a str, got {type(error).__name__}")
    return "".join(c if c.isprintable() else "?" for c in error[:MAX_ERROR_CHARS])


def parse_address(address: str) -> tuple[str, int]:
    """A data-plane address as directives and registrations carry it (``"host:port"``) ->
    ``(host, port)``. ValueError on anything else."""
    if not isinstance(address, str):
        raise TypeError(f"address must be a str, got {type(address).__name__}")
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit() or not 1 <= int(port) <= 65535:
        raise ValueError(f"address must be 'host:port' with a port in [1, 65535], got {address!r}")
    return host, int(port)


def state_to_pb(state: str) -> pb.WorkerState:
    if state not in _STATE_TO_PB:
        raise ValueError(f"state must be 'serving' or 'recovering', got {state!r}")
    return _STATE_TO_PB[WorkerState(state)]


def state_from_pb(value: int) -> WorkerState:
    if value not in _STATE_FROM_PB:
        raise ValueError(f"state must be SERVING or RECOVERING, got {value}")
    return _STATE_FROM_PB[value]


def _grant_to_pb(grant: HolderGrant) -> pb.HolderGrant:
    return pb.HolderGrant(
        worker_id=grant.worker_id, address=grant.address, capabilities=list(grant.capabilities)
    )


def _grant_from_pb(grant: pb.HolderGrant) -> HolderGrant:
    return HolderGrant(grant.worker_id, grant.address, tuple(grant.capabilities))


def _grants_to_pb(grants: tuple[HolderGrant, ...]) -> list[pb.HolderGrant]:
    return [_grant_to_pb(g) for g in grants]


def _grants_from_pb(grants: Iterable[pb.HolderGrant]) -> tuple[HolderGrant, ...]:
    return tuple(_grant_from_pb(g) for g in grants)


# One converter pair per directive kind; each ``*_to_pb`` fills the field of Directive.body
# named in _FIELDS.


def _sampling_to_pb(sampling: Sampling) -> pb.Sampling:
    return pb.Sampling(temperature=sampling.temperature, seed=sampling.seed)


def _sampling_from_pb(m: pb.Sampling) -> Sampling:
    """An unset message reads as zeros: greedy."""
    return Sampling(m.temperature, m.seed)


def _run_to_pb(d: Run) -> pb.Run:
    return pb.Run(
        request_id=d.request_id,
        epoch=d.epoch,
        holders=_grants_to_pb(d.holders),
        prompt_token_ids=list(d.prompt_token_ids),
        max_new_tokens=d.max_new_tokens,
        reason=d.reason,
        sampling=_sampling_to_pb(d.sampling),
    )


def _run_from_pb(m: pb.Run) -> Run:
    return Run(
        m.request_id,
        m.epoch,
        _grants_from_pb(m.holders),
        tuple(m.prompt_token_ids),
        m.max_new_tokens,
        m.reason,
        _sampling_from_pb(m.sampling),
    )


def _resume_to_pb(d: Resume) -> pb.Resume:
    out = pb.Resume(
        request_id=d.request_id,
        epoch=d.epoch,
        action=_ACTION_TO_PB[d.action],
        holders=_grants_to_pb(d.holders),
        prompt_token_ids=list(d.prompt_token_ids),
        output_token_ids=list(d.output_token_ids),
        max_new_tokens=d.max_new_tokens,
        reason=d.reason,
        sampling=_sampling_to_pb(d.sampling),
    )
    if d.source is not None:
        out.source.CopyFrom(_grant_to_pb(d.source))
    return out


def _resume_from_pb(m: pb.Resume) -> Resume:
    if m.action not in _ACTION_FROM_PB:
        raise ValueError(f"action must be RESTORE, REMOTE_RESTORE or REPREFILL, got {m.action}")
    return Resume(
        m.request_id,
        m.epoch,
        _ACTION_FROM_PB[m.action],
        _grants_from_pb(m.holders),
        _grant_from_pb(m.source) if m.HasField("source") else None,
        tuple(m.prompt_token_ids),
        tuple(m.output_token_ids),
        m.max_new_tokens,
        m.reason,
        _sampling_from_pb(m.sampling),
    )


def _hold_to_pb(d: Hold) -> pb.Hold:
    return pb.Hold(
        request_id=d.request_id,
        epoch=d.epoch,
        grant=_grant_to_pb(d.grant),
        reserved_bytes=d.reserved_bytes,
        serving_worker_id=d.serving_worker_id,
        reason=d.reason,
    )


def _hold_from_pb(m: pb.Hold) -> Hold:
    return Hold(
        m.request_id, m.epoch, _grant_from_pb(m.grant), m.reserved_bytes, m.serving_worker_id, m.reason
    )


def _stream_to_pb(d: Stream) -> pb.Stream:
    return pb.Stream(
        request_id=d.request_id, epoch=d.epoch, holders=_grants_to_pb(d.holders), reason=d.reason
    )


def _stream_from_pb(m: pb.Stream) -> Stream:
    return Stream(m.request_id, m.epoch, _grants_from_pb(m.holders), m.reason)


def _renew_to_pb(d: Renew) -> pb.Renew:
    return pb.Renew(request_id=d.request_id, epoch=d.epoch, holders=_grants_to_pb(d.holders), reason=d.reason)


def _renew_from_pb(m: pb.Renew) -> Renew:
    return Renew(m.request_id, m.epoch, _grants_from_pb(m.holders), m.reason)


def _release_to_pb(d: Release) -> pb.Release:
    return pb.Release(request_id=d.request_id, epoch=d.epoch, reason=d.reason)


def _release_from_pb(m: pb.Release) -> Release:
    return Release(m.request_id, m.epoch, m.reason)


def _assist_draft_to_pb(d: AssistDraft) -> pb.AssistDraft:
    return pb.AssistDraft(
        survivor_id=d.survivor_id,
        survivor_address=d.survivor_address,
        num_draft_tokens=d.num_draft_tokens,
        reason=d.reason,
    )


def _assist_draft_from_pb(m: pb.AssistDraft) -> AssistDraft:
    return AssistDraft(m.survivor_id, m.survivor_address, m.num_draft_tokens, m.reason)


def _assist_verify_to_pb(d: AssistVerify) -> pb.AssistVerify:
    return pb.AssistVerify(
        assistant_id=d.assistant_id,
        assistant_address=d.assistant_address,
        num_draft_tokens=d.num_draft_tokens,
        reason=d.reason,
    )


def _assist_verify_from_pb(m: pb.AssistVerify) -> AssistVerify:
    return AssistVerify(m.assistant_id, m.assistant_address, m.num_draft_tokens, m.reason)


def _assist_stop_to_pb(d: AssistStop) -> pb.AssistStop:
    return pb.AssistStop(peer_worker_id=d.peer_worker_id, reason=d.reason)


def _assist_stop_from_pb(m: pb.AssistStop) -> AssistStop:
    return AssistStop(m.peer_worker_id, m.reason)


def _cancel_to_pb(d: Cancel) -> pb.Cancel:
    return pb.Cancel(request_id=d.request_id, reason=d.reason)


def _cancel_from_pb(m: pb.Cancel) -> Cancel:
    return Cancel(m.request_id, m.reason)


def _flush_to_pb(d: Flush) -> pb.Flush:
    return pb.Flush(reason=d.reason)


def _flush_from_pb(m: pb.Flush) -> Flush:
    return Flush(m.reason)


def _stop_to_pb(d: Stop) -> pb.Stop:
    return pb.Stop(reason=d.reason)


def _stop_from_pb(m: pb.Stop) -> Stop:
    return Stop(m.reason)


# kind -> (Directive.body field, to_pb, from_pb)
_FIELDS: dict[type, tuple[str, Callable[[Any], Any], Callable[[Any], Directive]]] = {
    Run: ("run", _run_to_pb, _run_from_pb),
    Resume: ("resume", _resume_to_pb, _resume_from_pb),
    Hold: ("hold", _hold_to_pb, _hold_from_pb),
    Stream: ("stream", _stream_to_pb, _stream_from_pb),
    Renew: ("renew", _renew_to_pb, _renew_from_pb),
    Release: ("release", _release_to_pb, _release_from_pb),
    AssistDraft: ("assist_draft", _assist_draft_to_pb, _assist_draft_from_pb),
    AssistVerify: ("assist_verify", _assist_verify_to_pb, _assist_verify_from_pb),
    AssistStop: ("assist_stop", _assist_stop_to_pb, _assist_stop_from_pb),
    Cancel: ("cancel", _cancel_to_pb, _cancel_from_pb),
    Flush: ("flush", _flush_to_pb, _flush_from_pb),
    Stop: ("stop", _stop_to_pb, _stop_from_pb),
}
_FROM_PB = {name: from_pb for name, _, from_pb in _FIELDS.values()}


def delivery_to_pb(delivery: Delivery) -> pb.Directive:
    """A numbered directive -> lumen.proto's Directive (its kind in the ``body`` oneof).
    TypeError for an object that is not one of the directive kinds."""
    kind = type(delivery.directive)
    if kind not in _FIELDS:
        raise TypeError(f"directive must be one of the directive kinds, got {kind.__name__}")
    name, to_pb, _ = _FIELDS[kind]
    out = pb.Directive(sequence=delivery.sequence)
    getattr(out, name).CopyFrom(to_pb(delivery.directive))
    return out


def delivery_from_pb(message: pb.Directive) -> Delivery:
    """lumen.proto's Directive -> its number and typed directive. ValueError for a message
    with no body (a sender newer than this build, or a corrupt one)."""
    name = message.WhichOneof("body")
    if name is None:
        raise ValueError(f"directive must have a body, got none (sequence {message.sequence})")
    return Delivery(message.sequence, _FROM_PB[name](getattr(message, name)))


def running_to_pb(report: RunningReport) -> pb.RunningRequest:
    return pb.RunningRequest(
        request_id=report.request_id,
        epoch=report.epoch,
        prompt_token_ids=list(report.prompt_token_ids),
        output_token_ids=list(report.output_token_ids),
        max_new_tokens=report.max_new_tokens,
        expected_output_tokens=report.expected_output_tokens,
    )


def running_from_pb(message: pb.RunningRequest) -> RunningReport:
    return RunningReport(
        message.request_id,
        message.epoch,
        tuple(message.prompt_token_ids),
        tuple(message.output_token_ids),
        message.max_new_tokens,
        message.expected_output_tokens,
    )


def held_to_pb(report: HeldReport) -> pb.HeldCheckpoint:
    return pb.HeldCheckpoint(
        request_id=report.request_id,
        epoch=report.epoch,
        durable_tokens=report.durable_tokens,
    )


def held_from_pb(message: pb.HeldCheckpoint) -> HeldReport:
    return HeldReport(message.request_id, message.epoch, message.durable_tokens)


def report_to_pb(report: WorkerReport) -> pb.WorkerReport:
    """A heartbeat's report (``running`` is not part of it: it travels with Register)."""
    return pb.WorkerReport(
        num_running=report.num_running,
        num_waiting=report.num_waiting,
        held_bytes=report.held_bytes,
        held=[held_to_pb(h) for h in report.held],
        refused_request_ids=list(report.refused_request_ids),
        evicted_request_ids=list(report.evicted_request_ids),
        assist_steps=report.assist_steps,
        proposed_draft_tokens=report.proposed_draft_tokens,
        accepted_draft_tokens=report.accepted_draft_tokens,
        lost_replicas=[
            pb.LostReplica(request_id=r.request_id, holder_worker_id=r.holder_worker_id)
            for r in report.lost_replicas
        ],
        flushed=report.flushed,
        streamed=[
            pb.StreamedReplica(
                request_id=r.request_id,
                epoch=r.epoch,
                holder_worker_id=r.holder_worker_id,
                durable_tokens=r.durable_tokens,
            )
            for r in report.streamed
        ],
    )


def report_from_pb(message: pb.WorkerReport) -> WorkerReport:
    return WorkerReport(
        num_running=message.num_running,
        num_waiting=message.num_waiting,
        held_bytes=message.held_bytes,
        held=tuple(held_from_pb(h) for h in message.held),
        refused_request_ids=tuple(message.refused_request_ids),
        evicted_request_ids=tuple(message.evicted_request_ids),
        assist_steps=message.assist_steps,
        proposed_draft_tokens=message.proposed_draft_tokens,
        accepted_draft_tokens=message.accepted_draft_tokens,
        lost_replicas=tuple(LostReplica(r.request_id, r.holder_worker_id) for r in message.lost_replicas),
        flushed=message.flushed,
        streamed=tuple(
            StreamedReplica(r.request_id, r.epoch, r.holder_worker_id, r.durable_tokens)
            for r in message.streamed
        ),
    )


def _check_held(name: str, held: Iterable[pb.HeldCheckpoint | pb.StreamedReplica]) -> None:
    for h in held:
        check_int(f"{name}.request_id", h.request_id, 0, MAX_REQUEST_ID)
        check_int(f"{name}.epoch", h.epoch, 0, U32_MAX - 1)
        check_int(f"{name}.durable_tokens", h.durable_tokens, 0, U32_MAX)


def check_registration(request: pb.RegisterRequest) -> None:
    """Raise ValueError for a RegisterRequest field outside the range the gateway can hold."""
    check_int("worker_id", request.worker_id, 0, MAX_WORKER_ID)
    check_int("budget_bytes", request.budget_bytes, 0, MAX_REPORTED_BYTES)
    check_int("num_shards", request.num_shards, 0, MAX_SHARDS)
    check_int("last_epoch", request.last_epoch, 0, U32_MAX - 1)  # the new epoch is one above
    for r in request.running:
        check_int("running.request_id", r.request_id, 0, MAX_REQUEST_ID)
        check_int("running.epoch", r.epoch, 0, U32_MAX - 1)
        if len(r.output_token_ids) > r.max_new_tokens:
            raise ValueError(
                f"`running.output_token_ids` must hold at most max_new_tokens={r.max_new_tokens} tokens, "
                f"got {len(r.output_token_ids)}"
            )
    _check_held("held", request.held)
    check_exchange_key("exchange_public_key", request.exchange_public_key)  # the call key's wrap
    if len(request.identity_public_key) not in (0, ISSUER_KEY_BYTES):
        raise ValueError(
            f"`identity_public_key` must be empty or {ISSUER_KEY_BYTES} bytes, "
            f"got {len(request.identity_public_key)}"
        )


def check_report(report: pb.WorkerReport) -> None:
    """Raise ValueError for a heartbeat report field outside the range the gateway can hold."""
    check_int("report.held_bytes", report.held_bytes, 0, MAX_REPORTED_BYTES)
    for name in ("assist_steps", "proposed_draft_tokens", "accepted_draft_tokens"):
        check_int(f"report.{name}", getattr(report, name), 0, MAX_REPORTED_COUNT)
    _check_held("report.held", report.held)
    _check_held("report.streamed", report.streamed)


def check_model_loaded(request: pb.ModelLoadedRequest) -> None:
    """Raise ValueError for a ModelLoadedRequest budget outside the range the gateway can hold."""
    check_int("budget_bytes", request.budget_bytes, 0, MAX_REPORTED_BYTES)
