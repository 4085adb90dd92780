"""Layering of gateway/: no device, transport or engine code, nothing of the simulator; the
Coordinator is pure."""

from collections.abc import Callable
from pathlib import Path

import pytest

import lumen_core.gateway

pytestmark = pytest.mark.timeout(60)

GATEWAY = Path(lumen_core.gateway.__file__).parent
FORBIDDEN = (
    "torch",
    "lumen_core._native",
    "lumen_core.transport",
    "lumen_core.stream",
    "lumen_core.engine",
    "lumen_core.sim",
)


def test_gateway_imports_no_device_transport_engine_or_simulator_code(
    imported_modules: Callable[[Path], set[str]],
) -> None:
    files = [p for p in sorted(GATEWAY.glob("*.py")) if not p.name.startswith("lumen_pb2")]
    assert {p.name for p in files} >= {"auth.py", "client.py", "command.py", "coordinator.py", "server.py"}
    for path in files:
        bad = [m for m in imported_modules(path) if m.startswith(FORBIDDEN)]
        assert not bad, (path.name, bad)


def test_the_coordinator_has_no_io_threads_or_clock(
    imported_modules: Callable[[Path], set[str]],
) -> None:
    modules = imported_modules(GATEWAY / "coordinator.py")
    assert not modules & {"grpc", "threading", "time", "socket", "prometheus_client", "concurrent.futures"}
