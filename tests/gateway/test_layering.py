"""Layering of gateway/: no device, transport or engine code; the Coordinator is pure."""

from collections.abc import Callable
from pathlib import Path

import pytest

import lumen_core.gateway

pytestmark = pytest.mark.timeout(60)

GATEWAY = Path(lumen_core.gateway.__file__).parent
FORBIDDEN = ("torch", "lumen_core._native", "lumen_core.transport", "lumen_core.stream", "lumen_core.engine")


def test_gateway_imports_no_device_transport_or_engine_code_and_only_the_sims_event_log(
    imported_modules: Callable[[Path], set[str]],
) -> None:
    files = [p for p in sorted(GATEWAY.glob("*.py")) if not p.name.startswith("lumen_pb2")]
    assert {p.name for p in files} >= {"client.py", "command.py", "coordinator.py", "server.py"}
    for path in files:
        modules = imported_modules(path)
        assert not [m for m in modules if m.startswith(FORBIDDEN)], path.name
        assert {m for m in modules if m.startswith("lumen_core.sim")} <= {"lumen_core.sim.eventlog"}, (
            path.name
        )


def test_the_coordinator_has_no_io_threads_or_clock(
    imported_modules: Callable[[Path], set[str]],
) -> None:
    modules = imported_modules(GATEWAY / "coordinator.py")
    assert not modules & {"grpc", "threading", "time", "socket", "prometheus_client", "concurrent.futures"}
