"""Layering of sim/ and of the modules it shares with the gateway (metrics, eventlog, cost):
no device, transport or gateway code; the shared modules import nothing of the simulator."""

from collections.abc import Callable
from pathlib import Path

import lumen_core.cost
import lumen_core.eventlog
import lumen_core.metrics
import lumen_core.sim

FORBIDDEN = ("torch", "lumen_core._native", "lumen_core.transport", "lumen_core.stream", "lumen_core.gateway")
SHARED = [Path(m.__file__) for m in (lumen_core.metrics, lumen_core.eventlog, lumen_core.cost)]


def test_simulator_and_shared_modules_import_no_device_transport_or_gateway_code(
    imported_modules: Callable[[Path], set[str]],
) -> None:
    files = sorted(Path(lumen_core.sim.__file__).parent.glob("*.py")) + SHARED
    assert {p.name for p in files} >= {"cluster.py", "experiments.py", "workload.py", "metrics.py", "cost.py"}
    for path in files:
        bad = [m for m in imported_modules(path) if m.startswith(FORBIDDEN)]
        assert not bad, (path.name, bad)


def test_modules_shared_with_the_gateway_do_not_depend_on_the_simulator(
    imported_modules: Callable[[Path], set[str]],
) -> None:
    for path in SHARED:
        assert not [m for m in imported_modules(path) if m.startswith("lumen_core.sim")], path.name
