"""CheckpointStreamer against `lumen holder` processes on loopback: durable streaming with
replicas, fences, release, catch-up after a full staging buffer, a slow holder, a killed
holder and its re-placement, and argument checks."""

from __future__ import annotations

import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from lumen_core.auth import CapabilityIssuer, read_issuer_key_file
from lumen_core.layouts import KVLayout
from lumen_core.ops import gather_tokens, scatter_tokens
from lumen_core.stream import (
    CheckpointStreamer,
    HolderStore,
    RestoreStatus,
    remote_restore,
    restorable_tokens,
)
from lumen_core.testing import make_paged_cache
from lumen_core.transport import Client, WireLimits

pytestmark = [pytest.mark.ucx, pytest.mark.timeout(60)]

MODEL = "stream-model"
TLS = "tcp"
SLOTS_PER_REQUEST = 128


def cache(seed: int = 0) -> KVLayout:
    return make_paged_cache(
        "vllm_flash",
        num_layers=2,
        num_blocks=96,
        block_size=16,
        num_kv_heads=2,
        head_dim=16,
        dtype=torch.bfloat16,
        seed=seed,
    )


class Loop:
    """A decode loop stand-in: request i's position p lives in slot i * 128 + p and holds
    fresh random KV written just before the step that saves it."""

    def __init__(self, streamer: CheckpointStreamer, rids: list[int]) -> None:
        self.streamer = streamer
        self.layout = streamer.layout
        self.rids = rids
        self.length = {r: 0 for r in rids}
        self.gen = torch.Generator().manual_seed(1)

    def slots(self, rid: int, start: int, end: int) -> torch.Tensor:
        base = self.rids.index(rid) * SLOTS_PER_REQUEST
        return torch.arange(base + start, base + end, dtype=torch.int64)

    def tokens(self, rid: int, n: int) -> np.ndarray:
        return (np.arange(n, dtype=np.uint32) * 31 + rid) % 5000

    def step(self, new: int = 1, rids: list[int] | None = None) -> int:
        ids, positions, slots, tokens = [], [], [], []
        for rid in rids or self.rids:
            start, end = self.length[rid], self.length[rid] + new
            s = self.slots(rid, start, end)
            scatter_tokens(
                self.layout,
                s,
                torch.randint(0, 256, (new, self.layout.record_bytes), dtype=torch.uint8, generator=self.gen),
            )
            ids += [rid] * new
            positions += list(range(start, end))
            slots.append(s)
            tokens.append(self.tokens(rid, end)[start:])
            self.length[rid] = end
        return self.streamer.save_step(ids, positions, torch.cat(slots), np.concatenate(tokens))

    def check_holder(self, port: int, secret: bytes, issuer: CapabilityIssuer, rid: int) -> None:
        """The holder at port restores rid's whole saved prefix bit-exact."""
        n = self.length[rid]
        target = cache(seed=3)
        slots = torch.arange(n, dtype=torch.int64)
        with Client("127.0.0.1", port, secret, tls=TLS) as client:
            result = remote_restore(
                client,
                rid,
                target,
                slots,
                token_ids=self.tokens(rid, n),
                model_fingerprint=MODEL,
                capability=issuer.issue(rid, 0, 0, holder_id=0),
            )
        assert (result.status, result.restored_tokens) == (RestoreStatus.COMPLETE, n)
        assert torch.equal(gather_tokens(target, slots), gather_tokens(self.layout, self.slots(rid, 0, n)))


@pytest.fixture
def make_streamer(secret: bytes) -> Iterator[Any]:
    made: list[CheckpointStreamer] = []

    def _make(**kwargs: Any) -> CheckpointStreamer:
        kwargs.setdefault("ack_timeout_s", 1.0)
        kwargs.setdefault("connect_timeout_s", 1.0)
        s = CheckpointStreamer(cache(), secret, model_fingerprint=MODEL, tls=TLS, **kwargs)
        made.append(s)
        return s

    yield _make
    for s in made:
        s.close()


