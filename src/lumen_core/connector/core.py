"""``ConnectorCore``: one request's checkpoint lifecycle, engine-neutral (docs/connector.md).

An engine adapter (the reference engine's ``StreamingConnector``, vLLM's ``LumenConnector``,
a future SGLang one) maps its hooks onto these calls:

- ``register(layout)`` once, with the layout of the engine's KV cache;
- ``begin(request_id, key, grant)`` before a request's first save: where it streams;
- ``save_step(steps)`` once per step, all requests' newly written tokens in one call; it only
  enqueues (the gather, crc32c and sends run on the streamer's thread);
- ``durable_tokens()`` / ``durable_lag_tokens()``: what the holders hold; ``flush_mark()`` and
  ``lag_behind(mark)``: how much of what was saved by a point is not durable yet;
- ``plan_restore(...)`` (never blocks: None = not known yet) and ``restore(...)`` into the
  request's new slots, returning the blocks whose load failed (recompute them); the verified
  prefix is streamed again to the request's holders, at its new epoch. ``start_restore(...)``
  does the same on the core's restore thread while the engine steps on, and
  ``finished_restores()`` hands back the outcomes;
- ``preempt(request_id)`` when the engine will rewrite a request's blocks (its checkpoint is
  kept), ``finish(request_id)`` when it finished or the gateway said so (released, or only
  forgotten where the gateway releases: ``release_finished``);
- ``abandon()`` when the engine's worker is fenced: every request stops streaming and its
  checkpoints stay on their holders (the gateway restores from them elsewhere).
"""

from __future__ import annotations

import time
from collections import Counter, deque
from collections.abc import Iterable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from lumen_core._validate import U32_MAX, U64_MAX, check_int, check_number
from lumen_core.auth import WorkerIdentity, check_secret
from lumen_core.connector.lookup import RestoreLookup
from lumen_core.connector.requests import RestoreSource, StepTokens, StreamGrant
from lumen_core.connector.sources import SourceReader
from lumen_core.connector.threads import check_cpus, creating_on, setup_thread
from lumen_core.layouts import KVLayout
from lumen_core.stream._common import check_str
from lumen_core.stream.holder import HolderStore, RestoreResult
from lumen_core.stream.streamer import CheckpointStreamer

__all__ = ["ConnectorCore", "RestoreOutcome"]

# Restore results kept for inspection (tests, stats, pacing), oldest dropped first.
_KEPT_RESTORES = 1024
# How long finish() waits for a request's last gather unless told otherwise.
_FINISH_TIMEOUT_S = 10.0


@dataclass(frozen=True)
class RestoreOutcome:
    """``result``: how far the verified restore got and why it stopped; ``failed_block_ids``:
    the blocks holding positions from ``result.restored_tokens`` on (the engine recomputes
    them: a block that failed verification is never served)."""

    result: RestoreResult
    failed_block_ids: frozenset[int]


@dataclass
class _Streaming:
    key: int
    saved_tokens: int = 0  # positions [0, saved_tokens) saved: handed to the streamer or held
    # The held tail: the last len(held_slots) saved positions, not handed over yet (save_step).
    held_slots: list[int] = field(default_factory=list)
    held_tokens: list[int] = field(default_factory=list)
    lined: int = 0  # the held positions up to the last one whose slot ends a line

    def hold(self, slot_ids: Sequence[int], token_ids: Sequence[int], line: int) -> None:
        """Holds the next saved positions; ``lined`` moves to the last new one that ends a
        ``line`` of slots (every one with ``line`` 1), so only new slots are looked at."""
        self.held_slots += slot_ids
        self.held_tokens += token_ids
        for back, slot in enumerate(reversed(slot_ids)):
            if (slot + 1) % line == 0:
                self.lined = len(self.held_slots) - back
                break

    def whole_lines(self, line: int, limit: int) -> int:
        """The most held positions, at most ``limit``, that end at a ``line`` boundary (0: none)."""
        count = min(limit, self.lined)
        while 0 < count < self.lined and (self.held_slots[count - 1] + 1) % line:
            count -= 1
        return count

    def hand_over(self, count: int, into: tuple[list[int], list[int], list[int], list[int]]) -> None:
        """Moves the first ``count`` held positions into ``into``: (keys, positions, slots, token ids)."""
        ids, positions, slots, tokens = into
        first = self.saved_tokens - len(self.held_slots)
        ids += [self.key] * count
        positions += range(first, first + count)
        slots += self.held_slots[:count]
        tokens += self.held_tokens[:count]
        del self.held_slots[:count], self.held_tokens[:count]
        self.lined = max(0, self.lined - count)


