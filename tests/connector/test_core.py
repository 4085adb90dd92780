"""ConnectorCore against a real holder in this process (a HolderStore served on loopback):
the request lifecycle, verified restore with failed blocks, re-streaming at a new epoch,
preemption keeping the checkpoint, non-blocking restore planning, and bad arguments."""

from __future__ import annotations

import os
import socket
import threading
import time
from collections.abc import Iterator

import numpy as np
import pytest
import torch

from lumen_core.auth import CapabilityIssuer
from lumen_core.connector import ConnectorCore, RestoreSource, StepTokens, StreamGrant
from lumen_core.layouts import KVLayout
from lumen_core.ops import checksum, gather_tokens
from lumen_core.stream import HolderStore, RestoreStatus, fingerprint_bytes, request_key
from lumen_core.testing import assert_kv_equal, make_paged_cache, random_tensor, slots_for_blocks, wait_until
from lumen_core.transport import Client, Server

pytestmark = [pytest.mark.ucx, pytest.mark.timeout(60)]

MODEL = "model-under-test"
BLOCK_SIZE = 16
TLS = "tcp"
NUM_TOKENS = 37  # two full blocks and a partial one


def cache(seed: int) -> KVLayout:
    return make_paged_cache("vllm_flash", num_layers=2, num_blocks=8, block_size=BLOCK_SIZE, seed=seed)


def transposed_cache() -> KVLayout:
    """A random fp32 vLLM CPU cache (2 layers, 8 blocks, 2 heads of 32): K transposed, so 16
    slots share each 64-byte line."""
    gen = torch.Generator().manual_seed(0)
    caches = [random_tensor((8, 2, BLOCK_SIZE, 64), torch.float32, generator=gen) for _ in range(2)]
    return KVLayout.vllm_cpu(caches, isa="vec")


def slots(block_ids: list[int], n: int = NUM_TOKENS) -> list[int]:
    return slots_for_blocks(block_ids, block_size=BLOCK_SIZE, num_tokens=n).tolist()


def tokens(n: int = NUM_TOKENS) -> list[int]:
    return [(7 * i + 3) % 1000 for i in range(n)]


class Holder:
    """A HolderStore served on loopback (holder id 0), trusting ``issuer``'s capabilities."""

    def __init__(self, secret: bytes, issuer: CapabilityIssuer, *, verify_records: bool = True) -> None:
        self.store = HolderStore()
        self.issuer = issuer
        self.server: Server = self.store.serve(
            secret, tls=TLS, verify_records=verify_records, issuer_public_key=issuer.public_key
        )
        self.address = ("127.0.0.1", self.server.port)

    def capability(self, key: int, epoch: int) -> bytes:
        """The issuer's capability of (key, shard 0, epoch) on this holder."""
        return self.issuer.issue(key, 0, epoch, holder_id=0)

    def durable(self, key: int, epoch: int | None = None) -> int:
        held = [c for c in self.store.checkpoints() if c.request_id == key and epoch in (None, c.epoch)]
        return held[0].durable_tokens if held else 0


@pytest.fixture
def holder(secret: bytes, issuer: CapabilityIssuer) -> Iterator[Holder]:
    h = Holder(secret, issuer)
    yield h
    h.server.close()


def core_for(secret: bytes, seed: int, **options: object) -> ConnectorCore:
    core = ConnectorCore(secret, MODEL, tls=TLS, connect_timeout_s=1.0, **options)  # type: ignore[arg-type]
    core.register(cache(seed))
    return core


def stream(core: ConnectorCore, secret: bytes, holder: Holder, request_id: str, block_ids: list[int]) -> int:
    """Streams NUM_TOKENS tokens of ``request_id`` (a prefill step, then one token per step);
    returns its wire key once they are durable."""
    key = request_key(request_id)
    assert core.begin(request_id, key, StreamGrant(0, (holder.address,), (holder.capability(key, 0),)))
    s, t = slots(block_ids), tokens()
    assert core.save_step([StepTokens(request_id, 0, s[:30], t[:30])]) == 30
    for p in range(30, NUM_TOKENS):
        assert core.save_step([StepTokens(request_id, p, s[p : p + 1], t[p : p + 1])]) == 1
    assert core.streamer is not None and core.streamer.flush(timeout_s=10)
    return key