def add(streamer: CheckpointStreamer, issuer: CapabilityIssuer, rid: int, *ports: int) -> None:
    """Streams rid to the holders on ports (each holder id 0), with the issuer's capabilities."""
    caps = [issuer.issue(rid, 0, 0, holder_id=0) for _ in ports]
    streamer.add_request(rid, [("127.0.0.1", p) for p in ports], caps)


def test_replicated_stream_is_durable_on_every_holder_and_released(
    issuer: CapabilityIssuer, holders: Any, make_streamer: Any, secret: bytes
) -> None:
    a, b = holders(2)
    # No step dropped (every one is counted); a generous ack timeout for a loaded machine.
    streamer = make_streamer(max_queued_steps=64, ack_timeout_s=5.0)
    rids = [11, 12, 13, 14]
    for rid in rids:
        add(streamer, issuer, rid, a.port, b.port)
    loop = Loop(streamer, rids)
    fence = loop.step(new=20)
    streamer.wait_fence(fence)
    for _ in range(30):
        loop.step()
    for rid in rids:
        streamer.wait_for_save(rid)
    assert streamer.flush(timeout_s=10)
    stats = streamer.stats()
    assert stats.coverage == 1.0 and stats.stale == ()
    assert stats.saved == stats.durable == {r: 50 for r in rids}
    assert all(r.live and r.durable_tokens == 50 for reps in stats.replicas.values() for r in reps)
    c = stats.counters
    assert c["bytes_acked"] == c["bytes_sent"] == 2 * 4 * 50 * (loop.layout.record_bytes + 8)
    assert c["steps_enqueued"] == 31 and c["steps_dropped"] == c["appends_failed"] == 0
    for port in (a.port, b.port):
        for rid in rids:
            loop.check_holder(port, secret, issuer, rid)
    for rid in rids:
        streamer.release(rid)
    assert streamer.flush(timeout_s=10)
    for h in (a, b):
        store = h.ask("stats")["store"]
        assert store["checkpoints"] == 0 and store["releases"] == 4


def test_releases_queued_at_close_still_reach_the_holder(
    issuer: CapabilityIssuer, holders: Any, make_streamer: Any
) -> None:
    """Closing drops the steps not sent, not the releases queued: a finished request's
    checkpoint is freed, not left on its holder until it expires."""
    (a,) = holders(1)
    streamer = make_streamer(max_queued_steps=64, ack_timeout_s=5.0)
    rids = list(range(20, 32))  # as many as the cache has room for
    for rid in rids:
        add(streamer, issuer, rid, a.port)
    loop = Loop(streamer, rids)
    loop.step(new=4)
    assert streamer.flush(timeout_s=10)
    assert a.ask("stats")["store"]["checkpoints"] == len(rids)
    for rid in rids:
        streamer.release(rid)
    streamer.close()  # at once: the releases are still queued
    store = a.ask("stats")["store"]
    assert store["checkpoints"] == 0 and store["releases"] == len(rids)


def test_full_staging_buffer_defers_then_catches_up(
    issuer: CapabilityIssuer, holder: Any, make_streamer: Any, secret: bytes
) -> None:
    h = holder()
    streamer = make_streamer(staging_buffers=1, staging_bytes=16 * cache().record_bytes)
    rids = [1, 2, 3, 4, 5, 6, 7, 8]
    for rid in rids:
        add(streamer, issuer, rid, h.port)
    loop = Loop(streamer, rids)
    loop.step(new=4)  # 32 tokens, room for 16: four requests wait
    assert streamer.flush(timeout_s=10)
    stats = streamer.stats()
    assert stats.counters["tokens_deferred"] == 16 and len(stats.stale) == 4
    assert stats.coverage == 0.5
    for _ in range(6):
        loop.step()
        assert streamer.flush(timeout_s=10)
    stats = streamer.stats()
    assert stats.coverage == 1.0 and stats.stale == ()
    for rid in rids:
        loop.check_holder(h.port, secret, issuer, rid)


def catch_up(
    loop: Loop, streamer: CheckpointStreamer, timeout_s: float = 5.0, *, every_replica: bool = False
) -> Any:
    """Steps (one token each) until every request is durable on a live replica (with
    ``every_replica``: until every replica is live); the stats."""
    deadline = time.monotonic() + timeout_s
    while True:
        loop.step()
        assert streamer.flush(timeout_s=10)
        stats = streamer.stats()
        live = all(rep.live for reps in stats.replicas.values() for rep in reps)
        if (stats.coverage == 1.0 and (live or not every_replica)) or time.monotonic() > deadline:
            return stats
        time.sleep(0.05)


