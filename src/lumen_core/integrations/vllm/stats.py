"""``LumenStats``: the connector's figures in vLLM's own connector stats (logged with the
engine's metrics): per interval, checkpoint tokens and bytes saved, restores and restored
tokens, restores that stopped early by reason, releases; the durable lag (tokens saved
but not yet durable on a live replica, all requests together) when last sampled; and while a
control ``flush`` waits, how much of its mark is not durable yet."""

from __future__ import annotations

from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats

__all__ = ["LumenStats"]

# Gauges, not counts: a later interval's value replaces an earlier one.
DURABLE_LAG = "durable_lag_tokens"
FLUSH_MARK = "flush_mark"  # the number of the control `flush` whose mark FLUSH_LAG measures
FLUSH_LAG = "flush_lag_tokens"  # tokens of that mark not durable yet
GAUGES = frozenset((DURABLE_LAG, FLUSH_MARK, FLUSH_LAG))


class LumenStats(KVConnectorStats):
    """``data``: counter name -> value of one interval (``GAUGES`` hold their last value)."""

    def reset(self) -> None:
        self.data = {}

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        """Adds ``other``'s counts (another worker's, or a later interval's) to these; a gauge
        of a later interval replaces the earlier one."""
        for name, value in other.data.items():
            if name in GAUGES:
                self.data[name] = value
            else:
                self.data[name] = self.data.get(name, 0) + value
        return self

    def reduce(self) -> dict[str, int | float]:
        return dict(self.data)

    def is_empty(self) -> bool:
        return not any(self.data.values())

    def to_dict(self) -> dict[str, Any]:
        return dict(self.data)