def test_a_request_streams_restores_bit_exact_and_is_released_on_finish(
    secret: bytes, holder: Holder
) -> None:
    writer = core_for(secret, seed=0)
    key = stream(writer, secret, holder, "r", [0, 1, 2])
    assert writer.durable_tokens() == {"r": NUM_TOKENS} and writer.durable_lag_tokens() == 0
    assert writer.counters["saved_tokens"] == NUM_TOKENS

    reader = core_for(secret, seed=1)
    source = RestoreSource(0, holder.address, holder.capability(key, 0))
    assert wait_until(lambda: reader.plan_restore("r", key, source) is not None)
    assert reader.plan_restore("r", key, source) == NUM_TOKENS
    target = [5, 3, 7]  # other blocks, in another order
    outcome = reader.restore("r", key, source, slots(target), tokens())
    assert outcome.result.status is RestoreStatus.COMPLETE and outcome.failed_block_ids == frozenset()
    assert reader.restores["r"].restored_tokens == NUM_TOKENS
    assert_kv_equal(writer.layout, torch.tensor(slots([0, 1, 2])), reader.layout, torch.tensor(slots(target)))

    assert writer.finish("r")
    assert not writer.is_streaming("r") and writer.counters["released"] == 1
    assert wait_until(lambda: holder.durable(key) == 0)  # released on the holder
    writer.close()
    reader.close()


def test_without_release_finished_a_finished_request_keeps_its_checkpoint(
    secret: bytes, holder: Holder
) -> None:
    # A gateway's worker: the gateway releases the copy once it learns the end; a worker cut
    # off from it must not drop the copy the failover restores (CI saw restored 0).
    writer = core_for(secret, seed=0, release_finished=False)
    key = stream(writer, secret, holder, "r", [0, 1, 2])
    assert writer.finish("r")
    assert not writer.is_streaming("r") and writer.counters["released"] == 1
    writer.close()  # nothing queued is sent after this: a release in flight would be dropped
    assert holder.durable(key) == NUM_TOKENS
    reader = core_for(secret, seed=1)
    outcome = reader.restore(
        "r", key, RestoreSource(0, holder.address, holder.capability(key, 0)), slots([3, 4, 5]), tokens()
    )
    assert outcome.result.status is RestoreStatus.COMPLETE
    reader.close()
    # The gateway's word (vLLM's control `release`) releases it whatever the default.
    writer = core_for(secret, seed=0, release_finished=False)
    key = stream(writer, secret, holder, "s", [0, 1, 2])
    assert writer.finish("s", release=True)
    assert wait_until(lambda: holder.durable(key) == 0)
    writer.close()


def test_a_corrupted_record_fails_its_blocks_and_nothing_past_it_is_written(
    secret: bytes, issuer: CapabilityIssuer
) -> None:
    holder = Holder(secret, issuer, verify_records=False)  # keeps what arrives: the restore must catch it
    try:
        source_cache = cache(seed=0)
        key = request_key("r")
        capability = holder.capability(key, 0)
        fingerprints = fingerprint_bytes(source_cache, MODEL)
        records = gather_tokens(source_cache, torch.tensor(slots([0, 1, 2]))).clone()
        crcs = checksum(records).numpy()
        records[20, 5] ^= 0x10  # position 20: in block 1 of the request
        with Client(*holder.address, secret, tls=TLS) as client:
            client.open(
                key, 0, 0, source_cache.record_bytes, fingerprints[:32], fingerprints[32:], capability
            )
            ids = np.asarray(tokens(), dtype=np.uint32)
            client.append(key, 0, 0, 0, ids, crcs, records.numpy(), capability)

        reader = core_for(secret, seed=1)
        before = gather_tokens(reader.layout, torch.tensor(slots([4, 5, 6]))).clone()
        outcome = reader.restore(
            "r", key, RestoreSource(0, holder.address, capability), slots([4, 5, 6]), tokens()
        )
        assert outcome.result.status is RestoreStatus.CRC_MISMATCH
        assert outcome.result.restored_tokens == 20
        assert outcome.failed_block_ids == {5, 6}  # positions 20.. are in blocks 5 and 6
        after = gather_tokens(reader.layout, torch.tensor(slots([4, 5, 6])))
        assert torch.equal(after[:20], records[:20]) and torch.equal(after[20:], before[20:])
        assert reader.counters["restore_crc_mismatch"] == 1
        reader.close()
    finally:
        holder.server.close()