def test_stalled_holder_drops_without_blocking_the_engine_then_catches_up(
    issuer: CapabilityIssuer, holder: Any, make_streamer: Any, secret: bytes
) -> None:
    """A `lumen holder` SIGSTOPped for longer than the ack timeout: the engine never waits,
    and once it runs again the streamer reconnects and every request resumes from what the
    holder has durable, bit-exact."""
    h = holder()
    streamer = make_streamer(max_queued_steps=2, ack_timeout_s=0.5, reconnect_backoff_s=0.05)
    rids = [21, 22]
    for rid in rids:
        add(streamer, issuer, rid, h.port)
    loop = Loop(streamer, rids)
    loop.step(new=8)
    assert streamer.flush(timeout_s=10)
    h.proc.send_signal(signal.SIGSTOP)
    try:
        worst = 0.0
        stalled_until = time.monotonic() + 1.5  # three ack timeouts
        while time.monotonic() < stalled_until:
            t0 = time.perf_counter()
            loop.step()
            worst = max(worst, time.perf_counter() - t0)
            time.sleep(0.025)  # about 60 steps: each request stays inside its 128 slots
        assert worst < 0.2, f"save_step blocked for {worst:.3f} s"
        stats = streamer.stats()
        assert stats.counters["holder_failures"] >= 1 and stats.counters["tokens_dropped"] > 0
        assert set(stats.stale) == set(rids) and stats.coverage < 1.0
    finally:
        h.proc.send_signal(signal.SIGCONT)
    stats = catch_up(loop, streamer)
    assert stats.coverage == 1.0 and stats.stale == ()
    assert stats.counters["reconnects"] >= 1 and stats.counters["holders_gone"] == 0
    assert stats.gone_holders == () and stats.lost == ()
    assert all(rep.live for reps in stats.replicas.values() for rep in reps)
    for rid in rids:
        loop.check_holder(h.port, secret, issuer, rid)


def test_a_step_opening_many_requests_on_a_stalled_holder_waits_one_ack_timeout(
    issuer: CapabilityIssuer, holders: Any, make_streamer: Any, secret: bytes
) -> None:
    """A step that begins many requests (a prefill batch) on a holder that stalls costs the
    streamer one ack timeout, not one per request; the other holder's replicas open in that
    step, and the stalled one's once it runs again."""
    a, b = holders(2)
    streamer = make_streamer(ack_timeout_s=0.5, reconnect_backoff_s=0.05)
    rids = list(range(90, 102))  # the cache's 12 x SLOTS_PER_REQUEST slots
    add(streamer, issuer, rids[0], a.port, b.port)
    loop = Loop(streamer, rids)
    loop.step(rids=rids[:1])  # both holders connected
    assert streamer.flush(timeout_s=10)
    for rid in rids[1:]:
        add(streamer, issuer, rid, a.port, b.port)
    a.proc.send_signal(signal.SIGSTOP)
    try:
        started = time.monotonic()
        streamer.wait_fence(loop.step(rids=rids[1:]), timeout_s=30)
        elapsed = time.monotonic() - started
    finally:
        a.proc.send_signal(signal.SIGCONT)
    assert elapsed < 2.5, f"the step's 11 opens on the stalled holder took {elapsed:.2f} s"
    stats = catch_up(loop, streamer, 10.0, every_replica=True)
    assert stats.coverage == 1.0 and stats.lost == ()
    assert all(rep.live for reps in stats.replicas.values() for rep in reps)
    for rid in rids:
        loop.check_holder(a.port, secret, issuer, rid)
        loop.check_holder(b.port, secret, issuer, rid)


