"""The three policies the experiments compare, as bundles of placement, router and planner."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from lumen_core.policy.assist import AssistConfig, GainFn, SpecAssistPlanner, make_acceptance_gain
from lumen_core.policy.placement import FixedNeighbour, LoadAware, NoCheckpoint, Placement, PlacementConfig
from lumen_core.policy.routing import AllToHolder, LocalityAware, Rebalance, Router, RouterConfig

POLICY_NAMES = ("S&R", "FC", "LUMEN")

# Gain model used when LUMEN is built without the driver's cost model: acceptance 0.7 and a
# verify step costing 0.1 decode steps more per draft token (assist pays off at k = 4).
DEFAULT_ACCEPTANCE_RATE = 0.7
DEFAULT_VERIFY_COST_PER_DRAFT_TOKEN = 0.1


@dataclass(frozen=True)
class PolicySet:
    """One recovery policy: its placement, router and (LUMEN only) assist planner."""

    name: str
    placement: Placement
    router: Router
    planner: SpecAssistPlanner | None


def make_policy(
    name: str,
    *,
    placement_config: PlacementConfig = PlacementConfig(),
    router_config: RouterConfig = RouterConfig(),
    assist_config: AssistConfig = AssistConfig(),
    gain_fn: GainFn | None = None,
) -> PolicySet:
    """Build fresh policy objects for "S&R" (NoCheckpoint, Rebalance), "FC" (FixedNeighbour,
    AllToHolder) or "LUMEN" (LoadAware, LocalityAware, SpecAssistPlanner).

    placement_config applies to FC and LUMEN, router_config and assist_config to LUMEN;
    gain_fn defaults to ``make_acceptance_gain(DEFAULT_ACCEPTANCE_RATE,
    DEFAULT_VERIFY_COST_PER_DRAFT_TOKEN)``. Raises TypeError for a non-str name, ValueError
    for an unknown one.
    """
    if not isinstance(name, str):
        raise TypeError(f"name must be a str, got {type(name).__name__}")
    if name == "S&R":
        return PolicySet(name, NoCheckpoint(), Rebalance(), None)
    if name == "FC":
        return PolicySet(name, FixedNeighbour(placement_config), AllToHolder(), None)
    if name == "LUMEN":
        if gain_fn is None:
            gain_fn = make_acceptance_gain(DEFAULT_ACCEPTANCE_RATE, DEFAULT_VERIFY_COST_PER_DRAFT_TOKEN)
        planner = SpecAssistPlanner(assist_config, gain_fn)
        return PolicySet(name, LoadAware(placement_config), LocalityAware(router_config), planner)
    raise ValueError(f"name must be one of {', '.join(POLICY_NAMES)}, got {name!r}")


PolicyFactory = Callable[[GainFn], PolicySet]
"""Builds fresh policy objects for one driver, given the gain function the driver records."""


def preset(
    name: str,
    *,
    placement_config: PlacementConfig = PlacementConfig(),
    router_config: RouterConfig = RouterConfig(),
    assist_config: AssistConfig = AssistConfig(),
) -> PolicyFactory:
    """A factory of ``make_policy(name, ...)``; raises as ``make_policy`` now, not when a
    driver builds it."""
    make_policy(name)

    def build(gain_fn: GainFn) -> PolicySet:
        return make_policy(
            name,
            placement_config=placement_config,
            router_config=router_config,
            assist_config=assist_config,
            gain_fn=gain_fn,
        )

    return build