def test_a_restored_prefix_is_streamed_again_at_the_new_epoch(secret: bytes, holder: Holder) -> None:
    writer = core_for(secret, seed=0)
    key = stream(writer, secret, holder, "r", [0, 1, 2])
    writer.close()  # the first incarnation dies

    next_holder = Holder(secret, holder.issuer)
    try:
        survivor = core_for(secret, seed=1)
        grant = StreamGrant(1, (next_holder.address,), (next_holder.capability(key, 1),))
        assert survivor.begin("r", key, grant)
        source = RestoreSource(1, holder.address, holder.capability(key, 1))
        outcome = survivor.restore("r", key, source, slots([6, 2, 4]), tokens())
        assert outcome.result.restored_tokens == NUM_TOKENS
        assert survivor.streamer is not None and survivor.streamer.flush(timeout_s=10)
        [checkpoint] = next_holder.store.checkpoints()
        assert (checkpoint.request_id, checkpoint.epoch, checkpoint.durable_tokens) == (key, 1, NUM_TOKENS)
        # The next decoded token continues the checkpoint; the restored positions are not sent twice.
        s, t = slots([6, 2, 4], NUM_TOKENS + 1), tokens(NUM_TOKENS + 1)
        assert survivor.save_step([StepTokens("r", 0, s, t)]) == 1
        assert survivor.streamer.flush(timeout_s=10)
        assert next_holder.durable(key, epoch=1) == NUM_TOKENS + 1
        survivor.close()
    finally:
        next_holder.server.close()


def test_preemption_keeps_the_checkpoint_and_later_saves_continue_it(secret: bytes, holder: Holder) -> None:
    core = core_for(secret, seed=0)
    key = stream(core, secret, holder, "r", [0, 1, 2])
    core.preempt("r")
    assert core.is_streaming("r") and core.counters["released"] == 0 and core.counters["preempted"] == 1
    assert holder.durable(key) == NUM_TOKENS
    # Re-admitted, it recomputes from position 0 into other blocks: only the new token is sent.
    s, t = slots([3, 4, 5], NUM_TOKENS + 1), tokens(NUM_TOKENS + 1)
    assert core.save_step([StepTokens("r", 0, s, t)]) == 1
    assert core.streamer is not None and core.streamer.flush(timeout_s=10)
    assert holder.durable(key) == NUM_TOKENS + 1
    # A save past the saved prefix would leave a gap: skipped and counted.
    assert core.save_step([StepTokens("r", NUM_TOKENS + 5, s[:1], t[:1])]) == 0
    assert core.counters["save_gaps"] == 1
    core.close()


def test_a_transposed_cache_is_saved_in_whole_lines_and_its_tail_handed_over_when_its_slots_go(
    secret: bytes, holder: Holder
) -> None:
    """vLLM CPU's K shares each 64-byte line among 16 fp32 slots: tokens are held until the
    slot that ends their line is saved, at most 15 behind; the held tail is handed over by
    ``flush``, ``preempt`` and ``finish`` (before the engine may free or rewrite the slots),
    and the records are those of saving every token at once."""
    layout = transposed_cache()
    assert layout.line_tokens == 16
    core = ConnectorCore(secret, MODEL, tls=TLS, connect_timeout_s=1.0, release_finished=False)
    core.register(layout)
    keys = {r: request_key(r) for r in ("r", "q", "b")}
    for request_id, key in keys.items():
        assert core.begin(request_id, key, StreamGrant(0, (holder.address,), (holder.capability(key, 0),)))
    s, t = slots([0, 1, 2]), tokens()
    assert core.save_step([StepTokens("r", 0, s[:20], t[:20])]) == 16  # a prefill: 4 held
    handed = [core.save_step([StepTokens("r", p, s[p : p + 1], t[p : p + 1])]) for p in range(20, 34)]
    assert handed == [0] * 11 + [16, 0, 0]  # slot 31 ends a line
    q = slots([6], 5)
    assert core.save_step([StepTokens("q", 0, q, t[:5])]) == 0
    assert core.save_step([StepTokens("b", 0, slots([3, 4, 5], 40), tokens(40))]) == 32
    assert core.streamer is not None and core.streamer.flush(timeout_s=10)
    assert [holder.durable(keys[r]) for r in ("r", "q", "b")] == [32, 0, 32]
    assert core.durable_lag_tokens() == 2 + 5 + 8  # held ones count

    core.preempt("r")  # its slots may be rewritten: the tail goes first
    assert core.flush(["r"]) == 0 and core.streamer.flush(timeout_s=10)
    assert holder.durable(keys["r"]) == 34 and holder.durable(keys["q"]) == 0
    assert core.finish("q")  # its slots are freed: the tail goes first
    assert wait_until(lambda: holder.durable(keys["q"]) == 5)
    assert core.flush() == 8 and core.counters["saved_tokens"] == 34 + 5 + 40

    reader = ConnectorCore(secret, MODEL, tls=TLS, connect_timeout_s=1.0)
    reader.register(make_paged_cache("vllm_flash", num_layers=2, num_blocks=8, block_size=BLOCK_SIZE,
                                     num_kv_heads=2, head_dim=32, dtype=torch.float32, seed=1))  # fmt: skip
    source = RestoreSource(0, holder.address, holder.capability(keys["r"], 0))
    target = slots([6, 4, 3], 34)
    assert reader.restore("r", keys["r"], source, target, t[:34]).result.status is RestoreStatus.COMPLETE
    assert torch.equal(
        gather_tokens(layout, torch.tensor(s[:34])), gather_tokens(reader.layout, torch.tensor(target))
    )
    core.close()
    reader.close()


