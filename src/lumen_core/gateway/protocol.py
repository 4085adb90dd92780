"""Conversions between the Coordinator's dataclasses and lumen.proto's messages."""

from __future__ import annotations

from lumen_core.gateway import lumen_pb2 as pb
from lumen_core.gateway.coordinator import (
    Directive,
    HeldReport,
    HolderGrant,
    RunningReport,
)
from lumen_core.policy.events import RecoveryAction, WorkerState

SERVICE = "lumen.gateway.v1.Gateway"

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
    return _STATE_TO_PB[state]


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


def directive_to_pb(directive: Directive) -> pb.Directive:
    out = pb.Directive(
        kind=pb.Directive.Kind.Value(directive.kind.upper()),
        request_id=directive.request_id,
        epoch=directive.epoch,
        holders=[_grant_to_pb(g) for g in directive.holders],
        restorable_tokens=directive.restorable_tokens,
        prompt_token_ids=list(directive.prompt_token_ids),
        output_token_ids=list(directive.output_token_ids),
        max_new_tokens=directive.max_new_tokens,
        reserved_bytes=directive.reserved_bytes,
        peer_worker_id=directive.peer_worker_id,
        peer_address=directive.peer_address,
        num_draft_tokens=directive.num_draft_tokens,
        reason=directive.reason,
    )
    if directive.action is not None:
        out.action = _ACTION_TO_PB[directive.action]
    if directive.source is not None:
        out.source.CopyFrom(_grant_to_pb(directive.source))
    return out


def directive_from_pb(message: pb.Directive) -> Directive:
    return Directive(
        kind=pb.Directive.Kind.Name(message.kind).lower(),
        request_id=message.request_id,
        epoch=message.epoch,
        action=_ACTION_FROM_PB.get(message.action),
        holders=tuple(_grant_from_pb(g) for g in message.holders),
        source=_grant_from_pb(message.source) if message.HasField("source") else None,
        restorable_tokens=message.restorable_tokens,
        prompt_token_ids=tuple(message.prompt_token_ids),
        output_token_ids=tuple(message.output_token_ids),
        max_new_tokens=message.max_new_tokens,
        reserved_bytes=message.reserved_bytes,
        peer_worker_id=message.peer_worker_id,
        peer_address=message.peer_address,
        num_draft_tokens=message.num_draft_tokens,
        reason=message.reason,
    )


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
