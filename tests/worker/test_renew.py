"""Capability renewal live (issue 19): a gateway with a short capability lifetime and real
``lumen worker`` processes on loopback; a request decoding for several lifetimes keeps being
checkpointed because the gateway renews its capabilities and the worker re-opens with them."""

import threading
import time
from pathlib import Path

import pytest

from lumen_core import _native
from lumen_core.worker.cluster import LocalCluster, RequestResult

pytestmark = [
    pytest.mark.ucx,
    pytest.mark.slow,
    pytest.mark.skipif(not _native.HAS_UCX, reason="lumen_core._C_ucx is not built (LUMEN_UCX=ON)"),
    pytest.mark.timeout(240),
]

TTL_S = 4.0  # renewed at 2 s; the reaper runs every lease_s / 10 = 1 s
PROMPT = list(range(1, 17))
MAX_NEW_TOKENS = 340  # ~36 ms a paced step: about three lifetimes of decoding


def test_a_request_served_for_several_capability_lifetimes_stays_checkpointed(tmp_path: Path) -> None:
    # Two workers: one serves, the other is the one holder. Without renewal the holder refuses
    # the appends past the first expiry, the replica is lost, no other holder is left, and the
    # checkpoint stays frozen at what was durable by then.
    with LocalCluster(
        tmp_path, policy="FC", num_workers=2, pace="qwen3-32b/h100x2", time_scale=2.0, capability_ttl_s=TTL_S
    ) as cluster:
        cluster.start()
        result = RequestResult(0, 0.0)
        runner = threading.Thread(target=cluster.run_request, args=(result, PROMPT, MAX_NEW_TOKENS, 120.0))
        started_s = time.monotonic()
        runner.start()
        coordinator = cluster.gateway.coordinator
        durable: list[tuple[float, int]] = []  # (seconds since submit, durable tokens on the holder)
        refused: set[int] = set()
        while runner.is_alive():
            with cluster.gateway.condition:
                if result.request_id >= 0 and coordinator.has_request(result.request_id):
                    _, finished, _ = coordinator.tokens(result.request_id)
                    if not finished:
                        view = coordinator.monitor.request(result.request_id)
                        durable.append(
                            (
                                time.monotonic() - started_s,
                                max((d for _, d in view.durable_tokens), default=0),
                            )
                        )
                        refused |= coordinator.monitor.refused_by(result.request_id)
            time.sleep(0.05)
        runner.join()
        assert result.error == "" and result.finished and len(result.token_ids) == MAX_NEW_TOKENS
        elapsed_s = durable[-1][0]
        assert elapsed_s > 2.5 * TTL_S, f"decoded for {elapsed_s:.1f} s only: too fast to cross the expiries"
        total = len(PROMPT) + MAX_NEW_TOKENS
        at_first_expiry = max((d for t, d in durable if t <= TTL_S), default=0)
        assert durable[-1][1] >= 0.85 * total, (durable[-1], at_first_expiry, total)
        assert durable[-1][1] > at_first_expiry + 0.4 * total
        assert not refused  # no replica was refused or lost on the way
    stats = cluster.worker_stats()
    assert sum(int(s["renewed"]) for s in stats) >= 2, stats
