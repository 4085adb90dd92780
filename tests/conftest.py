"""Fixtures shared by every test area: the UCX module requirement and the cluster secret."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from lumen_core import _native


@pytest.fixture
def ucx_module() -> None:
    """Skip where the UCX module was not asked for; with LUMEN_UCX=ON its absence fails."""
    if _native.C_ucx is None:
        why = _native.IMPORT_ERRORS.get("_C_ucx", "not built")
        if os.environ.get("LUMEN_UCX") == "ON":
            pytest.fail(f"LUMEN_UCX=ON but lumen_core._C_ucx is unavailable: {why}")
        pytest.skip(f"the UCX module is not built ({why})")


@pytest.fixture
def secret() -> bytes:
    return os.urandom(32)


@pytest.fixture
def secret_file(tmp_path: Path, secret: bytes) -> Path:
    path = tmp_path / "secret"
    path.write_bytes(secret)
    path.chmod(0o600)
    return path
