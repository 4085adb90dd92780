"""Fixtures of the partition tests: a test ``Network`` of namespaces (deleted after every test,
failed or not), skipped with the reason where this machine cannot build one."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

# The harness modules live beside this file (test support, not part of the package).
sys.path.insert(0, str(Path(__file__).resolve().parent))

import netns
from net_cluster import node_names


@pytest.fixture
def network(request: pytest.FixtureRequest, ucx_module: None) -> Iterator[netns.Network]:
    """A ``Network`` of the nodes ``request.param`` names (default: gateway, w0-w2, client)."""
    why = netns.unavailable()
    if why is not None:
        pytest.skip(why)
    netns.delete_stale_namespaces()
    network = netns.Network(getattr(request, "param", None) or node_names(3))
    try:
        yield network
    finally:
        network.close()
