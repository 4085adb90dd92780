"""Hand-made clusters for the policy tests."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import pytest

from lumen_core.policy import LoadConfig, LoadMonitor, WorkerJoined

# Small units so hand-computed loads stay readable: a mean request is 100 tokens and a token
# of KV is 1 byte.
SMALL = LoadConfig(alpha=1.0, beta=1.0, mean_request_tokens=100.0, kv_bytes_per_token=1)

ClusterFactory = Callable[..., LoadMonitor]


@pytest.fixture
def make_cluster() -> ClusterFactory:
    def build(
        num_workers: int,
        *,
        budget_bytes: int = 10**9,
        domains: Sequence[str] | None = None,
        config: LoadConfig = SMALL,
    ) -> LoadMonitor:
        monitor = LoadMonitor(config)
        for worker_id in range(num_workers):
            domain = "" if domains is None else domains[worker_id]
            monitor.apply(WorkerJoined(0.0, worker_id, budget_bytes, domain))
        return monitor

    return build
