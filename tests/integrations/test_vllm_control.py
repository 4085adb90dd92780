"""The connector's local control channel (``integrations.vllm.control``) on a real Unix socket:
owner-only, peers of other uids refused, bounded messages, errors as replies."""

from __future__ import annotations

import json
import os
import socket
import stat
import threading
from pathlib import Path
from typing import Any

import pytest

from lumen_core.integrations.vllm.control import MAX_MESSAGE_BYTES, ControlError, ControlServer, ask


def _echo(request: dict[str, Any]) -> dict[str, Any]:
    if request.get("command") == "bad":
        raise ValueError("`command` bad is refused here")
    return {"got": request}


@pytest.fixture
def server(tmp_path: Path) -> ControlServer:
    server = ControlServer(tmp_path / "c.sock", _echo)
    yield server
    server.close()


def _raw(path: Path, data: bytes) -> bytes:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
        conn.settimeout(5.0)
        conn.connect(str(path))
        try:
            conn.sendall(data)
        except BrokenPipeError:
            pass
        chunks = []
        try:
            while chunk := conn.recv(65536):
                chunks.append(chunk)
        except ConnectionResetError:  # closed with our bytes unread: what a refusal may look like
            pass
        return b"".join(chunks)


def test_a_command_is_answered_and_the_socket_is_owner_only(server: ControlServer) -> None:
    assert ask(server.path, "stats", extra=3) == {"got": {"command": "stats", "extra": 3}}
    assert stat.S_IMODE(server.path.stat().st_mode) == 0o600


def test_a_refused_command_raises_with_the_handlers_message(server: ControlServer) -> None:
    with pytest.raises(ControlError, match="`command` bad is refused here"):
        ask(server.path, "bad")


@pytest.mark.parametrize(
    ("data", "message"),
    [(b"not json\n", "Expecting value"), (b"[1, 2]\n", "must be a JSON object, got list")],
)
def test_malformed_requests_get_an_error_reply(server: ControlServer, data: bytes, message: str) -> None:
    reply = json.loads(_raw(server.path, data))
    assert message in reply["error"]


def test_messages_are_bounded_both_ways(server: ControlServer) -> None:
    with pytest.raises(ValueError, match=f"at most {MAX_MESSAGE_BYTES} bytes"):
        ask(server.path, "stats", padding="x" * MAX_MESSAGE_BYTES)
    # Past the bound the server stops reading: an error reply, or a reset if it closed first.
    reply = _raw(server.path, b"x" * (2 * MAX_MESSAGE_BYTES) + b"\n")
    assert reply == b"" or f"at most {MAX_MESSAGE_BYTES} bytes" in json.loads(reply)["error"]
    assert ask(server.path, "stats")["got"] == {"command": "stats"}  # and serves the next one


def test_a_peer_of_another_uid_is_closed_unanswered(server: ControlServer) -> None:
    server._uid = os.getuid() + 1  # the engine runs as another user than this client
    with pytest.raises(ControlError, match="did not answer"):
        ask(server.path, "stats")
    assert server.num_refused_peers == 1


def test_connections_are_served_side_by_side(tmp_path: Path) -> None:
    release = threading.Event()

    def slow(request: dict[str, Any]) -> dict[str, Any]:
        if request["command"] == "wait":
            release.wait(5.0)
        return {"done": request["command"]}

    server = ControlServer(tmp_path / "s.sock", slow)
    try:
        waiting = threading.Thread(target=ask, args=(server.path, "wait"))
        waiting.start()
        assert ask(server.path, "stats") == {"done": "stats"}  # not queued behind the wait
        release.set()
        waiting.join(timeout=5.0)
    finally:
        server.close()


def test_paths_are_checked_and_a_stale_socket_is_replaced(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="must be in an existing directory"):
        ControlServer(tmp_path / "missing" / "c.sock", _echo)
    with pytest.raises(ValueError, match="under 108 bytes"):
        ControlServer(tmp_path / ("x" * 120), _echo)
    (tmp_path / "file").write_text("")
    with pytest.raises(FileExistsError, match="must not name an existing file"):
        ControlServer(tmp_path / "file", _echo)
    stale = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    stale.bind(str(tmp_path / "old.sock"))
    stale.close()  # a dead engine's socket file stays behind
    server = ControlServer(tmp_path / "old.sock", _echo)
    assert ask(server.path, "stats")["got"]["command"] == "stats"
    server.close()
    assert not server.path.exists()
    with pytest.raises(FileNotFoundError):
        ask(server.path, "stats")