def test_without_hold_lines_every_token_goes_in_its_step(secret: bytes, holder: Holder) -> None:
    """``hold_lines=False``: a transposed cache's tokens are enqueued in the step that
    computed them, not held to their line's end, and their records are the same."""
    layout = transposed_cache()
    assert layout.line_tokens == 16
    core = ConnectorCore(secret, MODEL, tls=TLS, connect_timeout_s=1.0, hold_lines=False)
    core.register(layout)
    key = request_key("r")
    assert core.begin("r", key, StreamGrant(0, (holder.address,), (holder.capability(key, 0),)))
    s, t = slots([0, 1, 2]), tokens()
    assert core.save_step([StepTokens("r", 0, s[:20], t[:20])]) == 20
    assert [core.save_step([StepTokens("r", p, s[p : p + 1], t[p : p + 1])]) for p in range(20, 24)] == [
        1
    ] * 4
    assert core.streamer is not None and core.streamer.flush(timeout_s=10)
    assert holder.durable(key) == 24 and core.durable_lag_tokens() == 0

    reader = ConnectorCore(secret, MODEL, tls=TLS, connect_timeout_s=1.0)
    reader.register(make_paged_cache("vllm_flash", num_layers=2, num_blocks=8, block_size=BLOCK_SIZE,
                                     num_kv_heads=2, head_dim=32, dtype=torch.float32, seed=1))  # fmt: skip
    target = slots([6, 4], 24)
    source = RestoreSource(0, holder.address, holder.capability(key, 0))
    assert reader.restore("r", key, source, target, t[:24]).result.status is RestoreStatus.COMPLETE
    assert torch.equal(
        gather_tokens(layout, torch.tensor(s[:24])), gather_tokens(reader.layout, torch.tensor(target))
    )
    core.close()
    reader.close()


def test_a_flush_mark_waits_for_what_was_saved_by_then_not_for_what_follows(
    secret: bytes, holder: Holder
) -> None:
    """``flush_mark`` hands the held tails over and marks each stream's saved length; tokens
    saved after it (a drained engine decodes on) are not in ``lag_behind``, and a stream that
    ended since counts none."""
    core = ConnectorCore(secret, MODEL, tls=TLS, connect_timeout_s=1.0)
    core.register(transposed_cache())
    keys = {r: request_key(r) for r in ("r", "q")}
    for request_id, key in keys.items():
        assert core.begin(request_id, key, StreamGrant(0, (holder.address,), (holder.capability(key, 0),)))
    s, t = slots([0, 1, 2]), tokens()
    prefills = [StepTokens("r", 0, s[:20], t[:20]), StepTokens("q", 0, slots([6], 5), t[:5])]
    assert core.save_step(prefills) == 16
    mark = core.flush_mark()  # the held 4 + 5 go now
    assert mark == {keys["r"]: 20, keys["q"]: 5} and 0 <= core.lag_behind(mark) <= 25
    for p in range(20, 30):  # decoding on: held, not durable
        core.save_step([StepTokens("r", p, s[p : p + 1], t[p : p + 1])])
    assert wait_until(lambda: core.lag_behind(mark) == 0)
    assert core.durable_lag_tokens() == 10 and holder.durable(keys["r"]) == 20
    assert core.finish("q") and core.lag_behind({keys["q"]: 99}) == 0
    core.close()