def test_holder_failing_past_give_up_is_gone_for_good_and_its_replicas_lost(
    issuer: CapabilityIssuer, holder: Any, make_streamer: Any, secret: bytes
) -> None:
    h = holder()
    streamer = make_streamer(ack_timeout_s=0.5, reconnect_backoff_s=0.05, give_up_after_s=1.0)
    add(streamer, issuer, 23, h.port)
    loop = Loop(streamer, [23])
    loop.step(new=4)
    assert streamer.flush(timeout_s=10)
    h.kill()
    deadline = time.monotonic() + 20
    while streamer.stats().counters["holders_gone"] == 0 and time.monotonic() < deadline:
        loop.step()
        time.sleep(0.05)
    stats = streamer.stats()
    assert stats.gone_holders == (("127.0.0.1", h.port),)
    assert stats.lost == ((23, ("127.0.0.1", h.port)),)
    assert stats.counters["replicas_lost"] == 1 and stats.counters["reconnects"] == 0
    assert stats.stale == (23,)


def test_killed_holder_is_reported_and_replacement_restores_coverage(
    issuer: CapabilityIssuer, holders: Any, make_streamer: Any, secret: bytes
) -> None:
    a, b, c = holders(3)
    # Steps wait while A's failure is found; a generous ack timeout keeps a loaded B alive.
    streamer = make_streamer(max_queued_steps=64, ack_timeout_s=5.0)
    rids = [31, 32, 33, 34]
    for rid in rids:
        add(streamer, issuer, rid, a.port if rid % 2 else b.port)
    loop = Loop(streamer, rids)
    loop.step(new=16)
    for _ in range(10):
        loop.step()
    assert streamer.flush(timeout_s=10)
    assert streamer.stats().coverage == 1.0
    a.kill()
    worst = 0.0
    for _ in range(20):
        t0 = time.perf_counter()
        loop.step()
        worst = max(worst, time.perf_counter() - t0)
    assert worst < 0.2, f"save_step blocked for {worst:.3f} s"
    assert streamer.flush(timeout_s=10)
    stats = streamer.stats()
    assert stats.counters["holder_failures"] >= 1 and stats.gone_holders == ()  # not given up yet
    assert set(stats.stale) == {31, 33} and stats.coverage < 1.0
    assert stats.durable[32] == stats.durable[34] == 46
    moved = {rid: issuer.issue(rid, 0, 0, holder_id=0) for rid in (31, 33)}
    assert streamer.replace_holder(("127.0.0.1", a.port), ("127.0.0.1", c.port), moved) == 2
    loop.step()
    assert streamer.flush(timeout_s=10)
    stats = streamer.stats()
    assert stats.coverage == 1.0 and stats.stale == ()
    assert stats.counters["replacements"] == 1
    for rid in (31, 33):
        loop.check_holder(c.port, secret, issuer, rid)


