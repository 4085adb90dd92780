"""``FrontDoor``: the app served by uvicorn on a thread of the gateway's process.

One process, one source of truth: the HTTP side calls the same Coordinator, under the same
lock, as the gRPC handlers. uvicorn runs its own event loop on the ``lumen-gateway-http``
thread (it installs no signal handlers off the main thread); ``stop`` ends it and joins it.
"""

from __future__ import annotations

import socket
import threading
import time

import uvicorn

from lumen_core.gateway.http.app import build_app
from lumen_core.gateway.http.bridge import CoordinatorBridge
from lumen_core.gateway.http.config import FrontDoorConfig
from lumen_core.gateway.http.resume import KEY_LABEL, ResumeTokens
from lumen_core.gateway.http.text import Tokenizer
from lumen_core.gateway.http.tls import TLSFiles
from lumen_core.gateway.server import GatewayServer

_START_TIMEOUT_S = 30.0


class FrontDoor:
    """Serves ``/v1/*``, ``/health`` and ``/metrics`` for ``gateway`` on ``host:port`` (port 0:
    a free one, then in ``port``), over TLS with ``tls`` (``https``). Use as a context manager
    or call ``start`` and ``stop``. Raises RuntimeError when the server does not come up."""

    def __init__(
        self,
        gateway: GatewayServer,
        config: FrontDoorConfig,
        api_keys: frozenset[str],
        *,
        tokenizer: Tokenizer | None = None,
        host: str = "127.0.0.1",
        port: int = 0,
        tls: TLSFiles | None = None,
    ) -> None:
        if not isinstance(gateway, GatewayServer):
            raise TypeError(f"gateway must be a GatewayServer, got {type(gateway).__name__}")
        if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port <= 65535:
            raise ValueError(f"port must be an int in [0, 65535], got {port!r}")
        if tls is not None and not isinstance(tls, TLSFiles):
            raise TypeError(f"tls must be a TLSFiles, got {type(tls).__name__}")
        self.gateway = gateway
        self.config = config
        self._bridge = CoordinatorBridge(gateway)
        resume_tokens = ResumeTokens(gateway.derive_key(KEY_LABEL))
        self.app = build_app(
            config, self._bridge, api_keys, gateway.registry, resume_tokens, tokenizer=tokenizer
        )
        self._host = host
        self._port = port
        self._tls = tls
        self._server: uvicorn.Server | None = None
        self._thread: threading.Thread | None = None
        self._listener: socket.socket | None = None
        self.port = 0

    @property
    def url(self) -> str:
        """The base URL an OpenAI client takes (``.../v1``)."""
        host = f"[{self._host}]" if ":" in self._host else self._host
        return f"{'http' if self._tls is None else 'https'}://{host}:{self.port}/v1"

    def start(self) -> FrontDoor:
        listener = socket.socket(socket.AF_INET6 if ":" in self._host else socket.AF_INET)
        try:
            listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            listener.bind((self._host, self._port))
        except OSError:
            listener.close()
            raise
        self._listener = listener
        self.port = listener.getsockname()[1]
        tls = self._tls
        config = uvicorn.Config(
            self.app,
            log_level="warning",
            access_log=False,
            lifespan="on",
            timeout_graceful_shutdown=2,
            ssl_certfile=None if tls is None else tls.cert_file,
            ssl_keyfile=None if tls is None else tls.key_file,
        )
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(
            target=self._server.run, kwargs={"sockets": [listener]}, name="lumen-gateway-http", daemon=True
        )
        self._thread.start()
        deadline = time.monotonic() + _START_TIMEOUT_S
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"the front door did not start on {self._host}:{self.port}")
            time.sleep(0.01)
        return self

    def stop(self) -> None:
        """End the open streams (each with an error event: the gateway is stopping; their
        requests are not cancelled, since a client did not give up), then the server; join its
        thread."""
        if self._server is not None and self._server.started:
            self._bridge.stop()
        if self._server is not None:
            self._server.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout=10.0)
            self._thread = None
        self._server = None
        if self._listener is not None:
            self._listener.close()
            self._listener = None

    def __enter__(self) -> FrontDoor:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