def test_a_step_enqueues_what_the_streamer_stages_oldest_lines_first(secret: bytes, holder: Holder) -> None:
    """Three requests end a line of 16 in the same step and the streamer stages 40 tokens a
    step: two lines go now, the third first in the next step; none is deferred."""
    layout = transposed_cache()
    core = ConnectorCore(
        secret,
        MODEL,
        tls=TLS,
        connect_timeout_s=1.0,
        streamer_options={"staging_bytes": 40 * layout.record_bytes},
    )
    core.register(layout, start_streamer=True)
    assert core.streamer is not None and core.streamer.step_tokens == 40
    keys = {r: request_key(r) for r in ("a", "b", "c")}
    for r, key in keys.items():
        assert core.begin(r, key, StreamGrant(0, (holder.address,), (holder.capability(key, 0),)))
    blocks = {"a": [0, 3], "b": [1], "c": [2]}
    steps = [StepTokens(r, 0, slots(blocks[r], 16), tokens(16)) for r in keys]
    assert core.save_step(steps) == 32
    assert core.durable_lag_tokens() >= 16
    # "c" waited: it goes first, "a"'s new token is held (its line is not whole).
    assert core.save_step([StepTokens("a", 16, slots(blocks["a"], 17)[16:], tokens(17)[16:])]) == 16
    assert core.streamer is not None and core.streamer.flush(timeout_s=10)
    assert [holder.durable(keys[r]) for r in "abc"] == [16, 16, 16]
    assert core.streamer.stats().counters["tokens_deferred"] == 0
    core.close()


def test_an_engine_that_will_stream_gets_its_streamer_at_register(secret: bytes, holder: Holder) -> None:
    """start_streamer: built with the cache, and the first request streams on it (a lazy core
    builds it at its first begin, inside that engine step)."""
    lazy = core_for(secret, seed=0)
    assert lazy.streamer is None
    lazy.close()
    core = ConnectorCore(secret, MODEL, tls=TLS, connect_timeout_s=1.0)
    core.register(cache(seed=0), start_streamer=True)
    built = core.streamer
    assert built is not None
    stream(core, secret, holder, "r", [0, 1, 2])
    assert core.streamer is built
    core.close()


def test_an_abandoned_request_keeps_its_checkpoint_and_the_next_one_streams_anew(
    secret: bytes, holder: Holder
) -> None:
    """A fenced worker's requests: streaming stops, the holder keeps what it holds (a release
    would drop it), and a request begun after that streams on a fresh streamer."""
    core = core_for(secret, seed=0)
    key = stream(core, secret, holder, "r", [0, 1, 2])
    assert core.abandon() == 1
    assert core.streamer is None and not core.is_streaming("r")
    assert core.save_step([StepTokens("r", NUM_TOKENS, slots([3], 1), tokens(1))]) == 0  # ignored
    assert core.finish("r")  # the engine aborts it: nothing left to release
    assert core.counters["released"] == 0 and core.counters["abandoned"] == 1
    time.sleep(0.2)  # a release would have reached the holder by now
    assert holder.durable(key, epoch=0) == NUM_TOKENS
    again = stream(core, secret, holder, "s", [4, 5, 6])
    assert core.durable_tokens() == {"s": NUM_TOKENS} and holder.durable(again) == NUM_TOKENS
    core.close()


def test_a_lookup_never_blocks_the_caller(secret: bytes, holder: Holder) -> None:
    # A TCP listener that never speaks: connecting to it stalls until the connect timeout.
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)
        core = core_for(secret, seed=0)
        stalled = RestoreSource(0, silent.getsockname(), holder.capability(1, 0))
        started = time.monotonic()
        assert core.plan_restore("a", 1, stalled) is None  # not known yet
        assert core.plan_restore("a", 1, stalled) is None
        assert time.monotonic() - started < 0.5
        assert core.plan_restore("a", 1, stalled, wait_s=10) == 0  # unreachable: nothing to restore
        core.close()


