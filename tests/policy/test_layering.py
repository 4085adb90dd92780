"""policy/ stays pure: stdlib and numpy only; no I/O, threads, wall clocks, torch, native code
or other lumen_core areas (DESIGN.md section 2)."""

from __future__ import annotations

import ast
import pathlib
import sys

import lumen_core.policy

POLICY_DIR = pathlib.Path(lumen_core.policy.__file__).parent
FORBIDDEN_MODULES = {
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
    "grpc",
    "torch",
}
ALLOWED_LUMEN = "lumen_core.policy"
FORBIDDEN_CALLS = {"open", "print", "input", "exec", "eval", "__import__"}


def imported_modules(tree: ast.AST) -> list[str]:
    names = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            assert node.level == 0, "policy modules use absolute imports"
            names.append(node.module or "")
    return names


def violations(source: str) -> list[str]:
    tree = ast.parse(source)
    found = []
    for name in imported_modules(tree):
        top = name.split(".")[0]
        if top == "lumen_core":
            if name != ALLOWED_LUMEN and not name.startswith(ALLOWED_LUMEN + "."):
                found.append(f"import of {name}")
        elif top in FORBIDDEN_MODULES:
            found.append(f"import of {name}")
        elif top != "numpy" and top not in sys.stdlib_module_names:
            found.append(f"import of third-party {name}")
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in FORBIDDEN_CALLS:
            found.append(f"call of {node.func.id}()")
    return found


def test_policy_modules_are_pure():
    files = sorted(POLICY_DIR.glob("*.py"))
    assert {f.name for f in files} >= {"events.py", "load.py", "placement.py", "routing.py", "assist.py"}
    for path in files:
        assert violations(path.read_text()) == [], path.name


def test_checker_catches_violations():
    assert violations("import time\n") == ["import of time"]
    assert violations("from threading import Thread\n") == ["import of threading"]
    assert violations("import torch.nn\n") == ["import of torch.nn"]
    assert violations("from lumen_core import _native\n") == ["import of lumen_core"]
    assert violations("import lumen_core.transport\n") == ["import of lumen_core.transport"]
    assert violations("import scipy\n") == ["import of third-party scipy"]
    assert violations("x = open('f')\n") == ["call of open()"]
    assert violations("import numpy as np\nfrom lumen_core.policy.events import Event\n") == []
