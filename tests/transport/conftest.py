"""Fixtures of the transport tests: the module check, a secret file, server and streamer
processes on loopback (reaped after every test)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

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


@pytest.fixture
def spawn(spawn: Any) -> Any:
    """spawn(*peer_args) -> a peer.py process (tests/conftest.py's spawn: killed and reaped
    after every test)."""
    return lambda *args: spawn([sys.executable, str(PEER_PATH), *args])


@pytest.fixture
def server(spawn: Any, secret_file: Path, issuer_public_key_file: Path) -> Any:
    """A server process over TLS trusting the `issuer` fixture; .port is its port."""
    proc = spawn(
        *("serve", "--secret-file", str(secret_file), "--issuer-key-file", str(issuer_public_key_file)),
        *("--tls", TLS, "--max-payload-bytes", str(64 << 20)),
    )
    proc.port = proc.read()["port"]
    return proc