def test_streamer_arguments_are_checked(issuer: CapabilityIssuer, make_streamer: Any, secret: bytes) -> None:
    streamer = make_streamer()
    cap = issuer.issue(5, 0, 0, holder_id=0)
    with pytest.raises(TypeError, match="`layout` must be a KVLayout"):
        CheckpointStreamer("cache", secret, model_fingerprint=MODEL)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="`secret` must be bytes"):
        CheckpointStreamer(cache(), "secret" * 4, model_fingerprint=MODEL)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="`model_fingerprint` must be a non-empty str"):
        CheckpointStreamer(cache(), secret, model_fingerprint="")
    with pytest.raises(TypeError, match="tls must be a str"):
        CheckpointStreamer(cache(), secret, model_fingerprint=MODEL, tls=None)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="limits must be a WireLimits"):
        CheckpointStreamer(cache(), secret, model_fingerprint=MODEL, limits={})  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="`ack_timeout_s` must be > 0"):
        CheckpointStreamer(cache(), secret, model_fingerprint=MODEL, ack_timeout_s=0)
    with pytest.raises(ValueError, match="`secret` must be at least 16 bytes, got 5"):
        CheckpointStreamer(cache(), b"short", model_fingerprint=MODEL)
    with pytest.raises(ValueError, match="`staging_bytes` must be in"):
        CheckpointStreamer(cache(), secret, model_fingerprint=MODEL, staging_bytes=1)
    with pytest.raises(ValueError, match="holders must be a non-empty sequence"):
        streamer.add_request(5, [], [])
    with pytest.raises(TypeError, match=r"holders\[i\] must be an \(address, port\) tuple"):
        streamer.add_request(5, ["127.0.0.1:1"], [cap])
    with pytest.raises(ValueError, match=r"`capabilities\[0\]` must be 128 bytes, got 1"):
        streamer.add_request(5, [("127.0.0.1", 1)], [b"x"])
    with pytest.raises(ValueError, match=r"capabilities must be one per holder \(1\), got 2"):
        streamer.add_request(5, [("127.0.0.1", 1)], [cap, cap])
    with pytest.raises(TypeError, match="capabilities must be a sequence of bytes"):
        streamer.add_request(5, [("127.0.0.1", 1)], cap)
    streamer.add_request(5, [("127.0.0.1", 1)], [cap])
    with pytest.raises(ValueError, match="already registered"):
        streamer.add_request(5, [("127.0.0.1", 1)], [cap])
    with pytest.raises(ValueError, match="was not added"):
        streamer.save_step([6], [0], [0], [1])
    with pytest.raises(ValueError, match="would have a gap"):
        streamer.save_step([5], [3], [0], [1])
    with pytest.raises(ValueError, match="must be consecutive"):
        streamer.save_step([5, 5], [0, 2], [0, 1], [1, 1])
    with pytest.raises(ValueError, match="one entry per token"):
        streamer.save_step([5, 5], [0, 1], [0], [1, 1])
    with pytest.raises(IndexError, match="slot_ids must be in"):
        streamer.save_step([5], [0], [10**7], [1])
    with pytest.raises(ValueError, match="`timeout_s` must be > 0"):
        streamer.wait_for_save(5, timeout_s=0)
    with pytest.raises(TypeError, match="old_holder must be an"):
        streamer.replace_holder("127.0.0.1", ("127.0.0.1", 2), {})  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="capabilities must be a mapping"):
        streamer.replace_holder(("127.0.0.1", 1), ("127.0.0.1", 2), [cap])  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="request_ids must have 1 dimension"):
        streamer.save_step([[5]], [0], [0], [1])


def test_tensor_parallel_shards_restore_to_the_shortest(
    issuer: CapabilityIssuer, holder: Any, secret: bytes
) -> None:
    h = holder()
    ranks = [cache(seed=10 + r) for r in range(2)]  # each rank's own heads
    streamers = [
        CheckpointStreamer(layout, secret, model_fingerprint=MODEL, shard=r, tls=TLS)
        for r, layout in enumerate(ranks)
    ]
    try:
        for r, s in enumerate(streamers):
            s.add_request(7, [("127.0.0.1", h.port)], [issuer.issue(7, r, 0, holder_id=0)])
        lengths = (40, 29)  # rank 1 fell behind (its later steps were lost with it)
        for s, n in zip(streamers, lengths, strict=True):
            s.save_step([7] * n, list(range(n)), list(range(n)), list(range(n)))
            assert s.flush(timeout_s=10)
        durable = []
        with Client("127.0.0.1", h.port, secret, tls=TLS) as client:
            for r in range(2):
                cap = issuer.issue(7, r, 0, holder_id=0)
                durable.append(client.read(7, r, 0, 0, 1, ranks[r].record_bytes, cap).durable_tokens)
            assert durable == list(lengths)
            n = restorable_tokens(durable)
            assert n == 29
            for r in range(2):
                target = cache(seed=20 + r)
                slots = torch.arange(64, 104, dtype=torch.int64)
                result = remote_restore(
                    client,
                    7,
                    target,
                    slots,
                    token_ids=list(range(40)),
                    model_fingerprint=MODEL,
                    capability=issuer.issue(7, r, 0, holder_id=0),
                    shard=r,
                    max_tokens=n,
                )
                assert (result.restored_tokens, result.reprefill_tokens) == (29, 11)
                assert torch.equal(
                    gather_tokens(target, slots[:29]), gather_tokens(ranks[r], torch.arange(29))
                )
    finally:
        for s in streamers:
            s.close()