def test_a_holder_that_cannot_be_reached_is_reported(secret: bytes, holder: Holder) -> None:
    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))
        nobody = closed.getsockname()  # nothing listens there once closed
    core = core_for(secret, seed=0)
    assert (core.streamer_counters(), core.unreachable_holders()) == ({}, ())  # nothing streamed yet
    key = request_key("r")
    grant = StreamGrant(0, (nobody, holder.address), (holder.capability(key, 0), holder.capability(key, 0)))
    assert core.begin("r", key, grant)
    core.save_step([StepTokens("r", 0, slots([0, 1, 2]), tokens())])
    assert wait_until(lambda: holder.durable(key) == NUM_TOKENS)  # the other replica is whole
    assert wait_until(lambda: core.streamer_counters()["holder_failures"] > 0)
    assert core.unreachable_holders() == (nobody,)
    core.close()


def silent_listener(not_on_lane_of: tuple[str, int], lanes: int = 4) -> socket.socket:
    """A TCP listener that never speaks (connecting stalls until the connect timeout), on a
    lookup lane other than ``not_on_lane_of``'s (lanes are chosen by the address's hash)."""
    while True:
        listener = socket.socket()
        listener.bind(("127.0.0.1", 0))
        listener.listen(8)
        if hash(listener.getsockname()) % lanes != hash(not_on_lane_of) % lanes:
            return listener
        listener.close()


def test_a_stalled_holder_holds_up_only_its_own_lookups(secret: bytes, holder: Holder) -> None:
    writer = core_for(secret, seed=0)
    key = stream(writer, secret, holder, "r", [0, 1, 2])
    reader = ConnectorCore(secret, MODEL, tls=TLS, connect_timeout_s=3.0)
    reader.register(cache(1))
    with silent_listener(holder.address) as silent:
        stalled = RestoreSource(0, silent.getsockname(), holder.capability(key, 0))
        assert reader.plan_restore("a", key, stalled) is None
        started = time.monotonic()
        good = RestoreSource(0, holder.address, holder.capability(key, 0))
        assert reader.plan_restore("r", key, good, wait_s=2.5) == NUM_TOKENS
        assert time.monotonic() - started < 2.5  # not behind the stalled one's 3 s timeout
        assert reader.plan_restore("a", key, stalled) is None
        assert reader.plan_restore("a", key, stalled, wait_s=10) == 0
    writer.close()
    reader.close()


def test_a_source_in_this_process_is_answered_at_once(secret: bytes, holder: Holder) -> None:
    writer = core_for(secret, seed=0)
    key = stream(writer, secret, holder, "r", [0, 1, 2])
    reader = core_for(secret, seed=1, store=holder.store)
    assert reader.plan_restore("r", key, RestoreSource(0, None, b"")) == NUM_TOKENS
    outcome = reader.restore("r", key, RestoreSource(0, None, b""), slots([3, 4, 5]), tokens())
    assert outcome.result.status is RestoreStatus.COMPLETE
    writer.close()
    reader.close()


def test_a_refused_capability_restores_nothing_and_fails_every_block(secret: bytes, holder: Holder) -> None:
    writer = core_for(secret, seed=0)
    key = stream(writer, secret, holder, "r", [0, 1, 2])
    reader = core_for(secret, seed=1)
    not_the_holders_issuer = CapabilityIssuer.generate()
    forged = RestoreSource(0, holder.address, not_the_holders_issuer.issue(key, 0, 0, holder_id=0))
    assert reader.plan_restore("r", key, forged, wait_s=10) == 0
    outcome = reader.restore("r", key, forged, slots([3, 4, 5]), tokens())
    assert outcome.result.restored_tokens == 0 and outcome.failed_block_ids == {3, 4, 5}
    assert reader.counters["restore_missing"] == 1
    writer.close()
    reader.close()


