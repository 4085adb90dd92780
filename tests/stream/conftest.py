"""Fixtures of the stream tests: the module check, a secret file, and `lumen holder` (or other)
processes on loopback, killed and reaped after every test."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest


TLS = "tcp"


@pytest.fixture(autouse=True)
def _ucx_module(ucx_module: None) -> None:
    """Every test here needs the UCX module (tests/conftest.py)."""


class Proc:
    """A subprocess speaking JSON lines on stdout."""

    def __init__(self, args: list[str]) -> None:
        self.proc = subprocess.Popen(
            args, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
        )

    def read(self) -> dict[str, Any]:
        # Blocking: every test carries a pytest timeout that bounds a hung process.
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            raise AssertionError(f"process exited with {self.proc.wait(timeout=5)}")
        return json.loads(line)

    def ask(self, command: str) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(command + "\n")
        self.proc.stdin.flush()
        return self.read()

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(timeout=10)

    def reap(self) -> None:
        self.kill()
        for pipe in (self.proc.stdin, self.proc.stdout):
            if pipe is not None:
                pipe.close()


@pytest.fixture
def spawn() -> Iterator[Callable[[list[str]], Proc]]:
    procs: list[Proc] = []

    def _spawn(args: list[str]) -> Proc:
        proc = Proc(args)
        procs.append(proc)
        return proc

    yield _spawn
    for proc in procs:
        proc.reap()


@pytest.fixture
def holders(spawn: Callable[[list[str]], Proc], secret_file: Path) -> Callable[..., list[Proc]]:
    """holders(n, budget_bytes=..., *extra) -> n `lumen holder` processes started together;
    .port is each one's port."""

    def _holders(n: int, budget_bytes: int = 1 << 30, *extra: str) -> list[Proc]:
        procs = [
            spawn([
                sys.executable, "-m", "lumen_core.cli", "holder", "--port", "0",
                "--budget-bytes", str(budget_bytes), "--secret-file", str(secret_file),
                "--tls", TLS, *extra,
            ])
            for _ in range(n)
        ]
        for proc in procs:
            proc.port = proc.read()["port"]  # type: ignore[attr-defined]
        return procs

    return _holders


@pytest.fixture
def holder(holders: Callable[..., list[Proc]]) -> Callable[..., Proc]:
    """holder(budget_bytes=..., *extra) -> one `lumen holder` process; .port is its port."""

    def _holder(budget_bytes: int = 1 << 30, *extra: str) -> Proc:
        return holders(1, budget_bytes, *extra)[0]

    return _holder
