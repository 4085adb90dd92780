"""Fixtures of the transport tests: the module check, a secret file, server and streamer
processes on loopback (reaped after every test)."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Any, Iterator

import pytest


PEER_PATH = Path(__file__).with_name("peer.py")
TLS = "tcp"  # the server's UCX_TLS; the tests' clients use the same


def _load_peer() -> ModuleType:
    spec = importlib.util.spec_from_file_location("lumen_transport_test_peer", PEER_PATH)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="session")
def peer() -> ModuleType:
    """tests/transport/peer.py as a module (make_append, SHARD, EPOCH, fingerprints)."""
    return _load_peer()


@pytest.fixture(autouse=True)
def _ucx_module(ucx_module: None) -> None:
    """Every test here needs the UCX module (tests/conftest.py)."""


class PeerProcess:
    """A peer.py subprocess speaking JSON lines."""

    def __init__(self, *args: str) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, str(PEER_PATH), *args],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )

    def read(self) -> dict[str, Any]:
        # Blocking: every test carries a pytest timeout that bounds a hung peer.
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            raise AssertionError(f"peer exited with {self.proc.wait(timeout=5)}")
        return json.loads(line)

    def ask(self, command: str) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(command + "\n")
        self.proc.stdin.flush()
        return self.read()

    def reap(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(timeout=10)
        for pipe in (self.proc.stdin, self.proc.stdout):
            if pipe is not None:
                pipe.close()


@pytest.fixture
def spawn() -> Iterator[Any]:
    """spawn(*peer_args) -> PeerProcess; every process is killed and reaped afterwards."""
    procs: list[PeerProcess] = []

    def _spawn(*args: str) -> PeerProcess:
        proc = PeerProcess(*args)
        procs.append(proc)
        return proc

    yield _spawn
    for proc in procs:
        proc.reap()


@pytest.fixture
def server(spawn: Any, secret_file: Path) -> PeerProcess:
    """A server process over TLS; .port is its port."""
    proc = spawn("serve", "--secret-file", str(secret_file), "--tls", TLS,
                 "--max-payload-bytes", str(64 << 20))
    proc.port = proc.read()["port"]
    return proc