def test_started_restores_end_on_their_thread_and_are_booked_when_collected(
    secret: bytes, holder: Holder
) -> None:
    """start_restore writes what restore writes, off the caller's thread; outcomes come back
    in the order started (a refused one fails every block) and are booked only then."""
    writer = core_for(secret, seed=0)
    key = stream(writer, secret, holder, "r", [0, 1, 2])
    reader = core_for(secret, seed=1)
    forged = RestoreSource(0, holder.address, CapabilityIssuer.generate().issue(key, 0, 0, holder_id=0))
    reader.start_restore(
        "r", key, RestoreSource(0, holder.address, holder.capability(key, 0)), slots([5, 3, 7]), tokens()
    )
    reader.start_restore("r2", key, forged, slots([4, 6], 2 * BLOCK_SIZE), tokens(2 * BLOCK_SIZE))
    done: list = []
    assert wait_until(lambda: bool(done.extend(reader.finished_restores()) or len(done) == 2))
    (first, restored), (second, refused) = done
    assert (first, second) == ("r", "r2")
    assert restored.result.status is RestoreStatus.COMPLETE and restored.failed_block_ids == frozenset()
    assert_kv_equal(
        writer.layout, torch.tensor(slots([0, 1, 2])), reader.layout, torch.tensor(slots([5, 3, 7]))
    )
    assert refused.result.restored_tokens == 0 and refused.failed_block_ids == {4, 6}
    assert reader.counters["restores"] == 2 and reader.counters["restore_missing"] == 1
    assert reader.counters["restore_us"] > 0  # their own time, on the restore thread
    assert reader.finished_restores() == []
    with pytest.raises(ValueError):  # checked before anything starts
        reader.start_restore("r3", key, forged, slots([4], 2), tokens(3))
    writer.close()
    reader.close()


def test_restores_run_at_the_niceness_asked(secret: bytes, holder: Holder) -> None:
    """``restore_nice`` lowers the restore thread's priority (and its connections' threads)."""
    writer = core_for(secret, seed=0)
    key = stream(writer, secret, holder, "r", [0, 1, 2])
    caller = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    reader = ConnectorCore(secret, MODEL, tls=TLS, restore_nice=7)
    reader.register(cache(1))
    before = set(threading.enumerate())
    reader.start_restore(
        "r", key, RestoreSource(0, holder.address, holder.capability(key, 0)), slots([5, 3, 7]), tokens()
    )
    done: list = []
    assert wait_until(lambda: bool(done.extend(reader.finished_restores()) or done))
    assert done[0][1].result.status is RestoreStatus.COMPLETE
    (restorer,) = [t for t in set(threading.enumerate()) - before if t.name.startswith("lumen-restore")]
    assert restorer.native_id is not None
    assert os.getpriority(os.PRIO_PROCESS, restorer.native_id) == max(7, caller)  # never raised
    assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == caller
    writer.close()
    reader.close()


def _thread_cpus() -> dict[int, set[int]]:
    """The CPUs each thread of this process may run on, by thread id."""
    found = {}
    for tid in map(int, os.listdir("/proc/self/task")):
        try:
            found[tid] = os.sched_getaffinity(tid)
        except ProcessLookupError:  # ended meanwhile
            pass
    return found


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two CPUs to place threads on one")
def test_the_connectors_threads_run_on_its_cpus(secret: bytes, holder: Holder) -> None:
    """``cpus``: the streamer's, restores' and lookups' threads (and their connections') start
    on them; the engine's thread stays where it was."""
    mine = os.sched_getaffinity(0)
    chosen = {max(mine)}
    writer = core_for(secret, seed=0)
    key = stream(writer, secret, holder, "r", [0, 1, 2])
    before = _thread_cpus()
    core = core_for(secret, seed=1, cpus=chosen)
    source = RestoreSource(0, holder.address, holder.capability(key, 0))
    assert core.plan_restore("r", key, source, wait_s=10) == NUM_TOKENS
    core.start_restore("r", key, source, slots([5, 3, 7]), tokens())
    done: list = []
    assert wait_until(lambda: bool(done.extend(core.finished_restores()) or done))
    assert done[0][1].result.status is RestoreStatus.COMPLETE
    other = request_key("q")
    assert core.begin("q", other, StreamGrant(0, (holder.address,), (holder.capability(other, 0),)))
    assert core.save_step([StepTokens("q", 0, slots([4], 5), tokens(5))]) == 5
    assert core.streamer is not None and core.streamer.flush(timeout_s=10)
    started = {tid: cpus for tid, cpus in _thread_cpus().items() if tid not in before}
    assert len(started) >= 3  # the streamer's, the restore's and a lookup's at least
    assert all(cpus == chosen for cpus in started.values()), started
    assert os.sched_getaffinity(0) == mine
    core.close()
    writer.close()


