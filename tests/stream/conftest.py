"""Fixtures of the stream tests: the module check and `lumen holder` processes on loopback
(spawned with tests/conftest.py's `spawn`, killed and reaped after every test)."""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

TLS = "tcp"


@pytest.fixture(autouse=True)
def _ucx_module(ucx_module: None) -> None:
    """Every test here needs the UCX module (tests/conftest.py)."""


@pytest.fixture
def holders(
    spawn: Callable[[list[str]], Any], secret_file: Path, issuer_public_key_file: Path
) -> Callable[..., list[Any]]:
    """holders(n, budget_bytes=..., *extra) -> n `lumen holder` processes started together,
    trusting the `issuer` fixture, each holder id 0; .port is each one's port."""

    def _holders(n: int, budget_bytes: int = 1 << 30, *extra: str) -> list[Any]:
        procs = [
            spawn(
                [
                    sys.executable,
                    "-m",
                    "lumen_core.cli",
                    "holder",
                    "--port",
                    "0",
                    "--budget-bytes",
                    str(budget_bytes),
                    "--secret-file",
                    str(secret_file),
                    "--issuer-key-file",
                    str(issuer_public_key_file),
                    "--tls",
                    TLS,
                    *extra,
                ]
            )
            for _ in range(n)
        ]
        for proc in procs:
            proc.port = proc.read()["port"]  # type: ignore[attr-defined]
        return procs

    return _holders


@pytest.fixture
def holder(holders: Callable[..., list[Any]]) -> Callable[..., Any]:
    """holder(budget_bytes=..., *extra) -> one `lumen holder` process; .port is its port."""

    def _holder(budget_bytes: int = 1 << 30, *extra: str) -> Any:
        return holders(1, budget_bytes, *extra)[0]

    return _holder
