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
# The tests import their shared records (checkpoint_records.py) by name.
sys.path.insert(0, str(Path(__file__).parent))
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


@pytest.fixture
def spawn_streamer(spawn: Any, secret_file: Path, issuer: Any, peer: ModuleType) -> Any:
    """spawn_streamer(port, request_id, tokens_per_append, record_bytes, *, num_appends,
    interval_s=None) -> a peer.py streamer writing request_id at peer.EPOCH (window 4),
    granted by the `issuer` fixture."""

    def start(
        port: int,
        request_id: int,
        tokens_per_append: int,
        record_bytes: int,
        *,
        num_appends: int,
        interval_s: float | None = None,
    ) -> Any:
        capability = issuer.issue(request_id, peer.SHARD, peer.EPOCH, holder_id=0)
        return spawn(
            *("stream", "--port", str(port), "--secret-file", str(secret_file), "--tls", TLS),
            *("--capability", capability.hex(), "--request-id", str(request_id)),
            *("--num-appends", str(num_appends), "--window", "4"),
            *("--tokens-per-append", str(tokens_per_append), "--record-bytes", str(record_bytes)),
            *(("--interval-s", str(interval_s)) if interval_s is not None else ()),
        )

    return start