def test_arguments_are_checked(secret: bytes, holder: Holder) -> None:
    with pytest.raises(TypeError, match="`secret` must be bytes"):
        ConnectorCore("s", MODEL)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="`model_fingerprint` must be a non-empty str"):
        ConnectorCore(secret, "")
    with pytest.raises(TypeError, match="`store` must be a HolderStore, got dict"):
        ConnectorCore(secret, MODEL, store={})  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="`tls` must be a str, got int"):
        ConnectorCore(secret, MODEL, tls=1)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="`connect_timeout_s` must be > 0"):
        ConnectorCore(secret, MODEL, connect_timeout_s=0)
    with pytest.raises(TypeError, match="`streamer_options` must be a dict, got list"):
        ConnectorCore(secret, MODEL, streamer_options=[])  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="`release_finished` must be a bool, got int"):
        ConnectorCore(secret, MODEL, release_finished=1)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"`restore_nice` must be in \[0, 19\], got 20"):
        ConnectorCore(secret, MODEL, restore_nice=20)
    with pytest.raises(TypeError, match="`hold_lines` must be a bool, got int"):
        ConnectorCore(secret, MODEL, hold_lines=0)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="`cpus` must be a collection of CPU numbers, got str"):
        ConnectorCore(secret, MODEL, cpus="1")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="`cpus` must name at least one CPU"):
        ConnectorCore(secret, MODEL, cpus=[])
    with pytest.raises(ValueError, match=r"`cpus\[i\]` must be in \[0, "):
        ConnectorCore(secret, MODEL, cpus=[4096])
    core = ConnectorCore(secret, MODEL, tls=TLS)
    with pytest.raises(RuntimeError, match="register has not been called"):
        core.restore("r", 1, RestoreSource(0, holder.address, b"cap"), [0], [1])
    with pytest.raises(TypeError, match="`layout` must be a KVLayout, got str"):
        core.register("cache")  # type: ignore[arg-type]
    core.register(cache(seed=0))
    with pytest.raises(RuntimeError, match="register has already been called"):
        core.register(cache(seed=0))
    grant = StreamGrant(0, (holder.address,), (holder.capability(1, 0),))
    with pytest.raises(TypeError, match="`grant` must be a StreamGrant, got tuple"):
        core.begin("r", 1, (0, (), b""))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"`key` must be in \[0, 18446744073709551615\], got -1"):
        core.begin("r", -1, grant)
    with pytest.raises(TypeError, match="`request_id` must be a non-empty str"):
        core.begin("", 1, grant)
    assert not core.begin("r", 1, StreamGrant(0, (), ()))  # no holders: not checkpointed
    assert core.begin("r", 1, grant)
    with pytest.raises(ValueError, match="`request_id` must not be streaming already, got 'r'"):
        core.begin("r", 1, grant)
    with pytest.raises(TypeError, match=r"`steps\[i\]` must be a StepTokens, got tuple"):
        core.save_step([("r", 0, [0], [1])])  # type: ignore[list-item]
    with pytest.raises(
        ValueError, match="`slot_ids` and `token_ids` must have one entry per token, got 2 and 1"
    ):
        StepTokens("r", 0, [0, 1], [1])
    with pytest.raises(
        ValueError, match="`slot_ids` and `token_ids` must have one entry per token, got 1 and 2"
    ):
        core.restore("r", 1, RestoreSource(0, holder.address, b"cap"), [0], [1, 2])
    with pytest.raises(TypeError, match="`source` must be a RestoreSource, got NoneType"):
        core.restore("r", 1, None, [0], [1])  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="`source.address` must name a holder: this connector has no store"):
        core.restore("r", 1, RestoreSource(0, None, b""), [0], [1])
    with pytest.raises(IndexError):  # a slot outside the cache: refused before anything is written
        core.restore("r", 1, RestoreSource(0, holder.address, b"c"), [8 * BLOCK_SIZE], [1])
    with pytest.raises(ValueError, match=r"`capabilities\[0\]` must be non-empty bytes"):
        StreamGrant(0, (holder.address,), (b"",))
    with pytest.raises(
        ValueError, match=r"`capabilities` must be a tuple of one capability per holder \(1\)"
    ):
        StreamGrant(0, (holder.address,), ())
    with pytest.raises(TypeError, match="`capability` must be bytes, got str"):
        RestoreSource(0, holder.address, "cap")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"`expected_tokens` must be in"):
        StreamGrant(0, (), (), expected_tokens=-1)
    with pytest.raises(ValueError, match=r"`wait_s` must be"):
        core.plan_restore("q", 1, RestoreSource(0, holder.address, b"c"), wait_s=float("nan"))
    core.close()
