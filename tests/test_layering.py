"""Layering contracts of every area of lumen_core (docs/design.md, STYLE.md "Layering"),
checked by parsing imports, lazy ones inside functions included.

An area is a subpackage (``policy``, ``transport``, ...) or a top-level module (``ops``,
``verify``, ...). Each may import itself and the areas ALLOWED names for it; an entry with a
dot (``sim.eventlog``) allows that one module only.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

import lumen_core

pytestmark = pytest.mark.timeout(60)

PACKAGE = Path(lumen_core.__file__).parent

# The contract: which other areas each area may import. Adding an edge is a design decision.
ALLOWED: dict[str, frozenset[str]] = {
    name: frozenset(deps)
    for name, deps in {
        # leaves: checks, native loading, formats and shared arithmetic
        "_validate": set(),
        "_native": set(),
        "rng": set(),
        "metrics": set(),
        "cost": set(),
        "eventlog": {"policy"},
        "layouts": set(),
        "auth": {"_native", "_validate"},
        # the data-plane ops and their specification
        "_tensors": {"_validate"},
        "ops": {"_native", "_tensors", "_validate", "layouts"},
        "verify": {"_native", "_tensors", "_validate"},
        "staging": {"_native", "_validate"},
        "reference": {"layouts", "rng", "verify"},
        "testing": {"layouts", "ops"},
        # policies are pure: they receive events and return decisions
        "policy": {"_validate"},
        # transport moves bytes only; stream knows records and holders; neither knows policy
        "transport": {"_native", "_validate", "auth"},
        "stream": {"_native", "_validate", "auth", "engine", "layouts", "ops", "transport"},
        # the engine-neutral connector core over stream's streamer and holders
        "connector": {"_validate", "auth", "layouts", "stream", "transport"},
        "engine": {"_validate", "layouts", "ops", "rng", "verify"},
        # the two drivers of the policy driver; they import nothing of each other
        "sim": {"_validate", "cost", "eventlog", "metrics", "policy", "rng"},
        "gateway": {"_validate", "auth", "eventlog", "metrics", "policy"},
        # engine steps paced to the cost model (the engine's StepOutput for its type only)
        "pacing": {"cost", "engine"},
        "worker": {
            "_validate",
            "auth",
            "connector",
            "engine",
            "gateway",
            "integrations",
            "metrics",
            "pacing",
            "policy",
            "sim",
            "stream",
        },  # fmt: skip
        # engine adapters: each speaks one engine's API over the data plane
        "integrations": {"auth", "connector", "engine", "layouts", "stream", "transport"},
        # entry points
        "cli": {"auth", "gateway", "policy", "sim", "stream", "transport", "worker"},
        "__init__": {"_native", "policy"},
    }.items()
}

# Areas that must run without torch and without the native extension (the control plane).
TORCH_FREE = {"_validate", "rng", "metrics", "cost", "eventlog", "auth", "policy", "sim", "gateway"}
# policy/: stdlib and numpy only, and no I/O, threads, clocks or randomness of its own.
POLICY_FORBIDDEN_STDLIB = {
    "threading",
    "multiprocessing",
    "concurrent",
    "asyncio",
    "subprocess",
    "socket",
    "time",
    "datetime",
    "random",
    "os",
    "io",
    "shutil",
    "pathlib",
    "tempfile",
    "signal",
    "select",
    "selectors",
    "sched",
    "queue",
    "logging",
    "pickle",
    "sqlite3",
    "urllib",
    "http",
}
POLICY_FORBIDDEN_CALLS = {"open", "print", "input", "exec", "eval", "__import__"}


def imported_modules(tree: ast.AST) -> set[str]:
    """Every module a source imports; ``from lumen_core import x`` names ``lumen_core.x``.
    Raises AssertionError on a relative import (the package uses absolute ones only)."""
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            assert node.level == 0, f"relative import of {node.module!r}"
            if node.module == "lumen_core":
                names.update(f"lumen_core.{alias.name}" for alias in node.names)
            else:
                names.add(node.module or "")
    return names


def area_of(path: Path) -> str:
    relative = path.relative_to(PACKAGE)
    return relative.parts[0] if len(relative.parts) > 1 else relative.stem


def sources() -> dict[str, list[Path]]:
    """The package's hand-written Python files by area (generated protobuf stubs left out)."""
    by_area: dict[str, list[Path]] = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        if not path.name.startswith("lumen_pb2"):
            by_area.setdefault(area_of(path), []).append(path)
    return by_area


