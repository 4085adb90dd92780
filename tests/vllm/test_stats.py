"""``LumenStats``: how vLLM's connector stats sum the workers' and the intervals' figures."""

from __future__ import annotations

from lumen_core.integrations.vllm import LumenConnector
from lumen_core.integrations.vllm.stats import DURABLE_LAG, LumenStats


def test_counts_add_and_the_lag_is_the_latest() -> None:
    first = LumenStats(data={"saved_tokens": 10, "restores": 1, DURABLE_LAG: 7})
    second = LumenStats(data={"saved_tokens": 5, DURABLE_LAG: 2})
    total = first.aggregate(second)
    assert total.reduce() == {"saved_tokens": 15, "restores": 1, DURABLE_LAG: 2}
    assert not total.is_empty()
    total.reset()
    assert total.is_empty() and total.reduce() == {}


def test_zero_counts_are_empty_and_vllm_rebuilds_the_class() -> None:
    assert LumenStats(data={"saved_tokens": 0}).is_empty()
    rebuilt = LumenConnector.build_kv_connector_stats({"restores": 2})
    assert isinstance(rebuilt, LumenStats) and rebuilt.to_dict() == {"restores": 2}
