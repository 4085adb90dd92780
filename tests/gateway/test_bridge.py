"""The front door's CoordinatorBridge: streams waiting on the event loop are woken by the
gateway's notifications, all of them in one read under the lock, and miss no change."""

import asyncio
import threading
from collections.abc import Callable

import pytest

from lumen_core.gateway.http.bridge import CoordinatorBridge
from lumen_core.gateway.server import GatewayServer

pytestmark = pytest.mark.timeout(60)
GIB = 1 << 30


def _admit(gateway: GatewayServer, count: int, max_new_tokens: int) -> list[int]:
    with gateway.condition:
        coordinator = gateway.coordinator
        coordinator.register(gateway.now_s(), 0, budget_bytes=GIB, holder_address="h")
        return [
            coordinator.admit(gateway.now_s(), [1, 2, 3], max_new_tokens, worker_id=0).request_id
            for _ in range(count)
        ]


def _report(gateway: GatewayServer, request_ids: list[int], position: int, *, last: bool) -> None:
    """One step of worker 0: a token for each request under one hold of the lock, then one
    notification (as the ReportTokens handler)."""
    with gateway.condition:
        for request_id in request_ids:
            gateway.coordinator.report_tokens(
                gateway.now_s(), 0, 1, request_id, 1, position, [position + 7], finished=last
            )
        gateway.condition.notify_all()


def _serve(gateway: GatewayServer, body: Callable[[CoordinatorBridge], object]) -> object:
    async def run() -> object:
        bridge = CoordinatorBridge(gateway)
        bridge.start()
        try:
            return await asyncio.wait_for(body(bridge), timeout=30.0)  # type: ignore[arg-type]
        finally:
            bridge.stop()

    return asyncio.run(run())


class _CountingCondition:
    """The gateway's condition, counting how often the event loop's thread takes it."""

    def __init__(self, inner: threading.Condition) -> None:
        self.inner = inner
        self.loop_thread: threading.Thread | None = None
        self.taken_on_loop = 0

    def __enter__(self) -> bool:
        if threading.current_thread() is self.loop_thread:
            self.taken_on_loop += 1
        return self.inner.__enter__()

    def __exit__(self, *exc: object) -> None:
        self.inner.__exit__(*exc)

    def wait(self, timeout: float | None = None) -> bool:
        return self.inner.wait(timeout)

    def notify_all(self) -> None:
        self.inner.notify_all()


def test_one_step_wakes_every_stream_in_one_read_and_they_wait_again_without_one(
    start_gateway: Callable[..., GatewayServer],
) -> None:
    """48 streams wait; one step reports a token for each: they all get it, read with one
    hold of the lock by the event loop (not one each), each stream read once. Waiting for the
    next with that wake-up's ``wake``, none takes the lock to read first (the next wake-up
    reads for all), and the next step's tokens arrive."""
    gateway = start_gateway()
    request_ids = _admit(gateway, 48, 4)
    condition = _CountingCondition(gateway.condition)
    gateway.condition = condition  # type: ignore[assignment]

    async def body(bridge: CoordinatorBridge) -> object:
        streams = [asyncio.ensure_future(bridge.wait_tokens(r, 0)) for r in request_ids]
        await asyncio.sleep(0.1)  # each stream has read and waits
        assert not any(s.done() for s in streams)
        condition.loop_thread = threading.current_thread()
        threading.Thread(target=_report, args=(gateway, request_ids, 0), kwargs={"last": False}).start()
        first = await asyncio.gather(*streams)
        taken_to_wake = condition.taken_on_loop
        again = [asyncio.ensure_future(bridge.wait_tokens(r, 1, u.wake)) for r, u in zip(request_ids, first)]
        await asyncio.sleep(0.1)
        taken_to_wait = condition.taken_on_loop - taken_to_wake
        threading.Thread(target=_report, args=(gateway, request_ids, 1), kwargs={"last": False}).start()
        second = await asyncio.gather(*again)
        condition.loop_thread = None
        return first, second, taken_to_wake, taken_to_wait

    first, second, taken_to_wake, taken_to_wait = _serve(gateway, body)  # type: ignore[misc]
    assert [u.tokens for u in first] == [(7,)] * len(request_ids)
    assert all(not u.finished and u.epoch == 1 and u.wake > 0 for u in first)
    # One wake-up for the step (another only if some other notification came in between).
    assert 1 <= taken_to_wake <= 2, taken_to_wake
    if len({u.wake for u in first}) == 1:  # no other wake-up ran since: no stream reads
        assert taken_to_wait == 0, taken_to_wait
    assert [u.tokens for u in second] == [(8,)] * len(request_ids)


@pytest.mark.parametrize("pass_wake", [False, True])
def test_streams_follow_many_steps_and_miss_no_change(
    start_gateway: Callable[..., GatewayServer], pass_wake: bool
) -> None:
    """Steps reported from another thread while the streams read and register: every token of
    every stream arrives, in order, and each stream ends with its request. With ``pass_wake``
    a stream woken by a wake-up waits again without a read of its own while no other has run."""
    gateway = start_gateway()
    steps = 40
    request_ids = _admit(gateway, 16, steps)

    def worker() -> None:
        for position in range(steps):
            _report(gateway, request_ids, position, last=position == steps - 1)

    async def follow(bridge: CoordinatorBridge, request_id: int) -> list[int]:
        got: list[int] = []
        wake = 0
        while True:
            update = await bridge.wait_tokens(request_id, len(got), wake if pass_wake else 0)
            got.extend(update.tokens)
            wake = update.wake
            if update.finished:
                return got

    async def body(bridge: CoordinatorBridge) -> object:
        threading.Thread(target=worker).start()
        return await asyncio.gather(*(follow(bridge, r) for r in request_ids))

    outputs = _serve(gateway, body)
    assert outputs == [[p + 7 for p in range(steps)]] * len(request_ids)


def test_an_unknown_request_raises_and_stop_ends_the_waits(
    start_gateway: Callable[..., GatewayServer],
) -> None:
    gateway = start_gateway()
    (request_id,) = _admit(gateway, 1, 4)

    async def body(bridge: CoordinatorBridge) -> object:
        with pytest.raises(IndexError, match="not a known request"):
            await bridge.wait_tokens(request_id + 100, 0)
        waiting = asyncio.ensure_future(bridge.wait_tokens(request_id, 0))
        await asyncio.sleep(0.05)
        assert not waiting.done()
        threading.Thread(target=bridge.stop).start()
        return await waiting

    update = _serve(gateway, body)
    assert update.tokens == () and not update.finished and not update.lost  # type: ignore[attr-defined]
