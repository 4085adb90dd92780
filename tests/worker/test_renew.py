"""Capability renewal live (issue 19): a gateway with a short capability lifetime and real
``lumen worker`` processes on loopback; a request decoding for several lifetimes keeps being
checkpointed because the gateway renews its capabilities and the worker re-opens with them.
And a real worker (in this process) ignores a RENEW for a request it does not serve."""

import threading
import time
from pathlib import Path

import pytest

from lumen_core import _native
from lumen_core.gateway.client import GatewayClient
from lumen_core.gateway.config import GatewayConfig
from lumen_core.gateway.directives import HolderGrant, Renew
from lumen_core.gateway.server import GatewayServer
from lumen_core.worker.cluster import LocalCluster, RequestResult, write_models
from lumen_core.worker.process import Worker, WorkerConfig

pytestmark = [
    pytest.mark.ucx,
    pytest.mark.skipif(not _native.HAS_UCX, reason="lumen_core._C_ucx is not built (LUMEN_UCX=ON)"),
    pytest.mark.timeout(240),
]

TTL_S = 4.0  # renewed at 2 s; the reaper runs every lease_s / 10 = 1 s
PROMPT = list(range(1, 17))
MAX_NEW_TOKENS = 340  # ~36 ms a paced step: about three lifetimes of decoding


@pytest.mark.slow
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


def test_a_renew_for_a_request_not_served_here_is_ignored(tmp_path: Path, secret: bytes) -> None:
    model_path, _ = write_models(tmp_path, seed=0)
    gateway = GatewayServer(GatewayConfig(policy="FC", heartbeat_s=0.1), secret, port=0).start()
    holder = GatewayClient(gateway.address, secret)
    submitter = GatewayClient(gateway.address, secret)
    worker = Worker(WorkerConfig(0, gateway.address, str(model_path), budget_bytes=1 << 30), secret)
    thread = threading.Thread(target=worker.run, daemon=True)
    try:
        worker.start()  # worker 0 serves, worker 1 holds
        thread.start()
        holder.register(1, budget_bytes=1 << 30, holder_address="127.0.0.1:7001")
        chunks = list(submitter.submit(list(range(10, 30)), 4, timeout_s=30.0))
        request_id = chunks[0].request_id
        assert chunks[-1].finished
        grant = HolderGrant(1, "127.0.0.1:7001", (b"\x01" * 128,))
        for renew in (
            Renew(request_id, 1, (grant,), "after it finished"),
            Renew(request_id + 100, 1, (grant,), "never served here"),
        ):
            worker.directives.put(renew)
        deadline = time.monotonic() + 10.0
        while worker.stats()["renews_ignored"] < 2 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert (worker.stats()["renews_ignored"], worker.stats()["renewed"]) == (2, 0)
        assert not worker.fenced.is_set() and thread.is_alive()
    finally:
        worker.stop()
        thread.join(10)
        worker.close()
        for client in (holder, submitter):
            client.close()
        gateway.stop(grace_s=0.1)
