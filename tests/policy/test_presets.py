"""make_policy: the three compared policies as bundles of fresh objects."""

from __future__ import annotations

import pytest

from lumen_core.policy import (
    AllToHolder,
    AssistConfig,
    FixedNeighbour,
    LoadAware,
    LocalityAware,
    NoCheckpoint,
    PlacementConfig,
    Rebalance,
    RouterConfig,
    SpecAssistPlanner,
    make_policy,
)


def test_bundles():
    sr = make_policy("S&R")
    assert isinstance(sr.placement, NoCheckpoint) and isinstance(sr.router, Rebalance) and sr.planner is None
    fc = make_policy("FC", placement_config=PlacementConfig(replicas=2))
    assert isinstance(fc.placement, FixedNeighbour) and isinstance(fc.router, AllToHolder)
    assert fc.placement.config.replicas == 2 and fc.planner is None
    lumen = make_policy(
        "LUMEN",
        router_config=RouterConfig(tau_tokens=64),
        assist_config=AssistConfig(num_draft_tokens=3),
        gain_fn=lambda monitor, survivor_id, k: 1.0,
    )
    assert isinstance(lumen.placement, LoadAware) and isinstance(lumen.router, LocalityAware)
    assert isinstance(lumen.planner, SpecAssistPlanner)
    assert lumen.router.config.tau_tokens == 64 and lumen.planner.config.num_draft_tokens == 3
    assert make_policy("LUMEN").planner is not make_policy("LUMEN").planner
    with pytest.raises(AttributeError):
        lumen.name = "other"


def test_validation():
    with pytest.raises(ValueError, match="`name` must be one of S&R, FC, LUMEN, got 'DejaVu'"):
        make_policy("DejaVu")
    with pytest.raises(TypeError, match="`name` must be a str, got int"):
        make_policy(1)
