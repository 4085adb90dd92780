"""GatewayConfig: the gateway's policy, lease, retention and capability lifetime settings,
checked on construction.

A module of its own so that what only configures a gateway (the worker's local cluster, the
command line) need not import the coordinator.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from lumen_core._validate import check_int, check_number
from lumen_core.auth import DEFAULT_CAPABILITY_TTL_S
from lumen_core.policy.assist import AssistConfig
from lumen_core.policy.load import LoadConfig
from lumen_core.policy.placement import PlacementConfig
from lumen_core.policy.presets import POLICY_NAMES
from lumen_core.policy.routing import RouterConfig


@dataclass(frozen=True)
class GatewayConfig:
    """policy: "S&R", "FC" or "LUMEN". lease_s: a worker not heard from for this long is failed
    (10 s: several missed heartbeats on a busy 2-core machine before anyone is declared dead).
    heartbeat_s: the period workers are told to heartbeat at (well under lease_s).
    finished_retention_s: a finished request's tokens stay watchable this long, then are
    forgotten (``forget_finished``), so a long-running gateway does not grow without bound.
    capability_ttl_s: how long a checkpoint capability is valid after it is issued (the
    issuer's lifetime). capability_renew_share: once a running request's capabilities have
    used this share of their lifetime, the gateway issues fresh ones (``Renew``); the rest is
    the margin a renewal has to reach the worker, which must exceed ``heartbeat_s``.
    park_leases: with no worker left serving, interrupted requests are parked this many leases
    (then lost) waiting for a worker to register; max_parked: at most this many are parked
    (the rest are lost), so a broken cluster cannot make the gateway hold unbounded state."""

    policy: str = "LUMEN"
    lease_s: float = 10.0
    heartbeat_s: float = 1.0
    finished_retention_s: float = 600.0
    capability_ttl_s: float = DEFAULT_CAPABILITY_TTL_S
    capability_renew_share: float = 0.5
    park_leases: float = 6.0
    max_parked: int = 1024
    load_config: LoadConfig = LoadConfig()
    placement_config: PlacementConfig = PlacementConfig()
    router_config: RouterConfig = RouterConfig()
    assist_config: AssistConfig = AssistConfig()

    def __post_init__(self) -> None:
        if self.policy not in POLICY_NAMES:
            raise ValueError(f"policy must be one of {', '.join(POLICY_NAMES)}, got {self.policy!r}")
        check_number("lease_s", self.lease_s, positive=True)
        check_number("heartbeat_s", self.heartbeat_s, positive=True)
        check_number("finished_retention_s", self.finished_retention_s, positive=True)
        ttl_s = check_number("capability_ttl_s", self.capability_ttl_s, positive=True)
        if math.isinf(ttl_s):
            raise ValueError(f"capability_ttl_s must be finite, got {self.capability_ttl_s}")
        share = check_number("capability_renew_share", self.capability_renew_share, positive=True)
        if not share < 1.0:
            raise ValueError(f"capability_renew_share must be in (0, 1), got {self.capability_renew_share}")
        # A renewal must have time to arrive even by a heartbeat reply (the fallback path).
        if ttl_s * (1.0 - share) <= self.heartbeat_s:
            raise ValueError(
                "capability_ttl_s * (1 - capability_renew_share) must be > "
                f"heartbeat_s ({self.heartbeat_s}), got {ttl_s} * (1 - {share}) = {ttl_s * (1.0 - share)}"
            )
        check_number("park_leases", self.park_leases, low=0.0)
        check_int("max_parked", self.max_parked, low=0)
        if self.heartbeat_s >= self.lease_s:
            raise ValueError(f"heartbeat_s must be < lease_s ({self.lease_s}), got {self.heartbeat_s}")
        for name, cls in (
            ("load_config", LoadConfig),
            ("placement_config", PlacementConfig),
            ("router_config", RouterConfig),
            ("assist_config", AssistConfig),
        ):
            if not isinstance(getattr(self, name), cls):
                raise TypeError(f"{name} must be a {cls.__name__}, got {type(getattr(self, name)).__name__}")
