"""Recovery policies of LUMEN and its baselines: pure, deterministic, driven by events.

Stdlib and numpy only; no I/O, threads, wall clocks or torch. ``sim/`` and ``gateway/`` drive
the same classes through one ``RecoveryDriver`` (``policy.driver``) and feed them the same
events (``policy.events``).
"""

from lumen_core.policy.assist import (
    AssistConfig,
    GainFn,
    SpecAssistPlanner,
    expected_tokens_per_step,
    make_acceptance_gain,
)
from lumen_core.policy.driver import (
    AdmissionPlan,
    DrainPlan,
    FailurePlan,
    Parked,
    Recorder,
    RecoveryDriver,
    Reroute,
    Unpairing,
)
from lumen_core.policy.events import (
    AssistDecision,
    CheckpointEvicted,
    CheckpointGrew,
    CheckpointRefused,
    CheckpointReleased,
    CheckpointReserved,
    Event,
    Heartbeat,
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
from lumen_core.policy.load import LoadConfig, LoadMonitor, RequestView, WorkerView
from lumen_core.policy.placement import (
    FixedNeighbour,
    LoadAware,
    NoCheckpoint,
    Placement,
    PlacementConfig,
)
from lumen_core.policy.presets import POLICY_NAMES, PolicyFactory, PolicySet, make_policy, preset
from lumen_core.policy.routing import (
    AllToHolder,
    LocalityAware,
    Rebalance,
    Router,
    RouterConfig,
)

__all__ = [
    "AdmissionPlan",
    "AllToHolder",
    "AssistConfig",
    "AssistDecision",
    "CheckpointEvicted",
    "CheckpointGrew",
    "CheckpointRefused",
    "CheckpointReleased",
    "CheckpointReserved",
    "DrainPlan",
    "Event",
    "FailurePlan",
    "Parked",
    "FixedNeighbour",
    "GainFn",
    "Heartbeat",
    "LoadAware",
    "LoadConfig",
    "LoadMonitor",
    "LocalityAware",
    "NoCheckpoint",
    "POLICY_NAMES",
    "Placement",
    "PlacementConfig",
    "PlacementDecision",
    "PolicyFactory",
    "PolicySet",
    "Rebalance",
    "Recorder",
    "RecoveryAction",
    "RecoveryDriver",
    "RequestAdmitted",
    "RequestFinished",
    "RequestView",
    "Reroute",
    "RouteDecision",
    "Router",
    "RouterConfig",
    "SpecAssistPlanner",
    "Unpairing",
    "WorkerDraining",
    "WorkerFailed",
    "WorkerJoined",
    "WorkerRecovering",
    "WorkerState",
    "WorkerView",
    "expected_tokens_per_step",
    "make_acceptance_gain",
    "make_policy",
    "preset",
]
