"""``lumen worker`` with its self-fencing turned off (by path, never imported): it ignores a
lost lease, a fenced heartbeat and a refused token report, and goes on serving. With the
gateway's ``--unfenced`` it is how the partition tests show that their stale-write invariant
can fail. Arguments: those of ``lumen worker``."""

from __future__ import annotations

import sys

from lumen_core.cli import main
from lumen_core.gateway.client import GatewayClient
from lumen_core.worker.process import Worker


def _ignore_fencing(self: Worker, reason: str) -> None:
    self.fence_reason = f"ignored: {reason}"


Worker._on_fenced = _ignore_fencing  # type: ignore[method-assign]
GatewayClient.lease_valid = lambda self: True  # type: ignore[method-assign]

if __name__ == "__main__":
    sys.exit(main(["worker", *sys.argv[1:]]))
