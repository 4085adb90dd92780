from collections.abc import Callable
from pathlib import Path

import lumen_core.metrics
import lumen_core.sim

FORBIDDEN = ("torch", "lumen_core._native", "lumen_core.transport", "lumen_core.stream", "lumen_core.gateway")


def test_simulator_and_metrics_import_no_device_transport_or_gateway_code(
    imported_modules: Callable[[Path], set[str]],
) -> None:
    files = sorted(Path(lumen_core.sim.__file__).parent.glob("*.py")) + [Path(lumen_core.metrics.__file__)]
    assert len(files) >= 7
    for path in files:
        bad = [m for m in imported_modules(path) if m.startswith(FORBIDDEN)]
        assert not bad, (path.name, bad)
    # the metrics module is shared with the gateway: it must not depend on the simulator
    assert not [
        m for m in imported_modules(Path(lumen_core.metrics.__file__)) if m.startswith("lumen_core.sim")
    ]