class ConnectorCore:
    """The checkpoint lifecycle of an engine's requests (see module doc).

    ``secret`` authenticates to holders; ``model_fingerprint`` names the model in every
    record (``connector.model_fingerprint``); ``store`` is this process's ``HolderStore``
    (sources without an address read from it); ``shard`` is this rank's tensor-parallel shard;
    ``tls`` the UCX transports; ``connect_timeout_s`` bounds connecting to a restore source
    (and a lookup); ``streamer_options`` go to ``CheckpointStreamer``, started with the first
    request that streams; ``identity`` is the worker every connection to a holder proves
    (``auth.WorkerIdentity``: capabilities the gateway binds to it need it); with ``encrypt``
    every such connection carries its records in AES-256-GCM. With ``release_finished``
    False, ``finish`` leaves a request's checkpoints on its holders: a gateway that granted
    them releases them once it learns the request ended (a worker cut off from it finishes
    requests the gateway will move and restore from those copies). ``restore_nice`` (0-19) is
    the niceness of ``start_restore``'s thread and of the connections it opens: where restores
    share the cores the engine computes on (a CPU engine), 19 gives them the idle time and not
    the step's, so running requests are not slowed while restored ones take longer. With
    ``hold_lines`` False, ``save_step`` enqueues every token in the step that computed it, where
    a CPU layout would otherwise hold tokens until their cache line is whole (see
    ``save_step``): for an engine that leaves the streamer a core of its own. ``cpus`` (CPU
    numbers; None: the engine thread's) are where the connector's own threads run (the
    streamer, restores, lookups and their connections): on a CPU engine, cores its forward
    does not use (``threads.py``). Request ids are the engine's (str); ``key`` is a request's
    u64 on the wire.

    ``counters``: ``restores``, ``restored_tokens``, ``restore_<status>`` (restores that
    stopped early, by reason), ``saved_tokens``, ``save_gaps`` (saves after a gap, skipped),
    ``released`` (finished; freed on the holders, or left there without
    ``release_finished``), ``abandoned``, ``preempted`` (streaming requests the engine
    preempted; their checkpoints kept). ``restores``: the last result of each of the latest
    requests restored.

    Not thread-safe: one engine thread calls it (lookups run on their own thread).
    """

    def __init__(
        self,
        secret: bytes,
        model_fingerprint: str,
        *,
        store: HolderStore | None = None,
        shard: int = 0,
        tls: str = "",
        connect_timeout_s: float = 2.0,
        streamer_options: dict[str, Any] | None = None,
        identity: WorkerIdentity | None = None,
        encrypt: bool = False,
        release_finished: bool = True,
        restore_nice: int = 0,
        hold_lines: bool = True,
        cpus: Iterable[int] | None = None,
    ) -> None:
        self.secret = check_secret(secret)
        self.restore_nice = check_int("restore_nice", restore_nice, 0, 19)
        if not isinstance(hold_lines, bool):
            raise TypeError(f"`hold_lines` must be a bool, got {type(hold_lines).__name__}")
        self.hold_lines = hold_lines
        self.cpus = check_cpus("cpus", cpus)
        self.identity = identity
        if not isinstance(encrypt, bool):
            raise TypeError(f"`encrypt` must be a bool, got {type(encrypt).__name__}")
        self.encrypt = encrypt
        if not isinstance(release_finished, bool):
            raise TypeError(f"`release_finished` must be a bool, got {type(release_finished).__name__}")
        self.release_finished = release_finished
        self.model_fingerprint = check_str("model_fingerprint", model_fingerprint)
        if store is not None and not isinstance(store, HolderStore):
            raise TypeError(f"`store` must be a HolderStore, got {type(store).__name__}")
        self.store = store
        self.shard = check_int("shard", shard, 0, U32_MAX)
        if not isinstance(tls, str):
            raise TypeError(f"`tls` must be a str, got {type(tls).__name__}")
        self.tls = tls
        self.connect_timeout_s = check_number("connect_timeout_s", connect_timeout_s, positive=True)
        if streamer_options is not None and not isinstance(streamer_options, dict):
            raise TypeError(f"`streamer_options` must be a dict, got {type(streamer_options).__name__}")
        self.streamer_options = dict(streamer_options or {})
        self.streamer: CheckpointStreamer | None = None
        self.counters: Counter[str] = Counter()
        self.restores: dict[str, RestoreResult] = {}
        self._layout: KVLayout | None = None
        self._line_tokens = 1  # the layout's, once registered
        self._lookup: RestoreLookup | None = None
        self._reader = self._source_reader()
        self._streaming: dict[str, _Streaming] = {}
        # Requests with whole lines held, in the order they had them: handed over first.
        self._ready: dict[str, None] = {}
        # start_restore's thread and its own reader (a reader serves one thread), made on first use.
        self._restorer: ThreadPoolExecutor | None = None
        self._restorer_reader: SourceReader | None = None
        self._started: deque[tuple[str, list[int], list[int], Future[tuple[RestoreResult, float]]]] = deque()

    def _source_reader(self) -> SourceReader:
        return SourceReader(
            self.secret,
            store=self.store,
            shard=self.shard,
            tls=self.tls,
            connect_timeout_s=self.connect_timeout_s,
            identity=self.identity,
            encrypt=self.encrypt,
        )

    # ---- setup ------------------------------------------------------------------------------
    def register(self, layout: KVLayout, *, start_streamer: bool = False) -> None:
        """The layout of the engine's KV cache (once, before any save or restore).
        ``start_streamer``: build the streamer now, for an engine that will stream, so that
        its staging and transport are made before serving, not inside the step of the first
        ``begin`` (0.1 s on an idle core here, 0.7 to 9 s while three engines started and
        prefilled on two; bench/RESULTS.md). Otherwise the first ``begin`` builds it."""
        if not isinstance(layout, KVLayout):
            raise TypeError(f"`layout` must be a KVLayout, got {type(layout).__name__}")
        if self._layout is not None:
            raise RuntimeError("register has already been called")
        self._layout = layout
        # A GPU gathers in 32-byte sectors on the streamer's own stream: nothing to gain there.
        self._line_tokens = layout.line_tokens if layout.device.type == "cpu" and self.hold_lines else 1
        if start_streamer:
            self._streamer()

    @property
    def layout(self) -> KVLayout:
        """The engine's KV layout; RuntimeError before ``register``."""
        if self._layout is None:
            raise RuntimeError("register has not been called")
        return self._layout

    def _streamer(self) -> CheckpointStreamer:
        if self.streamer is None:
            with creating_on(self.cpus):  # the threads it starts run there
                self.streamer = CheckpointStreamer(
                    self.layout,
                    self.secret,
                    model_fingerprint=self.model_fingerprint,
                    shard=self.shard,
                    tls=self.tls,
                    identity=self.identity,
                    encrypt=self.encrypt,
                    **self.streamer_options,
                )
        return self.streamer

    # ---- streaming --------------------------------------------------------------------------
    def begin(self, request_id: str, key: int, grant: StreamGrant) -> bool:
        """Starts checkpointing ``request_id`` (wire key ``key``) as ``grant`` says; its saves
        must then start at position 0. False (nothing streamed) when the grant names no
        holders. ValueError if it is already streaming."""
        check_str("request_id", request_id)
        check_int("key", key, 0, U64_MAX)
        if not isinstance(grant, StreamGrant):
            raise TypeError(f"`grant` must be a StreamGrant, got {type(grant).__name__}")
        if request_id in self._streaming:
            raise ValueError(f"`request_id` must not be streaming already, got {request_id!r}")
        if not grant.holders:
            return False
        self._streamer().add_request(
            key,
            list(grant.holders),
            list(grant.capabilities),
            epoch=grant.epoch,
            expected_tokens=grant.expected_tokens,
        )
        self._streaming[request_id] = _Streaming(key)
        return True

    def renew(self, request_id: str, capabilities: Sequence[bytes]) -> bool:
        """Fresh capabilities (same epoch, later expiry) for ``request_id``'s replicas, one
        per holder in its grant's order: each re-opens with its new one before its next append
        (``CheckpointStreamer.renew``). False (nothing done) when it is not streaming."""
        state = self._streaming.get(request_id)
        if state is None:
            return False
        assert self.streamer is not None  # begun: the streamer exists
        self.streamer.renew(state.key, capabilities)
        return True

    def is_streaming(self, request_id: str) -> bool:
        """Whether ``request_id`` was begun (with holders) and not finished."""
        return request_id in self._streaming

    def save_step(self, steps: Sequence[StepTokens]) -> int:
        """Enqueues one step's written tokens of every streaming request in one streamer call
        (never waits for the gather or the holders). Positions already saved are skipped (a
        recompute after preemption, a restored prefix); a save that starts past a request's
        saved prefix would leave a gap and is skipped (``save_gaps``); requests not streaming
        are ignored. Returns the number of tokens enqueued.

        Where a CPU layout's tokens share cache lines (``KVLayout.line_tokens`` > 1: vLLM CPU's
        transposed K), a request's tokens are held until the slot that ends their line is
        saved, and then enqueued together: a decoded token gathered alone reads all its lines
        for one element of each, 15x the time a token of a whole line takes (cold cache,
        bench/vllm_stream.py's decode batch, bench/RESULTS.md). A request's durable
        length then trails its saves by at most ``line_tokens - 1`` tokens more;
        ``wait_for_save``, ``preempt``, ``finish`` and ``flush`` hand the held tail over.
        Unless ``hold_lines`` is False: then the gather's extra reads are the streamer's,
        which pays where it has a core the forward does not use.

        At most ``CheckpointStreamer.step_tokens`` tokens are enqueued per call, oldest whole
        lines first: requests that decode in step (same prompt length and start) end their
        lines in the same step, and past that the streamer would defer the same requests at
        every such burst; the rest waits for the next call."""
        into: tuple[list[int], list[int], list[int], list[int]] = ([], [], [], [])
        for step in steps:
            if not isinstance(step, StepTokens):
                raise TypeError(f"`steps[i]` must be a StepTokens, got {type(step).__name__}")
            state = self._streaming.get(step.request_id)
            if state is None or not step.slot_ids:
                continue
            if step.start_position > state.saved_tokens:
                self.counters["save_gaps"] += 1
                continue
            end = step.start_position + len(step.slot_ids)
            if end <= state.saved_tokens:
                continue
            first = state.saved_tokens - step.start_position
            state.hold(step.slot_ids[first:], step.token_ids[first:], self._line_tokens)
            state.saved_tokens = end
            if state.lined:
                self._ready[step.request_id] = None  # kept in its place if already there
        return self._enqueue(self._hand_over_ready(into))

    def flush(self, request_ids: Sequence[str] | None = None) -> int:
        """Enqueues the held tail (see ``save_step``) of ``request_ids`` (None: every streaming
        request), whatever its line: before the engine frees or rewrites their slots, or when
        their checkpoints must catch up (a drain). Returns the number of tokens enqueued."""
        into: tuple[list[int], list[int], list[int], list[int]] = ([], [], [], [])
        for request_id in list(self._streaming if request_ids is None else request_ids):
            state = self._streaming.get(request_id)
            if state is not None:
                state.hand_over(len(state.held_slots), into)
                self._ready.pop(request_id, None)
        return self._enqueue(into)

    def _hand_over_ready(
        self, into: tuple[list[int], list[int], list[int], list[int]]
    ) -> tuple[list[int], list[int], list[int], list[int]]:
        """Whole lines of the requests in ``_ready``, oldest first, as many as the streamer
        stages in one step (``step_tokens``: past it, it would defer requests, and the same
        ones again at each burst); the first that does not fit goes first next step."""
        if not self._ready:  # nothing streams (and maybe no streamer was ever needed)
            return into
        line = self._line_tokens
        budget = step_tokens = self._streamer().step_tokens
        for request_id in list(self._ready):
            state = self._streaming.get(request_id)
            if state is None:  # finished or abandoned meanwhile
                del self._ready[request_id]
                continue
            count = state.lined
            if count > budget:  # whole lines that fit; a line larger than a step: a piece
                count = state.whole_lines(line, budget) or (budget if budget == step_tokens else 0)
            state.hand_over(count, into)
            budget -= count
            if state.lined:
                break
            del self._ready[request_id]
        return into

    def _enqueue(self, into: tuple[list[int], list[int], list[int], list[int]]) -> int:
        ids, positions, slots, tokens = into
        if ids:
            self._streamer().save_step(ids, positions, slots, tokens)
            self.counters["saved_tokens"] += len(ids)
        return len(ids)

    def resend_last(self, tails: Sequence[StepTokens]) -> int:
        """Hand the streamer each request's last saved token again (``tails``: one token per
        request, at its last saved position). The streamer then resends every replica of
        those requests from its first unsent position, so steps it dropped while its queue was
        full are caught up without a new engine step (a drained worker steps no more).
        Requests not streaming, or whose tail is not their last saved position, are skipped.
        Held tails are handed over first (``flush``). Returns the number of requests handed
        over."""
        self.flush()
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        tokens: list[int] = []
        for tail in tails:
            if not isinstance(tail, StepTokens) or len(tail.slot_ids) != 1:
                raise ValueError(f"`tails[i]` must be a StepTokens of one token, got {tail!r}")
            state = self._streaming.get(tail.request_id)
            if state is None or tail.start_position != state.saved_tokens - 1:
                continue
            ids.append(state.key)
            positions.append(tail.start_position)
            slots += tail.slot_ids
            tokens += tail.token_ids
        if ids:
            self._streamer().save_step(ids, positions, slots, tokens)
        return len(ids)

    def durable_tokens(self) -> dict[str, int]:
        """Durable length (best live replica) of each streaming request."""
        if self.streamer is None:
            return {}
        durable = self.streamer.stats().durable
        return {r: durable.get(s.key, 0) for r, s in self._streaming.items()}

    def durable_lag_tokens(self) -> int:
        """Tokens saved but not yet durable on a live replica (held ones with them), all
        requests together (walks every streaming request: sample it, do not call it every
        step)."""
        if self.streamer is None:
            return 0
        stats = self.streamer.stats()
        held = sum(len(s.held_slots) for s in self._streaming.values())
        return held + sum(max(0, saved - stats.durable.get(key, 0)) for key, saved in stats.saved.items())

    def streamer_counters(self) -> dict[str, int]:
        """The streamer's counters so far (``CheckpointStreamer.counters()``, one read; empty
        before it starts), for the engine's log, as a holder's trouble is otherwise silent:
        ``holder_failures`` (a holder refused the connection, was unreachable, disconnected or
        stalled past the ack timeout), ``replicas_lost`` (a holder refused or dropped a
        checkpoint: over its budget, a capability it does not take, a conflicting record, this
        worker fenced; or was given up on: those requests go on checkpointing to their other
        holders, or not at all), ``tokens_dropped`` and ``tokens_deferred`` (steps not sent:
        queue or staging full, a holder slow)."""
        return {} if self.streamer is None else self.streamer.counters()

    def unreachable_holders(self) -> tuple[tuple[str, int], ...]:
        """The holders that have a replica not live now (walks every streaming request: ask
        when ``holder_failures`` grew)."""
        if self.streamer is None:
            return ()
        replicas = self.streamer.stats().replicas.values()
        return tuple(sorted({r.holder for held in replicas for r in held if not r.live}))

    def flush_mark(self) -> dict[int, int]:
        """Hands every held tail over (``flush``) and returns each stream's saved length, by
        stream key: the mark ``lag_behind`` measures a drain's flush against, so tokens saved
        after it (the engine decodes on) do not keep the flush waiting."""
        self.flush()
        return dict(self.streamer.stats().saved) if self.streamer is not None else {}

    def lag_behind(self, mark: dict[int, int]) -> int:
        """Tokens of ``mark`` (``flush_mark``) not yet durable on a live replica; a stream
        that ended since (finished, released, abandoned) counts none."""
        if self.streamer is None:
            return 0
        stats = self.streamer.stats()
        return sum(
            max(0, saved - stats.durable.get(key, 0)) for key, saved in mark.items() if key in stats.saved
        )

    def wait_for_save(self, request_id: str, *, timeout_s: float = _FINISH_TIMEOUT_S) -> None:
        """Hands ``request_id``'s held tail over, then returns once no pending gather reads its
        slots (so the engine may free or rewrite them); TimeoutError after ``timeout_s``."""
        state = self._streaming.get(request_id)
        if state is not None and self.streamer is not None:
            self.flush([request_id])
            self.streamer.wait_for_save(state.key, timeout_s=timeout_s)

    def preempt(self, request_id: str) -> None:
        """The engine preempts ``request_id`` and may rewrite its blocks: pending gathers of
        them finish first. Its checkpoint is kept (a re-admitted request may restore from
        it, and its later saves continue it). Counted (``preempted``) if it streams."""
        if request_id in self._streaming:
            self.counters["preempted"] += 1
        self.wait_for_save(request_id)

    def finish(
        self, request_id: str, *, timeout_s: float = _FINISH_TIMEOUT_S, release: bool | None = None
    ) -> bool:
        """``request_id`` finished (or the gateway released it): once its last gather is done
        it is forgotten, and its checkpoint released on its holders if ``release`` (None:
        ``release_finished``; True where the gateway said so). False when the gather is still
        pending after ``timeout_s`` (call again; the slots must not be reused yet); True
        otherwise, also for a request that never streamed."""
        if self._lookup is not None:
            self._lookup.forget(request_id)
        state = self._streaming.get(request_id)
        if state is None:
            return True
        assert self.streamer is not None
        try:
            self.wait_for_save(request_id, timeout_s=timeout_s)
        except TimeoutError:
            return False
        if self.release_finished if release is None else release:
            self.streamer.release(state.key)
        else:
            self.streamer.forget(state.key)
        del self._streaming[request_id]
        self.counters["released"] += 1
        return True

    def abandon(self) -> int:
        """Stop streaming every request without releasing its checkpoints: the worker was
        fenced, and what its holders keep is the gateway's to restore from (a release would
        drop it). The streamer is closed (gathers in flight finish, steps not sent are
        dropped, so no slot is read afterwards); the next request that begins starts a new
        one. ``finish`` of an abandoned request then releases nothing. Returns the number of
        requests abandoned."""
        num_abandoned = len(self._streaming)
        if self.streamer is not None:
            self.streamer.close()
            self.streamer = None
        self._streaming.clear()
        self._ready.clear()
        self.counters["abandoned"] += num_abandoned
        return num_abandoned

    # ---- restore ----------------------------------------------------------------------------
    def _planner(self) -> RestoreLookup:
        if self._lookup is None:
            self._lookup = RestoreLookup(
                self.secret,
                record_bytes=self.layout.record_bytes,
                store=self.store,
                shard=self.shard,
                tls=self.tls,
                connect_timeout_s=self.connect_timeout_s,
                identity=self.identity,
                encrypt=self.encrypt,
                cpus=self.cpus,
            )
        return self._lookup

    def plan_restore(
        self, request_id: str, key: int, source: RestoreSource, *, wait_s: float = 0.0
    ) -> int | None:
        """Durable tokens of ``request_id``'s checkpoint at ``source`` (at most what a restore
        can load), or None while not known yet: the first call starts an asynchronous lookup
        and returns at once unless ``wait_s`` > 0 (an engine that plans synchronously waits that
        long). The answer is cached until ``restore`` or ``finish``."""
        check_int("key", key, 0, U64_MAX)
        wait_s = check_number("wait_s", wait_s, 0.0)
        planner = self._planner()
        answer = planner.plan(request_id, key, source)
        if answer is None and wait_s > 0:
            answer = planner.wait(request_id, wait_s)
        return answer

    def restore(
        self,
        request_id: str,
        key: int,
        source: RestoreSource,
        slot_ids: Sequence[int],
        token_ids: Sequence[int],
    ) -> RestoreOutcome:
        """Writes the verified prefix of ``request_id``'s checkpoint (wire key ``key``) at
        ``source`` into ``slot_ids`` (its new slots, one per position from 0; ``token_ids`` its
        first ``len(slot_ids)`` known tokens). Layout and model fingerprints, token ids and
        crc32c are checked before a record is written, so no slot past the verified prefix
        is touched. A streaming request's verified prefix is saved again (at the epoch it was
        begun with), so a second failure also resumes.

        Raises ValueError when ``slot_ids`` and ``token_ids`` differ in length (and what
        ``KVLayout`` raises for slots outside the cache); a source that cannot serve the
        checkpoint is not an error: nothing is restored and every block is reported failed.
        """
        slots, tokens = self._restore_args(request_id, key, source, slot_ids, token_ids)
        timed = _timed_restore(self._reader, key, source, self.layout, slots, tokens, self.model_fingerprint)
        return self._book(request_id, *timed, slots, tokens)

    def start_restore(
        self,
        request_id: str,
        key: int,
        source: RestoreSource,
        slot_ids: Sequence[int],
        token_ids: Sequence[int],
    ) -> None:
        """``restore`` on the core's restore thread, so the engine steps on while the records
        arrive: the engine must leave ``slot_ids`` alone until ``finished_restores`` hands the
        outcome back (it is booked then, on the caller's thread). Restores run one at a time,
        in the order started. Raises as ``restore`` does, before anything starts."""
        slots, tokens = self._restore_args(request_id, key, source, slot_ids, token_ids)
        layout = self.layout
        if self._restorer is None:
            self._restorer = ThreadPoolExecutor(
                max_workers=1,
                thread_name_prefix="lumen-restore",
                initializer=setup_thread,
                initargs=(self.restore_nice, self.cpus),
            )
            self._restorer_reader = self._source_reader()
        reader = self._restorer_reader
        assert reader is not None
        future = self._restorer.submit(
            _timed_restore, reader, key, source, layout, slots, tokens, self.model_fingerprint
        )
        self._started.append((request_id, slots, tokens, future))

    def finished_restores(self) -> list[tuple[str, RestoreOutcome]]:
        """The restores ``start_restore`` began that have ended since the last call, in the
        order they were started, with their request ids (booked as ``restore`` books them).
        Never waits."""
        done = []
        while self._started and self._started[0][3].done():
            request_id, slots, tokens, future = self._started.popleft()
            done.append((request_id, self._book(request_id, *future.result(), slots, tokens)))
        return done

    def _restore_args(
        self,
        request_id: str,
        key: int,
        source: RestoreSource,
        slot_ids: Sequence[int],
        token_ids: Sequence[int],
    ) -> tuple[list[int], list[int]]:
        check_str("request_id", request_id)
        check_int("key", key, 0, U64_MAX)
        if not isinstance(source, RestoreSource):
            raise TypeError(f"`source` must be a RestoreSource, got {type(source).__name__}")
        slots, tokens = [int(s) for s in slot_ids], [int(t) for t in token_ids]
        if len(slots) != len(tokens):
            raise ValueError(
                f"`slot_ids` and `token_ids` must have one entry per token, got {len(slots)} and "
                f"{len(tokens)}"
            )
        if self._lookup is not None:
            self._lookup.forget(request_id)
        return slots, tokens

    def _book(
        self, request_id: str, result: RestoreResult, seconds: float, slots: list[int], tokens: list[int]
    ) -> RestoreOutcome:
        """A restore's result in ``restores`` and the counters (``restore_us``: the restores'
        own time, reads, checks and writes, summed); its verified prefix streamed again if the
        request streams; the blocks the engine must recompute."""
        self.restores.pop(request_id, None)  # re-inserted as the latest: the oldest go first
        self.restores[request_id] = result
        while len(self.restores) > _KEPT_RESTORES:
            self.restores.pop(next(iter(self.restores)))
        restored = result.restored_tokens
        self.counters["restores"] += 1
        self.counters["restored_tokens"] += restored
        self.counters["restore_us"] += round(seconds * 1e6)
        if restored < len(slots):
            self.counters[f"restore_{result.status.name.lower()}"] += 1
        if restored:
            self.save_step([StepTokens(request_id, 0, slots[:restored], tokens[:restored])])
        block_size = self.layout.block_size
        return RestoreOutcome(result, frozenset(s // block_size for s in slots[restored:]))

    def close(self) -> None:
        """Stops lookups, closes connections and the streamer (pending sends are dropped)."""
        if self._lookup is not None:
            self._lookup.close()
        if self._restorer is not None:  # the restore under way ends (bounded by its timeouts)
            self._restorer.shutdown(wait=True, cancel_futures=True)
            assert self._restorer_reader is not None
            self._restorer_reader.close()
        self._started.clear()
        self._reader.close()
        if self.streamer is not None:
            self.streamer.close()


def _timed_restore(reader: SourceReader, *args: Any) -> tuple[RestoreResult, float]:
    """``reader.restore(*args)`` and the seconds it took."""
    started = time.perf_counter()
    result = reader.restore(*args)
    return result, time.perf_counter() - started
