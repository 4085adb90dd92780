"""What a worker's holder tells the gateway it holds (heartbeats, and registrations after a
fencing or a gateway restart): one ``HeldReport`` per request, whichever the worker's engine
(the reference worker's, the vLLM agent's)."""

from __future__ import annotations

from collections.abc import Iterable

from lumen_core.gateway.reports import HeldReport
from lumen_core.stream import CheckpointInfo


def held_reports(checkpoints: Iterable[CheckpointInfo]) -> tuple[HeldReport, ...]:
    """The opened checkpoints of ``checkpoints`` (a ``HolderStore.checkpoints()``), one per
    request (its shard 0): request, epoch and durable tokens. A reservation not opened yet
    holds nothing to restore from."""
    return tuple(
        HeldReport(c.request_id, c.epoch, c.durable_tokens) for c in checkpoints if c.shard == 0 and c.opened
    )
