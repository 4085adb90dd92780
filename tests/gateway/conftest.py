"""Real gateways on loopback (ephemeral ports) and real clients; everything is stopped/closed."""

import threading
from collections.abc import Callable, Iterator

import pytest

from lumen_core.auth import Rights, verify_capability
from lumen_core.gateway.client import GatewayClient
from lumen_core.gateway.config import GatewayConfig
from lumen_core.gateway.server import GatewayServer

SECRET = b"gateway-tests-secret-0123456789abcdef"
GIB = 1 << 30


@pytest.fixture
def start_gateway() -> Iterator[Callable[..., GatewayServer]]:
    servers: list[GatewayServer] = []

    def start(config: GatewayConfig | None = None, **kwargs: object) -> GatewayServer:
        server = GatewayServer(config or GatewayConfig(), SECRET, **kwargs).start()  # type: ignore[arg-type]
        servers.append(server)
        return server

    yield start
    for server in servers:
        server.stop(grace_s=0.1)
    left = [t.name for t in threading.enumerate() if t.name.startswith(("lumen-gateway", "lumen-heartbeat"))]
    assert not left, f"gateway threads left running: {left}"


@pytest.fixture
def connect() -> Iterator[Callable[..., GatewayClient]]:
    clients: list[GatewayClient] = []

    def make(server: GatewayServer, secret: bytes = SECRET, **kwargs: object) -> GatewayClient:
        client = GatewayClient(server.address, secret, **kwargs)  # type: ignore[arg-type]
        clients.append(client)
        return client

    yield make
    for client in clients:
        client.close()


Grant = tuple[int, int, int, int, Rights]  # (request_id, shard, epoch, holder_id, rights)


@pytest.fixture
def granted() -> Callable[[bytes, tuple[bytes, ...]], list[Grant]]:
    """What each capability grants, its signature checked under the issuer's public key."""

    def grants(public_key: bytes, capabilities: tuple[bytes, ...]) -> list[Grant]:
        fields = [verify_capability(public_key, capability) for capability in capabilities]
        return [(f.request_id, f.shard, f.epoch, f.holder_id, f.rights) for f in fields]

    return grants
