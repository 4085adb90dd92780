"""transport/ moves bytes only: it imports nothing of stream/ (or any area above it), not even
for type checking, so no import cycle can run through it."""

from __future__ import annotations

import ast
from pathlib import Path

import lumen_core.transport

PACKAGE = Path(lumen_core.transport.__file__).parent
# What transport/ may import of lumen_core: the extension's loader, the cluster secret, itself.
ALLOWED = ("lumen_core._native", "lumen_core.secret", "lumen_core.transport")


def _lumen_imports(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return {name for name in names if name.split(".")[0] == "lumen_core"}


def test_transport_imports_only_itself_the_secret_and_the_extension() -> None:
    files = sorted(PACKAGE.glob("*.py"))
    assert len(files) >= 5  # __init__, client, server, wire, errors (and the checks)
    for path in files:
        for name in _lumen_imports(path):
            allowed = name in ALLOWED or name.startswith(tuple(a + "." for a in ALLOWED))
            assert allowed, f"{path.name} imports {name}"
