"""The worker side of LumenConnector: vLLM's per-step metadata mapped onto the engine-neutral
``ConnectorCore`` (verified restores on the core's restore thread, through vLLM's asynchronous
load path; one ``save_step`` after each forward)."""

from __future__ import annotations

import logging
import time
from collections import Counter, deque
from collections.abc import Sequence

from lumen_core.connector import ConnectorCore, StepTokens, StreamGrant
from lumen_core.integrations.vllm.metadata import LumenMetadata
from lumen_core.integrations.vllm.params import ConnectorConfig
from lumen_core.integrations.vllm.stats import DURABLE_LAG, FLUSH_LAG, FLUSH_MARK
from lumen_core.layouts import KVLayout
from lumen_core.stream import CheckpointStreamer, RestoreResult

__all__ = ["WorkerSide"]

logger = logging.getLogger(__name__)

# How long get_finished waits for a finished request's last gather: a poll, never a stall.
_FINISHED_POLL_S = 1e-4
# How often the durable lag is sampled for the stats (it walks every streaming request).
_LAG_SAMPLE_S = 1.0


class WorkerSide:
    """State the worker process keeps (see LumenConnector): the core, keyed by LUMEN request
    id, and which vLLM request is which. ``counters`` and ``restores`` are the core's."""

    def __init__(self, config: ConnectorConfig, model_fingerprint: str, shard: int) -> None:
        self.config = config
        self.identity = config.identity()
        self.core = ConnectorCore(
            config.secret,
            model_fingerprint,
            shard=shard,
            tls=config.tls,
            connect_timeout_s=config.connect_timeout_s,
            encrypt=config.encrypt,
            identity=self.identity,
            # Under a ``lumen agent`` its gateway releases a finished request's checkpoints
            # once it learns the end: a server cut off from it keeps them for the failover.
            release_finished=config.control_socket is None,
            restore_nice=config.restore_nice,
            hold_lines=config.hold_lines,
            cpus=config.cpus,
            streamer_options={
                name: value
                for name, value in (
                    ("staging_bytes", config.staging_bytes),
                    ("staging_buffers", config.staging_buffers),
                )
                if value is not None  # the streamer's own default
            },
        )
        self._request_ids: dict[str, str] = {}  # vLLM req_id -> LUMEN request id, while streaming
        self._finishing: set[str] = set()
        self._load_errors: set[int] = set()
        self._loading: dict[str, deque[str]] = {}  # LUMEN id -> vLLM req_ids restoring, in start order
        self._reported: Counter[str] = Counter()
        self._lag_sampled_at = 0.0
        self._holder_failures = 0  # the streamer's counts when last logged
        self._lost_replicas = 0
        self._flush_mark: tuple[int, dict[int, int]] | None = None  # (number, ConnectorCore.flush_mark)
        self._released: set[str] = set()  # vLLM req_ids the control channel released: not saved
        self._finished_in_vllm: set[str] = set()  # finished by vLLM, not reported done yet

    @property
    def counters(self) -> Counter[str]:
        """Totals: restores, restored tokens, restores that stopped early by reason
        (``restore_<status>``), tokens saved, requests released, abandoned and preempted, saves
        skipped for a gap."""
        return self.core.counters

    @property
    def restores(self) -> dict[str, RestoreResult]:
        """The last restore result of each of the latest requests restored here (LUMEN ids)."""
        return self.core.restores

    @property
    def layout(self) -> KVLayout:
        return self.core.layout

    @property
    def streamer(self) -> CheckpointStreamer | None:
        return self.core.streamer

    def register(self, layout: KVLayout) -> None:
        # Every request vLLM serves here streams (its holders come with it): the streamer is
        # built with the cache, before the first request's step.
        self.core.register(layout, start_streamer=True)

    # ---- start_load_kv, before the step's saves -------------------------------------------
    def start_step(self, meta: LumenMetadata) -> None:
        """Abandons every streaming request if told to (control ``abandon``), starts this
        step's restores (vLLM leaves their blocks alone until ``finished_loads`` names them),
        then opens its new requests.

        A restored request is opened in the step vLLM first schedules it, after its load: its
        first save starts at 0, so the restored prefix reaches the streamer with the token the
        forward recomputes, in one ``save_step``. The streamer opens the holder's checkpoint
        with that save in hand and skips what the holder already holds durably. That matters
        when the checkpoint is a token ahead of what the client saw (the dead engine saved the
        KV of its last emitted token): the token recomputed here may differ from the saved
        record in its last bits, and a holder refuses a differing overlap as a conflict, which
        loses the replica for the rest of the request."""
        if meta.credential is not None and self.identity is not None:  # before any connection it opens
            grant = meta.credential
            self.identity.accept(grant.credential, grant.issuer_public_key, grant.worker_id)
        if meta.abandon:  # before this step's opens: a request opened now streams as usual
            self.core.abandon()
        for load in meta.loads:
            self.core.start_restore(load.request_id, load.key, load.restore, load.slot_ids, load.token_ids)
            self._loading.setdefault(load.request_id, deque()).append(load.req_id)
        for spec in meta.opens:
            if self.core.is_streaming(spec.request_id):  # two live requests named alike
                logger.error("lumen: request %s is already streaming: %s is not checkpointed",
                             spec.request_id, spec.req_id)  # fmt: skip
                continue
            grant = StreamGrant(spec.epoch, spec.holders, spec.capabilities, spec.expected_tokens)
            if self.core.begin(spec.request_id, spec.key, grant):
                self._request_ids[spec.req_id] = spec.request_id
        for renewal in meta.renewals:
            self.core.renew(renewal.request_id, renewal.capabilities)
        self._release(meta.releases)

    def _release(self, request_ids: list[str]) -> None:
        """Stop checkpointing these LUMEN requests (the gateway's word, over the control
        channel): no more saves; their checkpoints are released once their pending gathers
        are done (``finished`` polls), while vLLM goes on serving them."""
        wanted = set(request_ids)
        for req_id, request_id in self._request_ids.items():
            if request_id in wanted and req_id not in self._released:
                self._released.add(req_id)
                self._finishing.add(req_id)

    def finished_loads(self) -> set[str]:
        """The vLLM requests whose restores ended since the last call; the blocks a restore
        could not fill (a record failed verification, the source went away) are among the
        next ``load_errors``, which vLLM asks for after this in the same step, so it recomputes
        them: never a corrupt block served, never a request failed for a bad checkpoint."""
        done: set[str] = set()
        for request_id, outcome in self.core.finished_restores():
            waiting = self._loading[request_id]
            req_id = waiting.popleft()
            if not waiting:
                del self._loading[request_id]
            done.add(req_id)
            if outcome.failed_block_ids:
                self._load_errors |= outcome.failed_block_ids
                result = outcome.result
                logger.warning(
                    "lumen: restored %d of %d tokens of %s (%s): recomputing the rest",
                    result.restored_tokens, result.restored_tokens + result.reprefill_tokens, req_id,
                    result.status.name,
                )  # fmt: skip
        return done

    def wait_for_preempted(self, meta: LumenMetadata) -> None:
        """A preempted request's blocks may be rewritten this step: its pending gathers finish
        first (rare, and bounded by the streamer's queue). Its checkpoint is kept."""
        for req_id in meta.preempted_req_ids:
            request_id = self._request_ids.get(req_id)
            if request_id is not None:
                self.core.preempt(request_id)

    # ---- wait_for_save and get_finished ----------------------------------------------------
    def save_step(self, meta: LumenMetadata) -> None:
        """One ``save_step`` for every request's tokens computed this step (a restored
        request's first save starts at 0, its restored prefix with it); enqueues only, never
        waits for the gather or the holders. The first step of each control ``flush`` hands
        over the tails the core holds back to whole cache lines (``ConnectorCore.save_step``)
        and marks what is saved by then: the stats report how much of the mark is not durable
        yet. Later tokens are held as usual (the flush does not wait for them)."""
        steps = []
        for save in meta.saves:
            request_id = self._request_ids.get(save.req_id)
            if request_id is None or save.req_id in self._released:
                continue
            steps.append(StepTokens(request_id, save.start, save.slot_ids, save.token_ids))
        self.core.save_step(steps)
        if not meta.flush_mark:
            self._flush_mark = None
        elif self._flush_mark is None or self._flush_mark[0] != meta.flush_mark:
            self._flush_mark = (meta.flush_mark, self.core.flush_mark())

    def load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors

    def finished(self, finished_req_ids: Sequence[str] | set[str]) -> set[str]:
        """Finished requests whose gathers are done: released on their holders, their blocks
        free to reuse (vLLM frees them when they are reported here)."""
        finished = {r for r in finished_req_ids if r in self._request_ids}
        self._finishing |= finished
        self._finished_in_vllm |= finished
        done: set[str] = set()
        for req_id in list(self._finishing):
            # Released over the control channel: the gateway's word, so off its holders too.
            release = True if req_id in self._released else None
            if self.core.finish(self._request_ids[req_id], timeout_s=_FINISHED_POLL_S, release=release):
                self._finishing.discard(req_id)
                if req_id not in self._finished_in_vllm:
                    continue  # released while vLLM still runs it: reported when it finishes
                self._finished_in_vllm.discard(req_id)
                self._released.discard(req_id)
                del self._request_ids[req_id]
                done.add(req_id)
        return done

    def interval_stats(self) -> dict[str, int]:
        """The counters' growth since the last call, with ``saved_bytes``, about once a second
        ``durable_lag_tokens`` (saved but not yet durable, all requests), and while a control
        ``flush`` waits, its mark's number and how much of it is not durable yet."""
        counters = self.core.counters
        delta = {name: value - self._reported[name] for name, value in counters.items()}
        delta = {name: value for name, value in delta.items() if value}
        self._reported = Counter(counters)
        if "saved_tokens" in delta:
            delta["saved_bytes"] = delta["saved_tokens"] * self.core.layout.record_bytes
        now = time.monotonic()
        if self.core.streamer is not None and now - self._lag_sampled_at >= _LAG_SAMPLE_S:
            self._lag_sampled_at = now
            delta[DURABLE_LAG] = self.core.durable_lag_tokens()
            self._log_holder_trouble()
        if self._flush_mark is not None:
            number, mark = self._flush_mark
            delta[FLUSH_MARK], delta[FLUSH_LAG] = number, self.core.lag_behind(mark)
        return delta

    def _log_holder_trouble(self) -> None:
        """Warns of lost replicas and holder failures since the last sample: otherwise both
        show only as a growing lag. (A streamer started anew, after ``abandon``, counts from 0.)"""
        counters = self.core.streamer_counters()
        lost = counters.get("replicas_lost", 0)
        if lost > self._lost_replicas:
            logger.warning(
                "lumen: %d checkpoint replica(s) lost since the last report: a holder refused or "
                "dropped them (over its budget, a capability it does not take, this worker fenced) "
                "or was given up on; those requests checkpoint on their other holders or not at all",
                lost - self._lost_replicas,
            )
        self._lost_replicas = lost
        failures = counters.get("holder_failures", 0)
        if failures > self._holder_failures:
            down = self.core.unreachable_holders()
            logger.warning(
                "lumen: %d holder failure(s) since the last report; not reachable now: %s. "
                "Checkpoints there wait for a reconnect (check the holders' addresses and `tls`)",
                failures - self._holder_failures,
                ", ".join(f"{host}:{port}" for host, port in down) or "none",
            )
        self._holder_failures = failures

    def durable_tokens(self) -> dict[str, int]:
        """Durable length (best live replica) of each request streaming from here, by LUMEN id."""
        return self.core.durable_tokens()

    def close(self) -> None:
        self.core.close()
