"""Events the drivers (simulator, gateway) feed to the policy objects, and the decisions the
policy objects return. Shared by ``sim/`` and ``gateway/`` so both speak one language.

Times are seconds on the driver's clock (``time_s``), injected, never read from a wall clock.
Sizes: tokens (``*_tokens``) for KV lengths, bytes (``*_bytes``) for host-memory budgets.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass


class WorkerState(str, enum.Enum):
    """A worker's state, one vocabulary for the monitor and both drivers. A ``str`` enum, so a
    state compares equal to its value ("serving") and prints as it."""

    SERVING = "serving"  # runs requests and may hold checkpoints
    RECOVERING = "recovering"  # restarted; its draft model is loaded, its full model still loading
    FAILED = "failed"  # dead (or fenced) until it restarts
    DRAINING = "draining"  # alive, admitted nothing, holds nothing: its requests are being moved

    def __str__(self) -> str:
        return self.value

    def __format__(self, spec: str) -> str:
        return format(self.value, spec)


# ---- events -------------------------------------------------------------------------------
@dataclass(frozen=True)
class WorkerJoined:
    """A worker is serving (first start, or rejoining after its full model loaded)."""

    time_s: float
    worker_id: int
    budget_bytes: int  # host DRAM it offers for checkpoints of other workers
    domain: str = ""  # failure domain (rack); "" = its own domain


@dataclass(frozen=True)
class WorkerFailed:
    """A worker died: its running requests are interrupted and the checkpoints it held lost."""

    time_s: float
    worker_id: int


@dataclass(frozen=True)
class WorkerDraining:
    """A serving worker is taken out (maintenance): it is admitted nothing and holds nothing
    from here on (its copies are dropped, to be placed again); its requests run on until they
    are moved."""

    time_s: float
    worker_id: int


@dataclass(frozen=True)
class WorkerRecovering:
    """A failed worker restarted and loaded its draft model; its full model is still loading."""

    time_s: float
    worker_id: int


@dataclass(frozen=True)
class Heartbeat:
    """Aggregates a worker reports a few times per second (never per token)."""

    time_s: float
    worker_id: int
    num_running: int
    num_waiting: int


@dataclass(frozen=True)
class RequestAdmitted:
    """The gateway routed a request to ``worker_id`` (new, or re-routed after a failure)."""

    time_s: float
    request_id: int
    worker_id: int
    prompt_tokens: int
    expected_output_tokens: int


@dataclass(frozen=True)
class RequestFinished:
    time_s: float
    request_id: int


@dataclass(frozen=True)
class CheckpointReserved:
    """Placement reserved ``reserved_bytes`` on each holder for the request's checkpoint.

    Placement objects reserve through the monitor directly; this event lets a driver replay a
    reservation from an event log (the gateway's, for instance) into another monitor. Do not
    also apply it to the monitor the placement reserved in: the holder would be reserved twice
    (ValueError).
    """

    time_s: float
    request_id: int
    holder_ids: tuple[int, ...]
    reserved_bytes: int  # per holder


@dataclass(frozen=True)
class CheckpointGrew:
    """Aggregated durable length of a request's checkpoint on one holder."""

    time_s: float
    request_id: int
    holder_id: int
    durable_tokens: int


@dataclass(frozen=True)
class CheckpointReleased:
    time_s: float
    request_id: int


@dataclass(frozen=True)
class CheckpointEvicted:
    """The holder dropped the checkpoint (budget pressure or expiry)."""

    time_s: float
    request_id: int
    holder_id: int


@dataclass(frozen=True)
class CheckpointRefused:
    """The holder refused the reservation placement made (it has the final word)."""

    time_s: float
    request_id: int
    holder_id: int


Event = (
    WorkerJoined
    | WorkerFailed
    | WorkerDraining
    | WorkerRecovering
    | Heartbeat
    | RequestAdmitted
    | RequestFinished
    | CheckpointReserved
    | CheckpointGrew
    | CheckpointReleased
    | CheckpointEvicted
    | CheckpointRefused
)


# ---- decisions ----------------------------------------------------------------------------
class RecoveryAction(enum.Enum):
    RESTORE = "restore"  # resume on the holder from its host-DRAM checkpoint
    REMOTE_RESTORE = "remote_restore"  # another worker pulls the checkpoint from the holder
    REPREFILL = "reprefill"  # recompute the prefix on the target


@dataclass(frozen=True)
class PlacementDecision:
    """Where a request's checkpoint goes. ``holder_ids`` empty means not checkpointed.

    ``holder_ids`` are all holders of the request after the decision; ``new_holder_ids`` the
    ones this decision reserved, to which the serving worker streams the checkpoint in full.
    """

    request_id: int
    serving_worker_id: int
    holder_ids: tuple[int, ...]
    reserved_bytes: int  # per holder
    reason: str
    new_holder_ids: tuple[int, ...] = ()


@dataclass(frozen=True)
class RouteDecision:
    """What happens to one interrupted request."""

    request_id: int
    target_worker_id: int
    action: RecoveryAction
    source_holder_id: int | None  # holder the KV comes from (restore, remote restore)
    restorable_tokens: int  # 0 for re-prefill
    reason: str


@dataclass(frozen=True)
class AssistDecision:
    """Pairing of a recovering worker (drafting) with a survivor (verifying)."""

    assistant_id: int
    survivor_id: int | None  # None: no pairing (no gain, or no survivor free)
    num_draft_tokens: int
    predicted_gain: float  # tokens per verify step gained, net of the verify step's cost
    reason: str