def violations(area: str, source: str) -> list[str]:
    """What in ``source`` (a file of ``area``) breaks the area's contract."""
    tree = ast.parse(source)
    allowed = ALLOWED[area] | {area}
    found = []
    for name in sorted(imported_modules(tree)):
        parts = name.split(".")
        top = parts[0]
        if top == "lumen_core":
            if len(parts) == 1:
                found.append("import of the lumen_core package root")
                continue
            target = parts[1] if parts[1] in ALLOWED else "__init__"  # a name the root re-exports
            if target not in allowed and ".".join(parts[1:3]) not in allowed:
                found.append(f"import of {name}")
        elif (area in TORCH_FREE and top == "torch") or (
            area == "policy"
            and (top in POLICY_FORBIDDEN_STDLIB or (top != "numpy" and top not in sys.stdlib_module_names))
        ):
            found.append(f"import of {name}")
    if area == "policy":
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Name)
                and node.func.id in POLICY_FORBIDDEN_CALLS
            ):
                found.append(f"call of {node.func.id}()")
    return found


def test_every_area_has_a_contract() -> None:
    assert set(sources()) == set(ALLOWED)


def test_every_allowed_area_exists() -> None:
    for area, deps in ALLOWED.items():
        for dep in deps:
            assert dep.split(".")[0] in ALLOWED, (area, dep)


@pytest.mark.parametrize("area", sorted(ALLOWED))
def test_area_imports_only_what_its_contract_allows(area: str) -> None:
    for path in sources()[area]:
        assert violations(area, path.read_text()) == [], path.relative_to(PACKAGE)


def test_the_coordinator_has_no_io_threads_or_clock() -> None:
    modules = imported_modules(ast.parse((PACKAGE / "gateway" / "coordinator.py").read_text()))
    assert not modules & {"grpc", "threading", "time", "socket", "prometheus_client", "concurrent.futures"}


def test_the_worker_does_not_import_the_coordinator() -> None:
    """The worker speaks to the gateway through its client and message types only; the
    coordinator's decisions reach it as directives, never as a call into gateway.coordinator."""
    for path in sources()["worker"]:
        modules = imported_modules(ast.parse(path.read_text()))
        assert "lumen_core.gateway.coordinator" not in modules, path.relative_to(PACKAGE)


def test_checker_catches_violations() -> None:
    assert violations("transport", "from lumen_core.stream.holder import HolderStore\n") == [
        "import of lumen_core.stream.holder"
    ]
    assert violations("gateway", "from lumen_core.eventlog import EventLog\n") == []
    assert violations("gateway", "from lumen_core.sim.cluster import SimCluster\n") == [
        "import of lumen_core.sim.cluster"
    ]
    assert violations("gateway", "import torch\n") == ["import of torch"]
    assert violations("ops", "import torch\nfrom lumen_core import _native\n") == []
    assert violations("sim", "from lumen_core import HAS_CUDA\n") == ["import of lumen_core.HAS_CUDA"]
    assert violations("engine", "import lumen_core\n") == ["import of the lumen_core package root"]
    assert violations("policy", "import time\n") == ["import of time"]
    assert violations("policy", "from threading import Thread\n") == ["import of threading"]
    assert violations("policy", "import scipy\n") == ["import of scipy"]
    assert violations("policy", "from lumen_core import _native\n") == ["import of lumen_core._native"]
    assert violations("policy", "x = open('f')\n") == ["call of open()"]
    assert violations("policy", "import numpy as np\nfrom lumen_core._validate import check_int\n") == []
    with pytest.raises(AssertionError, match="relative import"):
        violations("ops", "from . import layouts\n")