def test_backlog_in_freed_pages_is_never_sent(
    issuer: CapabilityIssuer, holder: Any, make_streamer: Any, secret: bytes
) -> None:
    h = holder()
    streamer = make_streamer(staging_buffers=1, staging_bytes=16 * cache().record_bytes)
    rids = [41, 42, 43, 44, 45, 46, 47, 48]
    for rid in rids:
        add(streamer, issuer, rid, h.port)
    loop = Loop(streamer, rids)
    loop.step(new=4)  # room for 16 tokens: the last four requests wait
    assert streamer.flush(timeout_s=10)
    behind = streamer.stats().stale
    assert len(behind) == 4
    rid = behind[0]
    streamer.wait_for_save(rid)  # the engine frees its pages, which are then reused:
    scatter_tokens(
        loop.layout, loop.slots(rid, 0, 4), torch.zeros(4, loop.layout.record_bytes, dtype=torch.uint8)
    )
    loop.step(rids=[rid])  # a later token of it, in a live page
    assert streamer.flush(timeout_s=10)
    stats = streamer.stats()
    assert stats.counters["replicas_lost"] == 1
    assert stats.durable[rid] == 0 and rid in stats.stale
    store = h.ask("stats")["store"]
    assert store["tokens_held"] == 16  # only the four requests sent before; nothing freed


def test_holder_that_cannot_reserve_the_expected_size_is_a_lost_replica(
    issuer: CapabilityIssuer, holder: Any, make_streamer: Any, secret: bytes
) -> None:
    per_token = cache().record_bytes + 8
    h = holder(50 * per_token, "--eviction", "none")
    streamer = make_streamer()
    for rid, expected in ((61, 40), (62, 20)):  # 40 fit; 20 more do not
        streamer.add_request(
            rid, [("127.0.0.1", h.port)], [issuer.issue(rid, 0, 0, holder_id=0)], expected_tokens=expected
        )
    loop = Loop(streamer, [61, 62])
    loop.step(new=5)
    assert streamer.flush(timeout_s=10)
    stats = streamer.stats()
    store = h.ask("stats")["store"]
    assert stats.counters["replicas_lost"] == 1 and stats.durable == {61: 5, 62: 0}
    assert store["reservations"] == 1 and store["reservations_refused"] == 1
    assert store["bytes_charged"] == 40 * per_token
    with pytest.raises(ValueError, match="`expected_tokens` must be in"):
        streamer.add_request(
            63, [("127.0.0.1", h.port)], [issuer.issue(63, 0, 0, holder_id=0)], expected_tokens=-2
        )


