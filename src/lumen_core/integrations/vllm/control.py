"""The connector's local control channel: how the node's ``lumen agent`` talks to the
LumenConnector inside vLLM's engine-core process (vLLM has no connector RPC).

A Unix stream socket at the path ``control_socket`` of ``kv_connector_extra_config`` names:
created owner-only (mode 0600, in a directory the agent chose), and every connection's peer is
checked with ``SO_PEERCRED`` (same uid as the engine, else closed unanswered). One request per
connection: a JSON object on one line (at most ``MAX_MESSAGE_BYTES``), answered by one JSON
line. Commands (docs/vllm.md): ``stats``, ``release``, ``renew``, ``flush``, ``abandon`` and
``credential``. The server runs on threads of its own; its handler only reads or queues state
for the scheduler's next step, so the engine's step never waits on it. No vLLM import: the
agent uses ``ask`` as it is.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import struct
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

__all__ = ["MAX_MESSAGE_BYTES", "ControlError", "ControlServer", "ask"]

logger = logging.getLogger(__name__)

MAX_MESSAGE_BYTES = 64 * 1024  # a request or a reply: a stats reply is a few hundred bytes
_IO_TIMEOUT_S = 5.0  # a peer that sends nothing for this long is dropped
_MAX_CONNECTIONS = 4  # connections served at once (more wait in the listen backlog)
_ACCEPT_POLL_S = 0.25  # the accept loop re-checks for its own stop this often

Handler = Callable[[dict[str, Any]], dict[str, Any]]


class ControlError(RuntimeError):
    """The connector refused a command (its reply was ``{"error": ...}``) or did not answer."""


def _read_line(conn: socket.socket) -> bytes:
    """One line (without its newline) of at most MAX_MESSAGE_BYTES; ValueError past it or at EOF."""
    data = bytearray()
    while b"\n" not in data:
        chunk = conn.recv(4096)
        if not chunk:
            raise ValueError("the peer closed the connection before a full line")
        data += chunk
        if len(data) > MAX_MESSAGE_BYTES + 1:
            raise ValueError(f"a message must be at most {MAX_MESSAGE_BYTES} bytes, got more")
    line, _, _ = bytes(data).partition(b"\n")
    if len(line) > MAX_MESSAGE_BYTES:
        raise ValueError(f"a message must be at most {MAX_MESSAGE_BYTES} bytes, got {len(line)}")
    return line


def _peer_uid(conn: socket.socket) -> int:
    creds = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    _pid, uid, _gid = struct.unpack("3i", creds)
    return uid


class ControlServer:
    """Serves ``handle(request) -> reply`` on the Unix socket ``path`` until ``close``.

    ``handle`` runs on a connection thread; it raises ValueError (or TypeError) for a bad
    request, answered as ``{"error": message}``. Raises ValueError if ``path`` is too long
    for a Unix socket or its directory is missing; an existing socket file at ``path`` (a
    previous engine's) is replaced, any other file is refused (FileExistsError).
    """

    def __init__(self, path: str | os.PathLike[str], handle: Handler) -> None:
        self.path = Path(path)
        if len(os.fsencode(self.path)) >= 108:
            raise ValueError(f"`control_socket` must be a path under 108 bytes, got {str(self.path)!r}")
        if not self.path.parent.is_dir():
            raise ValueError(f"`control_socket` must be in an existing directory, got {str(self.path)!r}")
        if self.path.is_socket():
            self.path.unlink()
        elif self.path.exists():
            raise FileExistsError(f"`control_socket` must not name an existing file, got {str(self.path)!r}")
        self._handle = handle
        self._uid = os.getuid()
        self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        old_umask = os.umask(0o177)  # created 0600: no window in which others may connect
        try:
            self._listener.bind(str(self.path))
        finally:
            os.umask(old_umask)
        os.chmod(self.path, 0o600)
        self._listener.listen(16)
        self._listener.settimeout(_ACCEPT_POLL_S)
        self._slots = threading.BoundedSemaphore(_MAX_CONNECTIONS)
        self._closed = threading.Event()
        self.num_refused_peers = 0
        self._thread = threading.Thread(target=self._accept_loop, name="lumen-control", daemon=True)
        self._thread.start()

    def _accept_loop(self) -> None:
        while not self._closed.is_set():
            try:
                conn, _ = self._listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return  # closed
            self._slots.acquire()
            threading.Thread(target=self._serve, args=(conn,), name="lumen-control-conn", daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        try:
            with conn:
                if _peer_uid(conn) != self._uid:
                    self.num_refused_peers += 1
                    logger.warning("lumen: control connection from another uid refused")
                    return
                conn.settimeout(_IO_TIMEOUT_S)
                try:
                    request = json.loads(_read_line(conn))
                    if not isinstance(request, dict):
                        raise TypeError(f"a request must be a JSON object, got {type(request).__name__}")
                    reply = self._handle(request)
                except (ValueError, TypeError) as exc:  # json.JSONDecodeError is a ValueError
                    reply = {"error": str(exc)}
                data = json.dumps(reply, separators=(",", ":")).encode()
                if len(data) > MAX_MESSAGE_BYTES:
                    data = json.dumps({"error": f"the reply is over {MAX_MESSAGE_BYTES} bytes"}).encode()
                conn.sendall(data + b"\n")
        except OSError as exc:  # the peer went away or timed out: nothing to answer
            logger.debug("lumen: control connection dropped: %s", exc)
        finally:
            self._slots.release()

    def close(self) -> None:
        """Stop accepting, remove the socket file, join the accept thread."""
        self._closed.set()
        self._listener.close()
        self._thread.join(timeout=2 * _ACCEPT_POLL_S + 1.0)
        if self.path.is_socket():
            self.path.unlink()


def ask(path: str | os.PathLike[str], command: str, *, timeout_s: float = _IO_TIMEOUT_S, **args: Any) -> Any:
    """Send ``{"command": command, **args}`` to the connector at ``path``; its reply.

    Raises ControlError when the connector answers an error or closes the connection
    unanswered (it refuses this uid), OSError when nobody listens (FileNotFoundError,
    ConnectionRefusedError) or the reply takes over ``timeout_s`` (TimeoutError),
    ValueError for a request over MAX_MESSAGE_BYTES.
    """
    data = json.dumps({"command": command, **args}, separators=(",", ":")).encode()
    if len(data) > MAX_MESSAGE_BYTES:
        raise ValueError(f"a request must be at most {MAX_MESSAGE_BYTES} bytes, got {len(data)}")
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
        conn.settimeout(timeout_s)
        conn.connect(os.fspath(path))
        try:
            conn.sendall(data + b"\n")
            reply = json.loads(_read_line(conn))
        # Closed unanswered (a refused peer): before our send, during it, or after it.
        except (ValueError, BrokenPipeError, ConnectionResetError) as exc:
            raise ControlError(f"the connector at {os.fspath(path)} did not answer: {exc}") from None
    if isinstance(reply, dict) and "error" in reply:
        raise ControlError(reply["error"])
    return reply
