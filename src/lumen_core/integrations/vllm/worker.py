"""The worker side of LumenConnector: the cache's layout, the streamer, verified restores
before the forward and one ``save_step`` after it."""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Sequence

import torch

from lumen_core.integrations.vllm.metadata import LoadSpec, LumenMetadata
from lumen_core.integrations.vllm.params import ConnectorConfig
from lumen_core.layouts import KVLayout
from lumen_core.stream import CheckpointStreamer, RestoreResult, RestoreStatus, remote_restore
from lumen_core.transport import Client, ClientPool, TransportError

__all__ = ["WorkerSide"]

logger = logging.getLogger(__name__)

# How long get_finished waits for a finished request's last gather: a poll, never a stall.
_FINISHED_POLL_S = 1e-4
# How often the durable lag is sampled for the stats (it walks every streaming request).
_LAG_SAMPLE_S = 1.0
# Restore results kept for inspection (tests, stats), oldest dropped first.
_KEPT_RESTORES = 1024


class WorkerSide:
    """State the worker process keeps (see LumenConnector). ``counters``: restores started,
    tokens restored, restores that stopped early by reason (``restore_<status>``), tokens
    saved, requests released, saves skipped for a gap. ``restores``: the last restore result of
    each of the latest requests restored here."""

    def __init__(self, config: ConnectorConfig, model_fingerprint: str, shard: int) -> None:
        self.config = config
        self.model_fingerprint = model_fingerprint
        self.shard = shard
        self.layout: KVLayout | None = None
        self.streamer: CheckpointStreamer | None = None
        self.counters: Counter[str] = Counter()
        self.restores: dict[str, RestoreResult] = {}
        self._keys: dict[str, int] = {}  # streaming requests
        self._saved_tokens: dict[str, int] = {}  # positions [0, n) handed to the streamer
        self._finishing: set[str] = set()
        self._load_errors: set[int] = set()
        self._restored_this_step: dict[str, int] = {}
        self._failed_this_step: set[str] = set()
        self._reported: Counter[str] = Counter()
        self._lag_sampled_at = 0.0
        # Restores run on the worker's thread (start_step), the pool's only user.
        self._pool = ClientPool(config.secret, tls=config.tls, connect_timeout_s=config.connect_timeout_s)

    def register(self, layout: KVLayout) -> None:
        self.layout = layout
        self.streamer = CheckpointStreamer(
            layout,
            self.config.secret,
            model_fingerprint=self.model_fingerprint,
            shard=self.shard,
            tls=self.config.tls,
        )

    # ---- before the forward ----------------------------------------------------------------
    def start_step(self, meta: LumenMetadata) -> None:
        """Opens this step's new requests and runs its restores (synchronously: the forward
        reads what they write)."""
        assert self.streamer is not None
        for spec in meta.opens:
            self.streamer.add_request(
                spec.key,
                list(spec.holders),
                list(spec.capabilities),
                epoch=spec.epoch,
                expected_tokens=spec.expected_tokens,
            )
            self._keys[spec.req_id] = spec.key
            self._saved_tokens[spec.req_id] = 0
        self._restored_this_step.clear()
        self._failed_this_step.clear()
        for load in meta.loads:
            self._load(load)

    def _restore(self, load: LoadSpec) -> RestoreResult:
        assert self.layout is not None
        layout = self.layout
        address = load.restore.address

        def restore(client: Client) -> RestoreResult:
            return remote_restore(
                client, load.key, layout, torch.tensor(load.slot_ids, dtype=torch.int64),
                token_ids=load.token_ids, model_fingerprint=self.model_fingerprint,
                capability=load.restore.capability, shard=self.shard, epoch=load.restore.epoch,
            )  # fmt: skip

        try:
            return self._pool.call(address, restore)
        except TransportError as error:  # unreachable, or the holder died mid-read: recompute
            logger.warning("lumen: restore from %s failed (%s): recomputing", address, error)
            return RestoreResult(RestoreStatus.MISSING, 0, len(load.slot_ids), 0)

    def _load(self, load: LoadSpec) -> None:
        assert self.layout is not None
        result = self._restore(load)
        self.restores[load.request_id] = result
        while len(self.restores) > _KEPT_RESTORES:
            self.restores.pop(next(iter(self.restores)))
        restored = result.restored_tokens
        self.counters["restores"] += 1
        self.counters["restored_tokens"] += restored
        if restored < len(load.slot_ids):
            # vLLM recomputes from the first block that failed; never a corrupt block served.
            self.counters[f"restore_{result.status.name.lower()}"] += 1
            block_size = self.layout.block_size
            self._load_errors.update(s // block_size for s in load.slot_ids[restored:])
            logger.warning(
                "lumen: restored %d of %d tokens of %s (%s): recomputing the rest",
                restored, len(load.slot_ids), load.req_id, result.status.name,
            )  # fmt: skip
        self._restored_this_step[load.req_id] = restored
        if restored < len(load.slot_ids):
            self._failed_this_step.add(load.req_id)

    def wait_for_preempted(self, meta: LumenMetadata) -> None:
        """A preempted request's blocks may be rewritten this step: its pending gathers finish
        first (rare, and bounded by the streamer's queue)."""
        if self.streamer is not None:
            for key in meta.preempted_keys:
                self.streamer.wait_for_save(key)

    # ---- after the forward -----------------------------------------------------------------
    def save_step(self, meta: LumenMetadata) -> None:
        """One ``save_step`` for every request's tokens computed (or restored) this step;
        enqueues only, never waits for the gather or the holders."""
        if self.streamer is None:
            return
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        tokens: list[int] = []
        for save in meta.saves:
            saved = self._saved_tokens.get(save.req_id)
            if saved is None:
                continue
            end = save.start + len(save.slot_ids)
            restored = self._restored_this_step.get(save.req_id)
            load_failed = restored is not None and save.req_id in self._failed_this_step
            if load_failed:
                # This step's forward read blocks that failed to load: only the verified
                # prefix is saved; vLLM recomputes the rest in later steps.
                end = min(end, restored)
            if save.start > saved:
                self.counters["save_gaps"] += 1
                continue
            first = saved - save.start
            if end <= saved:
                continue
            n = end - saved
            ids += [save.key] * n
            positions += range(saved, end)
            slots += save.slot_ids[first : first + n]
            tokens += save.token_ids[first : first + n]
            self._saved_tokens[save.req_id] = end
        if ids:
            self.streamer.save_step(ids, positions, slots, tokens)
            self.counters["saved_tokens"] += len(ids)

    def load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors

    def finished(self, finished_req_ids: Sequence[str] | set[str]) -> set[str]:
        """Finished requests whose gathers are done: released on their holders, their blocks
        free to reuse (vLLM frees them when they are reported here)."""
        self._finishing.update(r for r in finished_req_ids if r in self._keys)
        done: set[str] = set()
        if self.streamer is None:
            return done
        for req_id in list(self._finishing):
            key = self._keys[req_id]
            try:
                self.streamer.wait_for_save(key, timeout_s=_FINISHED_POLL_S)
            except TimeoutError:
                continue
            self.streamer.release(key)
            self.counters["released"] += 1
            self._finishing.discard(req_id)
            del self._keys[req_id]
            self._saved_tokens.pop(req_id, None)
            done.add(req_id)
        return done

    def interval_stats(self) -> dict[str, int]:
        """The counters' growth since the last call, with ``saved_bytes``, and about once a
        second ``durable_lag_tokens`` (saved but not yet durable, all requests)."""
        delta = {name: value - self._reported[name] for name, value in self.counters.items()}
        delta = {name: value for name, value in delta.items() if value}
        self._reported = Counter(self.counters)
        if self.layout is not None and "saved_tokens" in delta:
            delta["saved_bytes"] = delta["saved_tokens"] * self.layout.record_bytes
        now = time.monotonic()
        if self.streamer is not None and now - self._lag_sampled_at >= _LAG_SAMPLE_S:
            self._lag_sampled_at = now
            stats = self.streamer.stats()
            delta["durable_lag_tokens"] = sum(
                max(0, saved - stats.durable.get(key, 0)) for key, saved in stats.saved.items()
            )
        return delta

    def durable_tokens(self) -> dict[str, int]:
        """Durable length (best live replica) of each request streaming from here."""
        if self.streamer is None:
            return {}
        durable = self.streamer.stats().durable
        return {r: durable.get(key, 0) for r, key in self._keys.items()}

    def close(self) -> None:
        self._pool.close()
        if self.streamer is not None:
            self.streamer.close()