def test_appends_fit_the_limits_the_holder_announces(
    issuer: CapabilityIssuer, make_streamer: Any, secret: bytes
) -> None:
    """The streamer's own limits allow 65,536 tokens an append; these holders take 4 (appends
    are split to fit) and records of at most 128 bytes (the replica is refused for good)."""
    record_bytes = cache().record_bytes  # 256
    narrow = WireLimits(max_tokens_per_message=4, max_record_bytes=record_bytes)
    small = WireLimits(max_record_bytes=record_bytes // 2)
    with (
        HolderStore().serve(secret, tls=TLS, limits=narrow, issuer_public_key=issuer.public_key) as a,
        HolderStore().serve(secret, tls=TLS, limits=small, issuer_public_key=issuer.public_key) as b,
    ):
        streamer = make_streamer(connect_timeout_s=10.0, ack_timeout_s=10.0)  # a loaded machine
        add(streamer, issuer, 71, a.port)
        add(streamer, issuer, 72, b.port)
        loop = Loop(streamer, [71, 72])
        loop.step(new=10)
        assert streamer.flush(timeout_s=10)
        stats = streamer.stats()
        assert stats.durable == {71: 10, 72: 0}
        assert stats.lost == ((72, ("127.0.0.1", b.port)),)
        assert stats.counters["appends_started"] == 3  # 4 + 4 + 2 tokens
        assert a.stats()["malformed"] == b.stats()["malformed"] == 0
        loop.check_holder(a.port, secret, issuer, 71)


@pytest.mark.parametrize("eviction", ["none", "shortest_prefix"])
def test_full_holder_refuses_or_evicts_and_the_streamer_reports_it(
    issuer: CapabilityIssuer, holder: Any, make_streamer: Any, secret: bytes, eviction: str
) -> None:
    per_token = cache().record_bytes + 8
    h = holder(50 * per_token, "--eviction", eviction)
    streamer = make_streamer(max_queued_steps=64)
    add(streamer, issuer, 51, h.port)
    add(streamer, issuer, 52, h.port)
    loop = Loop(streamer, [51, 52])
    loop.step(new=10, rids=[51])
    loop.step(new=30, rids=[52])
    assert streamer.flush(timeout_s=10)
    loop.step(new=15, rids=[52])  # 55 tokens would be charged: over the budget of 50
    loop.step(rids=[51])
    assert streamer.flush(timeout_s=10)
    stats = streamer.stats()
    store = h.ask("stats")["store"]
    assert stats.counters["replicas_lost"] == 1
    if eviction == "none":
        assert store["appends_refused_budget"] == 1 and store["evictions"] == 0
        assert stats.durable == {51: 11, 52: 0} and stats.stale == (52,)
    else:  # the shorter checkpoint (51, 10 tokens) made room for 52
        assert store["evictions"] == 1 and store["evicted_tokens"] == 10
        assert stats.durable == {51: 0, 52: 45} and stats.stale == (51,)


def test_renewed_capabilities_keep_a_long_request_streaming(
    holder: Any, make_streamer: Any, issuer_key_file: Path
) -> None:
    short = CapabilityIssuer(read_issuer_key_file(issuer_key_file), ttl_s=2.0)  # the holder's issuer
    h = holder()
    streamer = make_streamer()
    for rid in (71, 72):
        streamer.add_request(rid, [("127.0.0.1", h.port)], [short.issue(rid, 0, 0, holder_id=0)])
    loop = Loop(streamer, [71, 72])
    loop.step(new=4)
    assert streamer.flush(timeout_s=10)
    streamer.renew(71, [short.issue(71, 0, 0, holder_id=0, now_s=time.time() + 3.0)])
    time.sleep(2.2)  # 72's capability has expired; 71's renewal has not
    loop.step(new=4)
    assert streamer.flush(timeout_s=10)
    stats = streamer.stats()
    assert stats.durable[71] == 8
    # 72's appends past its capability's expiry are refused: its replica is lost at 4 tokens
    assert stats.counters["replicas_lost"] == 1 and 72 in stats.stale
    assert h.ask("stats")["server"]["capability_refused"] >= 1
    with pytest.raises(ValueError, match=r"capabilities must be one per replica \(1\), got 0"):
        streamer.renew(71, [])
    with pytest.raises(ValueError, match="request_id 99 was not added"):
        streamer.renew(99, [short.issue(99, 0, 0, holder_id=0)])
    with pytest.raises(TypeError, match="capabilities must be a sequence of bytes"):
        streamer.renew(71, b"x")  # type: ignore[arg-type]


def test_a_renewal_that_lands_while_its_replica_is_opening_opens_it_again(
    issuer: CapabilityIssuer, holder: Any, make_streamer: Any
) -> None:
    """The open with the old capability is in flight (its holder stopped) when the renewal
    comes: the replica opens again with the new one, rather than appending with a capability
    its connection was not granted (refused: the replica would be lost)."""
    h = holder()
    streamer = make_streamer(ack_timeout_s=3.0)
    add(streamer, issuer, 81, h.port)
    loop = Loop(streamer, [81, 82])
    loop.step(rids=[81])  # connected
    assert streamer.flush(timeout_s=10)
    add(streamer, issuer, 82, h.port)
    h.proc.send_signal(signal.SIGSTOP)
    try:
        loop.step(new=4, rids=[82])  # its open waits for the stopped holder
        time.sleep(0.3)
        streamer.renew(82, [issuer.issue(82, 0, 0, holder_id=0, now_s=time.time() + 60.0)])
    finally:
        h.proc.send_signal(signal.SIGCONT)
    stats = catch_up(loop, streamer)
    assert stats.lost == () and stats.counters["replicas_lost"] == 0
    assert stats.durable[82] == loop.length[82] and h.ask("stats")["server"]["capability_refused"] == 0
