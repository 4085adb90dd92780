"""Discrete-event simulator of a serving cluster with failures, driving the policy objects.

Workers run continuous batching with chunked prefill: each iteration takes every decoding
request (one token each, or a verify step of ``k + 1`` tokens when a recovering worker
assists) plus prefill chunks up to a token budget, and is priced by the roofline cost model.
Decode is advanced per iteration, never per token: each worker keeps a progress counter, a
decoding request finishes when the counter passes the value stored in a heap at its start.

Checkpoint streaming is a FIFO per serving worker at ``CostModel.stream_bytes_per_s``: the
KV each iteration produces (prefill chunks and decode tokens of checkpointed requests) is
queued, and a request's durable prefix is its context as of the last iteration whose bytes
have all left. At a failure a checkpoint covers only that prefix.

The gateway side (join-shortest-queue admission, failure detection after ``detect_s``,
routing, placement, assist pairing and switch-over) is ``policy.driver.RecoveryDriver``, the
live gateway's driver too; the simulator keeps time, cost and streaming, and turns the
driver's plans into restores and re-prefills. Every event, call and decision can be written
to an event log.

A rolling upgrade (``RollingUpgrade``, issue 22) drains the workers one after another, each
restarted (``reload_time_s``) before the next is drained, by one of three strategies:
``graceful`` (admit nothing more, let it finish what it runs), ``abort`` (move its requests at
once without their checkpoints: re-prefilled) and ``move`` (LUMEN: its streamer flushed,
every computed token is durable, and each request is moved where the router decides, the
driver's ``drain`` and ``move`` as the gateway's).
"""

from __future__ import annotations

import heapq
import math
import sys
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from lumen_core.cost import CostConfig, CostModel
from lumen_core.metrics import RequestRecords, checkpoint_coverage, holder_balance_ratio
from lumen_core.policy.assist import AssistConfig, GainFn, SpecAssistPlanner, expected_tokens_per_step
from lumen_core.policy.driver import Recorder, RecoveryDriver, Reroute
from lumen_core.policy.events import (
    AssistDecision,
    CheckpointGrew,
    Heartbeat,
    PlacementDecision,
    RecoveryAction,
    WorkerFailed,
    WorkerJoined,
    WorkerState,
)
from lumen_core.policy.load import LoadConfig, LoadMonitor
from lumen_core.policy.placement import FixedNeighbour, LoadAware, PlacementConfig
from lumen_core.policy.presets import PolicyFactory, PolicySet
from lumen_core.policy.routing import AllToHolder, LocalityAware, RouterConfig
from lumen_core.sim.workload import Workload

# Request phases.
_WAITING, _PREFILL, _DECODE, _MOVING, _LOST, _DONE = range(6)
# Event kinds (heap entries: time, tie-break sequence, kind, a, b).
(
    _ITER_END,
    _FAIL,
    _DETECT,
    _ARRIVE_AT,
    _DRAFT_READY,
    _MODEL_READY,
    _HEARTBEAT,
    _DRAIN,
    _MOVE_OUT,
    _REJOIN,
) = range(10)
UPGRADE_STRATEGIES = ("graceful", "abort", "move")


@dataclass(frozen=True)
class ClusterConfig:
    """The simulated cluster. Defaults: docs/simulator.md (Qwen3-32B on 2x H100 per worker).

    ``max_batched_tokens``: chunked-prefill token budget per iteration (vLLM's V1 default for
    large GPUs). ``holder_budget_bytes``: host DRAM each worker offers for other workers'
    checkpoints. ``heartbeat_s``: heartbeat period (load aggregates and checkpoint growth reach
    the monitor at this rate). ``detect_s``: lease expiry, failure to detection.
    ``reload_s`` / ``draft_load_s``: from detection to full model / draft model loaded (None:
    the cost model's weights-over-storage figure). ``acceptance``: steady draft acceptance
    rate; it ramps linearly from ``acceptance_start`` over the first ``acceptance_ramp_steps``
    verify steps of a pairing (the assistant's draft KV warms up). ``rack_size``: workers per
    failure domain (0: every worker is its own). ``report_min_tokens``: checkpoint growth is
    reported at a heartbeat once it reaches this many tokens. ``alpha`` / ``beta``: weights of
    held checkpoint KV and queue depth in ``L(w)`` (``policy.LoadConfig``).
    """

    num_workers: int = 4
    model: str = "Qwen3-32B"
    gpu: str = "H100"
    tp: int = 2
    draft_model: str | None = None
    cost: CostConfig = CostConfig()
    max_batched_tokens: int = 8192
    max_num_seqs: int = 256
    holder_budget_bytes: int = 128 * 10**9
    heartbeat_s: float = 1.0
    detect_s: float = 1.0
    reload_s: float | None = None
    draft_load_s: float | None = None
    acceptance: float = 0.7
    acceptance_start: float = 0.4
    acceptance_ramp_steps: int = 50
    rack_size: int = 0
    report_min_tokens: int = 64
    alpha: float = 1.0
    beta: float = 1.0

    def __post_init__(self) -> None:
        for name in ("num_workers", "tp", "max_batched_tokens", "max_num_seqs"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool):
                raise TypeError(f"`{name}` must be int, got {type(value).__name__}")
            if value < 1:
                raise ValueError(f"`{name}` must be >= 1, got {value}")
        for name in ("heartbeat_s", "detect_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"`{name}` must be > 0, got {getattr(self, name)}")
        for name in ("reload_s", "draft_load_s"):
            value = getattr(self, name)
            if value is not None and value < 0:
                raise ValueError(f"`{name}` must be >= 0 or None, got {value}")
        for name in ("acceptance", "acceptance_start"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ValueError(f"`{name}` must be in [0, 1], got {getattr(self, name)}")
        for name in ("holder_budget_bytes", "rack_size", "acceptance_ramp_steps", "report_min_tokens"):
            if getattr(self, name) < 0:
                raise ValueError(f"`{name}` must be >= 0, got {getattr(self, name)}")

    def cost_model(self) -> CostModel:
        return CostModel(self.model, self.gpu, self.tp, self.draft_model, self.cost)

    @property
    def reload_time_s(self) -> float:
        """From detection to full model loaded (``reload_s``, else the cost model's figure)."""
        return self.cost_model().model_load_time_s if self.reload_s is None else self.reload_s

    def domain_of(self, worker_id: int) -> str:
        return f"rack{worker_id // self.rack_size}" if self.rack_size else ""


@dataclass(frozen=True)
class Failure:
    """Workers that die together at ``time_s`` (a holder with its serving worker, a rack...)."""

    time_s: float
    worker_ids: tuple[int, ...]

    def __post_init__(self) -> None:
        if self.time_s < 0:
            raise ValueError(f"`time_s` must be >= 0, got {self.time_s}")
        if not self.worker_ids:
            raise ValueError("`worker_ids` must name at least one worker, got ()")
        if len(set(self.worker_ids)) != len(self.worker_ids):
            raise ValueError(f"`worker_ids` must be distinct, got {self.worker_ids}")


def combination(
    name: str,
    *,
    load_aware_placement: bool,
    locality_routing: bool,
    speculative_assist: bool,
    placement_config: PlacementConfig = PlacementConfig(),
    router_config: RouterConfig = RouterConfig(),
    assist_config: AssistConfig = AssistConfig(),
) -> PolicyFactory:
    """LUMEN's mechanisms switched one by one on top of FC: load-aware placement (else the
    fixed neighbour), locality-aware routing (else all to the holder), speculative assist."""

    def build(gain_fn: GainFn) -> PolicySet:
        placement = LoadAware(placement_config) if load_aware_placement else FixedNeighbour(placement_config)
        router = LocalityAware(router_config) if locality_routing else AllToHolder()
        planner = SpecAssistPlanner(assist_config, gain_fn) if speculative_assist else None
        return PolicySet(name, placement, router, planner)

    return build


@dataclass(frozen=True)
class RollingUpgrade:
    """Drain ``worker_ids`` (default: every worker, in id order) one after another from
    ``start_s``, each restarted (the config's reload time) before the next is drained, by
    ``strategy``: one of ``UPGRADE_STRATEGIES`` (module doc)."""

    start_s: float
    strategy: str
    worker_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if not self.start_s >= 0:
            raise ValueError(f"`start_s` must be >= 0, got {self.start_s}")
        if self.strategy not in UPGRADE_STRATEGIES:
            raise ValueError(f"`strategy` must be one of {UPGRADE_STRATEGIES}, got {self.strategy!r}")


@dataclass(frozen=True)
class UpgradeStats:
    """Per drained worker, in drain order: (worker id, drain start, free time, rejoin
    time); ``reprefilled_tokens``: computed context tokens the moves recomputed elsewhere."""

    drains: tuple[tuple[int, float, float, float], ...]
    reprefilled_tokens: int
    num_moved: int


@dataclass
class SimResult:
    """What one run produced: per-request records and cluster-level counters."""

    records: RequestRecords
    failure_s: float
    end_s: float
    num_iterations: int
    num_interrupted: int
    actions: dict[str, int]
    restored_tokens: int
    reprefill_tokens: int
    coverage_at_failure: float
    holder_balance: float
    proposed_draft_tokens: float
    accepted_draft_tokens: float
    assist_pairs: list[tuple[int, int]] = field(default_factory=list)
    finish_counts: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    upgrade: UpgradeStats | None = None


class _Req:
    __slots__ = (
        "rid",
        "arrival",
        "prompt",
        "output",
        "worker",
        "phase",
        "gen",
        "target_ctx",
        "prefilled",
        "reserved",
        "base_progress",
        "gen_base",
        "first_s",
        "finish_s",
        "interrupted",
        "replay_s",
        "holders",
        "marks",
        "decode_seq",
        "stream_seq",
        "reported",
        "move",
        "durable_at_failure",
        "pending_stream",
    )

    def __init__(self, rid: int, arrival: float, prompt: int, output: int) -> None:
        self.rid = rid
        self.arrival = arrival
        self.prompt = prompt
        self.output = output
        self.worker = -1
        self.phase = _WAITING
        self.gen = 0
        self.target_ctx = prompt
        self.prefilled = 0
        self.reserved = 0
        self.base_progress = 0.0
        self.gen_base = 0
        self.first_s = math.nan
        self.finish_s = math.nan
        self.interrupted = False
        self.replay_s = math.nan
        self.holders: tuple[int, ...] = ()
        self.marks: list[tuple[int, int]] = []
        self.decode_seq = -1
        self.stream_seq = 0
        self.reported = 0
        self.move = 0
        self.durable_at_failure = 0
        self.pending_stream = 0


class _Worker:
    __slots__ = (
        "wid",
        "state",
        "epoch",
        "busy",
        "waiting",
        "prefill",
        "heap",
        "n_dec",
        "ctx_base",
        "progress",
        "ckpt",
        "kv_used",
        "num_moving",
        "produced",
        "sent",
        "sent_t",
        "history",
        "seq",
        "durable_seq",
        "durable_progress",
        "assistant",
        "assist_steps",
        "plan",
        "plan_dec",
        "plan_gain",
        "lost",
        "decoding",
        "ckpt_dec",
    )

    def __init__(self, wid: int) -> None:
        self.wid = wid
        self.state = WorkerState.SERVING
        self.epoch = 0
        self.busy = False
        self.waiting: deque[_Req] = deque()
        self.prefill: list[_Req] = []
        self.heap: list[tuple[float, int, _Req]] = []
        self.decoding: dict[int, _Req] = {}
        self.n_dec = 0
        self.ctx_base = 0.0  # sum over decoders of (prompt + gen_base - base_progress)
        self.progress = 0.0
        self.ckpt: dict[int, _Req] = {}  # checkpointed requests served here
        self.ckpt_dec = 0  # checkpoint copies of the decoding requests (bytes per decode token)
        self.kv_used = 0
        self.num_moving = 0
        self.produced = 0.0  # checkpoint bytes queued for the NIC since start
        self.sent = 0.0
        self.sent_t = 0.0
        self.history: deque[tuple[float, int, float]] = deque()  # (produced after, seq, progress)
        self.seq = 0
        self.durable_seq = 0
        self.durable_progress = 0.0
        self.assistant: int | None = None
        self.assist_steps = 0
        self.plan: list[tuple[_Req, int]] = []
        self.plan_dec = 0
        self.plan_gain = 1.0
        self.lost: list[_Req] = []

    @property
    def queue_len(self) -> int:
        return len(self.waiting) + len(self.prefill) + self.n_dec + self.num_moving


class ClusterSim:
    """One run: a workload, a cluster, failures and the policy objects.

    ``run()`` returns a ``SimResult``; it raises RuntimeError if a request is lost or
    finishes twice (conservation is checked, not assumed).
    """

    def __init__(
        self,
        config: ClusterConfig,
        workload: Workload,
        policy: PolicyFactory,
        failures: tuple[Failure, ...] = (),
        event_log: Recorder | None = None,
        progress: bool = False,
        upgrade: RollingUpgrade | None = None,
    ) -> None:
        if not isinstance(config, ClusterConfig):
            raise TypeError(f"`config` must be ClusterConfig, got {type(config).__name__}")
        if not isinstance(workload, Workload):
            raise TypeError(f"`workload` must be Workload, got {type(workload).__name__}")
        for failure in failures:
            bad = [w for w in failure.worker_ids if not 0 <= w < config.num_workers]
            if bad:
                raise IndexError(f"failure worker ids {bad} out of range [0, {config.num_workers})")
        self.config = config
        self.cost = config.cost_model()
        need = workload.prompt_tokens + workload.output_tokens
        if len(workload) and int(need.max()) > self.cost.kv_capacity_tokens:
            raise ValueError(
                "`workload` requests must fit one worker's KV cache "
                f"({self.cost.kv_capacity_tokens} tokens), got one of {int(need.max())} tokens"
            )
        self.workload = workload
        self.failures = tuple(sorted(failures, key=lambda f: f.time_s))
        if upgrade is not None and not isinstance(upgrade, RollingUpgrade):
            raise TypeError(f"`upgrade` must be a RollingUpgrade, got {type(upgrade).__name__}")
        self.upgrade = upgrade
        order = upgrade.worker_ids or tuple(range(config.num_workers)) if upgrade is not None else ()
        bad = [w for w in order if not 0 <= w < config.num_workers]
        if bad:
            raise IndexError(f"upgrade worker ids {bad} out of range [0, {config.num_workers})")
        self._upgrade_order = list(order)
        self._drains: list[list[float]] = []  # [worker id, drain start, free, rejoin]
        self._upgrade_reprefill = 0
        self._num_moved = 0
        self.show_progress = progress
        load_config = LoadConfig(
            alpha=config.alpha,
            beta=config.beta,
            mean_request_tokens=workload.mean_request_tokens if len(workload) else 1366.0,
            kv_bytes_per_token=self.cost.kv_bytes_per_token,
        )
        # Every worker failing at once parks their requests until one recovers (the gateway's
        # behaviour, issue 23); a simulated worker always recovers, so no bound is needed.
        self.driver = RecoveryDriver(
            policy,
            load_config,
            gain_fn=self._gain,
            recorder=event_log,
            park_s=math.inf,
            max_parked=len(workload),
        )
        self._parked: dict[int, _Req] = {}  # by request id: waiting for a worker to serve
        self._parked_arrivals: list[_Req] = []  # arrived while no worker served
        self.reload_s = config.reload_time_s
        self.draft_load_s = (
            self.cost.draft_load_time_s if config.draft_load_s is None else config.draft_load_s
        )
        self.workers = [_Worker(w) for w in range(config.num_workers)]
        self.reqs = [
            _Req(i, float(a), int(p), int(o))
            for i, (a, p, o) in enumerate(
                zip(
                    workload.arrival_s.tolist(),
                    workload.prompt_tokens.tolist(),
                    workload.output_tokens.tolist(),
                )
            )
        ]
        self._heap: list[tuple[float, int, int, Any, Any]] = []
        self._tie = 0
        self._now = 0.0
        self._num_done = 0
        self._num_iterations = 0
        self._finish_counts = np.zeros(len(self.reqs), dtype=np.int64)
        self._actions = {a.value: 0 for a in RecoveryAction}
        self._restored_tokens = 0
        self._reprefill_tokens = 0
        self._coverage: list[float] = []
        self._balance = math.nan
        self._proposed = 0.0
        self._accepted = 0.0
        self._pairs: list[tuple[int, int]] = []
        self._stream_bps = self.cost.stream_bytes_per_s
        self._kv_bytes = self.cost.kv_bytes_per_token

    # ---- driver ----------------------------------------------------------------------------
    def _push(self, time_s: float, kind: int, a: Any = None, b: Any = None) -> None:
        self._tie += 1
        heapq.heappush(self._heap, (time_s, self._tie, kind, a, b))

    def run(self) -> SimResult:
        config = self.config
        for worker in self.workers:
            self.driver.apply(
                WorkerJoined(0.0, worker.wid, config.holder_budget_bytes, config.domain_of(worker.wid))
            )
            self._push(config.heartbeat_s * (1.0 + worker.wid / config.num_workers), _HEARTBEAT, worker)
        for failure in self.failures:
            self._push(failure.time_s, _FAIL, failure)
        if self._upgrade_order:
            assert self.upgrade is not None
            self._push(self.upgrade.start_s, _DRAIN, self.workers[self._upgrade_order.pop(0)])
        arrivals = self.workload.arrival_s.tolist()
        num = len(arrivals)
        next_arrival = 0
        heap = self._heap
        end_hint = arrivals[-1] if num else 0.0
        next_report = 0.0
        # Each handler takes the (a, b) its event kind was pushed with.
        handlers: dict[int, Callable[[Any, Any], None]] = {
            _ITER_END: self._on_iter_end,
            _FAIL: self._on_fail,
            _DETECT: self._on_detect,
            _ARRIVE_AT: self._on_arrive_at,
            _DRAFT_READY: self._on_draft_ready,
            _MODEL_READY: self._on_model_ready,
            _HEARTBEAT: self._on_heartbeat,
            _DRAIN: self._on_drain,
            _MOVE_OUT: self._on_move_out,
            _REJOIN: self._on_rejoin,
        }
        while self._num_done < num:
            if next_arrival < num and (not heap or arrivals[next_arrival] <= heap[0][0]):
                self._now = arrivals[next_arrival]
                self._on_arrival(self.reqs[next_arrival])
                next_arrival += 1
                continue
            if not heap:
                raise RuntimeError(f"simulation stalled with {num - self._num_done} requests unfinished")
            time_s, _, kind, a, b = heapq.heappop(heap)
            self._now = time_s
            handlers[kind](a, b)
            if self.show_progress and time_s >= next_report:
                next_report = time_s + max(end_hint / 50.0, 1.0)
                _progress_bar(min(self._num_done / max(num, 1), 1.0), time_s)
        if self.show_progress:
            _progress_bar(1.0, self._now)
            sys.stderr.write("\n")
        if np.any(self._finish_counts != 1):
            raise RuntimeError("conservation violated: a request finished zero or several times")
        return self._result()

    def _result(self) -> SimResult:
        reqs = self.reqs
        records = RequestRecords(
            arrival_s=np.array([r.arrival for r in reqs], dtype=np.float64),
            first_token_s=np.array([r.first_s for r in reqs], dtype=np.float64),
            finish_s=np.array([r.finish_s for r in reqs], dtype=np.float64),
            num_output_tokens=np.array([r.output for r in reqs], dtype=np.int64),
            interrupted=np.array([r.interrupted for r in reqs], dtype=bool),
            replay_token_s=np.array([r.replay_s for r in reqs], dtype=np.float64),
        )
        return SimResult(
            records=records,
            failure_s=self.failures[0].time_s if self.failures else math.nan,
            end_s=self._now,
            num_iterations=self._num_iterations,
            num_interrupted=int(records.interrupted.sum()),
            actions=dict(self._actions),
            restored_tokens=self._restored_tokens,
            reprefill_tokens=self._reprefill_tokens,
            coverage_at_failure=self._coverage[0] if self._coverage else math.nan,
            holder_balance=self._balance,
            proposed_draft_tokens=self._proposed,
            accepted_draft_tokens=self._accepted,
            assist_pairs=list(self._pairs),
            finish_counts=self._finish_counts.copy(),
            upgrade=None
            if self.upgrade is None
            else UpgradeStats(
                tuple((int(d[0]), d[1], d[2], d[3]) for d in self._drains),
                self._upgrade_reprefill,
                self._num_moved,
            ),
        )

    # ---- arrivals and routing of new requests ------------------------------------------------
    def _on_arrival(self, req: _Req) -> None:
        # The simulator knows each queue exactly; a gateway knows the heartbeats' figures.
        worker_id = self.driver.choose_worker(lambda w: self.workers[w].queue_len)
        if worker_id is None:  # every worker failed: admitted when one serves again
            self._parked_arrivals.append(req)
            return
        worker = self.workers[worker_id]
        req.worker = worker_id
        plan = self.driver.admit(self._now, req.rid, worker_id, req.prompt, req.output)
        self._set_holders(req, plan.placement.holder_ids)
        if worker.state != WorkerState.SERVING:  # dead but not yet detected: the request is lost with it
            req.phase = _LOST
            req.interrupted = True
            worker.lost.append(req)
            return
        worker.waiting.append(req)
        self._kick(worker)

    def _set_holders(self, req: _Req, holder_ids: tuple[int, ...]) -> None:
        worker = self.workers[req.worker]
        if req.phase == _DECODE:
            worker.ckpt_dec += len(holder_ids) - len(req.holders)
        req.holders = tuple(holder_ids)
        if req.holders:
            worker.ckpt[req.rid] = req
        else:
            worker.ckpt.pop(req.rid, None)

    # ---- iterations ---------------------------------------------------------------------------
    def _kick(self, worker: _Worker) -> None:
        if not worker.busy and worker.state in (WorkerState.SERVING, WorkerState.DRAINING):
            self._start_iteration(worker)

    def _start_iteration(self, worker: _Worker) -> None:
        config = self.config
        capacity = self.cost.kv_capacity_tokens
        while worker.waiting and len(worker.prefill) + worker.n_dec < config.max_num_seqs:
            req = worker.waiting[0]
            need = req.target_ctx + req.output - req.gen
            if worker.kv_used + need > capacity:
                break
            worker.waiting.popleft()
            req.reserved = need
            worker.kv_used += need
            req.phase = _PREFILL
            worker.prefill.append(req)
        budget = config.max_batched_tokens - worker.n_dec
        plan: list[tuple[_Req, int]] = []
        num_prefill = 0
        attn = 0.0
        kv_read = 0.0
        for req in worker.prefill:
            if budget <= 0:
                break
            chunk = min(req.target_ctx - req.prefilled, budget)
            plan.append((req, chunk))
            budget -= chunk
            num_prefill += chunk
            attn += chunk * (req.prefilled + (chunk + 1) / 2.0)
            kv_read += req.prefilled
        n_dec = worker.n_dec
        if not plan and n_dec == 0:
            worker.busy = False
            if worker.state == WorkerState.DRAINING and not worker.queue_len:
                self._on_free(worker)  # a graceful drain: everything it ran has finished
            return
        width = 1
        gain = 1.0
        if n_dec and worker.assistant is not None:
            k = self.driver.num_draft_tokens(worker.assistant, worker.assist_steps)
            ramp = config.acceptance_ramp_steps
            frac = min(1.0, (worker.assist_steps + 1) / ramp) if ramp else 1.0
            acceptance = config.acceptance_start + (config.acceptance - config.acceptance_start) * frac
            width = k + 1
            gain = expected_tokens_per_step(acceptance, k)
            worker.assist_steps += 1
            self._proposed += n_dec * k
            self._accepted += n_dec * (gain - 1.0)
        ctx = worker.ctx_base + n_dec * worker.progress
        duration = self.cost.iteration_time_s(num_prefill + n_dec * width, attn + ctx * width, kv_read + ctx)
        worker.plan = plan
        worker.plan_dec = n_dec
        worker.plan_gain = gain
        worker.busy = True
        self._push(self._now + duration, _ITER_END, worker, worker.epoch)

    def _on_iter_end(self, worker: _Worker, epoch: int) -> None:
        if epoch != worker.epoch:
            return  # the worker failed during this iteration: its results are lost
        now = self._now
        self._num_iterations += 1
        kv_bytes = self._kv_bytes
        produced_tokens = 0.0
        worker.seq += 1
        seq = worker.seq
        if worker.plan_dec:
            gain = worker.plan_gain
            produced_tokens += gain * worker.ckpt_dec
            worker.progress += gain
            heap = worker.heap
            limit = worker.progress + 1e-9
            while heap and heap[0][0] <= limit:
                _, _, req = heapq.heappop(heap)
                req.gen = req.output
                self._remove_decoder(worker, req)
                self._finish(worker, req)
        for req, chunk in worker.plan:
            req.prefilled += chunk
            if req.holders:
                produced_tokens += (chunk + req.pending_stream) * len(req.holders)
                req.pending_stream = 0
                req.marks.append((seq, req.prefilled))
            if req.prefilled >= req.target_ctx:
                worker.prefill.remove(req)
                req.gen += 1
                if req.first_s != req.first_s:  # NaN: first token ever
                    req.first_s = now
                if req.interrupted and req.replay_s != req.replay_s:
                    req.replay_s = now
                if req.gen >= req.output:
                    self._finish(worker, req)
                else:
                    self._add_decoder(worker, req, seq)
        if produced_tokens:
            self._advance_stream(worker, now)
            worker.produced += produced_tokens * kv_bytes
            worker.history.append((worker.produced, seq, worker.progress))
        worker.plan = []
        self._start_iteration(worker)

    def _add_decoder(self, worker: _Worker, req: _Req, seq: int) -> None:
        req.phase = _DECODE
        req.base_progress = worker.progress
        req.gen_base = req.gen
        req.decode_seq = seq
        worker.n_dec += 1
        worker.ckpt_dec += len(req.holders)
        worker.ctx_base += req.prompt + req.gen - worker.progress
        worker.decoding[req.rid] = req
        heapq.heappush(worker.heap, (worker.progress + (req.output - req.gen), req.rid, req))

    def _remove_decoder(self, worker: _Worker, req: _Req) -> None:
        worker.n_dec -= 1
        worker.ckpt_dec -= len(req.holders)
        worker.ctx_base -= req.prompt + req.gen_base - req.base_progress
        del worker.decoding[req.rid]
        if worker.n_dec == 0:
            worker.ctx_base = 0.0  # drop accumulated rounding

    def _finish(self, worker: _Worker, req: _Req) -> None:
        req.phase = _DONE
        req.finish_s = self._now
        worker.kv_used -= req.reserved
        worker.ckpt.pop(req.rid, None)
        self._finish_counts[req.rid] += 1
        self._num_done += 1
        self.driver.finish(self._now, req.rid)

    # ---- checkpoint streaming -------------------------------------------------------------------
    def _advance_stream(self, worker: _Worker, now: float) -> None:
        worker.sent = min(worker.produced, worker.sent + self._stream_bps * (now - worker.sent_t))
        worker.sent_t = now
        history = worker.history
        while history and history[0][0] <= worker.sent + 1e-6:
            _, worker.durable_seq, worker.durable_progress = history.popleft()

    def _durable(self, worker: _Worker, req: _Req) -> int:
        """Tokens of ``req`` whose KV has fully left ``worker`` (as of its last stream update)."""
        seq = worker.durable_seq
        if not req.holders or seq < req.stream_seq:
            return 0
        if req.phase == _DECODE and req.decode_seq <= seq:
            return req.prompt + req.gen_base + int(worker.durable_progress - req.base_progress + 1e-9)
        for mark_seq, tokens in reversed(req.marks):
            if mark_seq <= seq:
                return tokens
        return 0

    def _context(self, worker: _Worker, req: _Req) -> int:
        if req.phase == _DECODE:
            return req.prompt + req.gen_base + int(worker.progress - req.base_progress + 1e-9)
        return req.prefilled

    def _on_heartbeat(self, worker: _Worker, _: Any) -> None:
        if self._num_done >= len(self.reqs):
            return
        self._push(self._now + self.config.heartbeat_s, _HEARTBEAT, worker)
        if worker.state != WorkerState.SERVING:
            if (
                worker.state == WorkerState.RECOVERING
                and self.driver.assists
                and self.driver.survivor_of(worker.wid) is None
            ):
                self._pair(worker)
            return
        self.driver.apply(
            Heartbeat(
                self._now,
                worker.wid,
                len(worker.prefill) + worker.n_dec,
                len(worker.waiting) + worker.num_moving,
            )
        )
        if not worker.ckpt:
            return
        self._advance_stream(worker, self._now)
        threshold = self.config.report_min_tokens
        for req in worker.ckpt.values():
            durable = self._durable(worker, req)
            if durable - req.reported >= threshold:
                req.reported = durable
                for holder_id in req.holders:
                    self.driver.apply(CheckpointGrew(self._now, req.rid, holder_id, durable))

    # ---- failures and recovery --------------------------------------------------------------------
    def _on_fail(self, failure: Failure, _: Any) -> None:
        now = self._now
        contexts: list[int] = []
        durables: list[int] = []
        detected: list[_Worker] = []
        for wid in failure.worker_ids:
            worker = self.workers[wid]
            if worker.state == WorkerState.FAILED:
                continue
            self._advance_stream(worker, now)
            lost: list[_Req] = []
            for req in list(worker.waiting) + worker.prefill + list(worker.decoding.values()):
                if req.phase == _DECODE:
                    req.gen = req.gen_base + int(worker.progress - req.base_progress + 1e-9)
                context = self._context(worker, req)
                durable = min(self._durable(worker, req), context)
                if req.phase != _WAITING:  # running: prefilling or decoding
                    contexts.append(context)
                    durables.append(durable)
                req.durable_at_failure = durable
                lost.append(req)
            for req in self._reqs_moving_to(worker):
                req.durable_at_failure = req.prefilled
                lost.append(req)
            for req in lost:
                req.phase = _LOST
                req.interrupted = True
                req.target_ctx = req.prompt + req.gen
                req.prefilled = 0
                req.marks = []
                req.pending_stream = 0
                req.reported = 0
            worker.lost = lost
            worker.state = WorkerState.FAILED
            self._reset(worker)  # its stream backlog died with it
            worker.num_moving = 0
            # The simulator knows a failure when it happens (a gateway, at detection): its
            # pairings end now. A freed assistant keeps loading and may pair again at a heartbeat.
            unpairing = self.driver.end_pairings(wid)
            worker.assistant = None
            if unpairing.freed_survivor_id is not None:
                self.workers[unpairing.freed_survivor_id].assistant = None
            detected.append(worker)
        if detected:
            self._push(now + self.config.detect_s, _DETECT, detected)
        if contexts:
            self._coverage.append(checkpoint_coverage(np.array(contexts), np.array(durables)))
        if math.isnan(self._balance):
            monitor = self.driver.monitor
            held = [monitor.worker(w).held_tokens for w in monitor.live_worker_ids()]
            self._balance = holder_balance_ratio(np.array(held))

    def _reqs_moving_to(self, worker: _Worker) -> list[_Req]:
        """Requests in transit (restore in progress) to ``worker``."""
        if not worker.num_moving:
            return []
        return [r for r in self.reqs if r.phase == _MOVING and r.worker == worker.wid]

    def _on_detect(self, workers: list[_Worker], _: Any) -> None:
        """Leases of ``workers`` (failed together) expired: the gateway learns the durable
        prefixes from the holders, and the driver plans the failure (mark each failed, route
        each one's requests, re-place the checkpoints each held); this turns the plan into
        restores, re-prefills and checkpoint streams."""
        now = self._now
        for worker in workers:
            for req in worker.lost:
                for holder_id in req.holders:
                    if self.workers[holder_id].state == WorkerState.SERVING and req.durable_at_failure > 0:
                        self.driver.apply(CheckpointGrew(now, req.rid, holder_id, req.durable_at_failure))
        # A worker dead but not yet detected (a later failure) is a target the simulator knows
        # to be doomed: what is routed there is lost again with it, not placed.
        doomed_ids = [w.wid for w in self.workers if w.state != WorkerState.SERVING]
        plan = self.driver.fail(now, [w.wid for w in workers], cause="lease expired", doomed_ids=doomed_ids)
        if plan.lost_request_ids:
            raise RuntimeError(f"every worker failed: requests {list(plan.lost_request_ids)} are lost")
        lost = {req.rid: req for worker in workers for req in worker.lost}
        for worker in workers:
            worker.lost = []
        for request_id in plan.parked_request_ids:  # no worker serves: resumed at a switch-over
            self._parked[request_id] = lost.pop(request_id)
        for reroute in plan.reroutes:
            self._reroute(lost.pop(reroute.route.request_id), reroute)
        if lost:
            raise RuntimeError(f"router left interrupted requests unrouted: {sorted(lost)}")
        for decision in plan.replacements:
            self._replace(decision)
        for holder in self.workers:
            if holder.state == WorkerState.SERVING:
                self._kick(holder)
        for worker in workers:
            if self.driver.assists:
                self._push(now + self.draft_load_s, _DRAFT_READY, worker, worker.epoch)
            self._push(now + self.reload_s, _MODEL_READY, worker, worker.epoch)

    def _reroute(self, req: _Req, reroute: Reroute) -> None:
        decision = reroute.route
        target = self.workers[decision.target_worker_id]
        req.worker = target.wid
        if target.state != WorkerState.SERVING:  # doomed: lost again with it
            target.lost.append(req)
            return
        self._actions[decision.action.value] += 1
        tokens = 0
        delay = 0.0
        if decision.action is not RecoveryAction.REPREFILL:
            tokens = max(0, min(decision.restorable_tokens, req.durable_at_failure, req.target_ctx - 1))
            if decision.action is RecoveryAction.RESTORE:
                delay = self.cost.restore_time_s(tokens)
            else:
                delay = self.cost.remote_restore_time_s(tokens)
        self._restored_tokens += tokens
        self._reprefill_tokens += req.target_ctx - tokens
        req.prefilled = tokens
        req.pending_stream = tokens
        req.phase = _MOVING
        req.move += 1
        target.num_moving += 1
        if reroute.placement is None:
            self._set_holders(req, reroute.holder_ids)
        else:
            req.holders = ()
            self._set_holders(req, reroute.placement.holder_ids)
        req.stream_seq = target.seq + 1
        self._push(self._now + delay, _ARRIVE_AT, req, req.move)

    def _replace(self, decision: PlacementDecision) -> None:
        req = self.reqs[decision.request_id]
        if req.phase in (_DONE, _LOST):
            return
        serving = self.workers[req.worker]
        self._set_holders(req, decision.holder_ids)
        req.reported = 0
        if req.phase == _MOVING:
            return  # its restored prefix streams when it lands
        # The new holder gets the whole context again: queue it behind what is in flight.
        self._advance_stream(serving, self._now)
        serving.seq += 1
        req.stream_seq = serving.seq
        serving.produced += self._context(serving, req) * self._kv_bytes * len(req.holders)
        serving.history.append((serving.produced, serving.seq, serving.progress))

    def _on_arrive_at(self, req: _Req, move: int) -> None:
        if move != req.move or req.phase != _MOVING:
            return  # its target failed meanwhile; that failure re-routed it
        worker = self.workers[req.worker]
        worker.num_moving -= 1
        req.phase = _WAITING
        if req.prefilled:
            worker.waiting.appendleft(req)  # restored KV resumes first, as a preempted request would
        else:
            worker.waiting.append(req)  # a re-prefill is a new submission
        self._kick(worker)

    def _on_draft_ready(self, worker: _Worker, epoch: int) -> None:
        if epoch != worker.epoch or worker.state != WorkerState.FAILED:
            return
        worker.state = WorkerState.RECOVERING
        decision = self.driver.recover(self._now, worker.wid)
        assert decision is not None  # draft-ready events exist only for policies that assist
        self._note_pairing(decision)

    def _pair(self, worker: _Worker) -> None:
        self._note_pairing(self.driver.pair(worker.wid))

    def _note_pairing(self, decision: AssistDecision) -> None:
        if decision.survivor_id is not None:
            survivor = self.workers[decision.survivor_id]
            survivor.assistant = decision.assistant_id
            survivor.assist_steps = 0
            self._pairs.append((decision.assistant_id, survivor.wid))

    def _on_model_ready(self, worker: _Worker, epoch: int) -> None:
        if epoch != worker.epoch:
            return
        freed = self.driver.switch_over(
            self._now, worker.wid, self.config.holder_budget_bytes, self.config.domain_of(worker.wid)
        )
        if freed is not None:
            self.workers[freed].assistant = None
        worker.state = WorkerState.SERVING
        worker.progress = 0.0
        self._unpark()

    def _unpark(self) -> None:
        """Move the parked requests to the workers serving again (re-prefilled: every holder
        failed with them), as the gateway does when a worker registers; then admit the
        requests that arrived meanwhile."""
        if self._parked:
            for reroute in self.driver.unpark(self._now).reroutes:
                self._reroute(self._parked.pop(reroute.route.request_id), reroute)
            for worker in self.workers:
                if worker.state == WorkerState.SERVING:
                    self._kick(worker)
        arrivals, self._parked_arrivals = self._parked_arrivals, []
        for req in arrivals:
            self._on_arrival(req)

    # ---- rolling upgrade ------------------------------------------------------------------------
    def _on_drain(self, worker: _Worker, _: Any) -> None:
        """The driver's drain (admit nothing, its copies placed again), then the strategy."""
        assert self.upgrade is not None
        now = self._now
        self._drains.append([worker.wid, now, math.nan, math.nan])
        if worker.state != WorkerState.SERVING:  # failed meanwhile: upgraded by its restart
            self._drains[-1][2] = now
            self._next_drain(now)
            return
        plan = self.driver.drain(now, worker.wid)
        worker.state = WorkerState.DRAINING
        if plan.unpairing.freed_assistant_id is not None:
            worker.assistant = None
        for decision in plan.replacements:
            self._replace(decision)
        if self.upgrade.strategy == "graceful":
            self._kick(worker)  # (an idle worker is free at once)
            return
        # It steps no more (its iteration in flight is void) while its streamer flushes: the
        # backlog of checkpoint bytes at the stream rate; an abort flushes nothing.
        self._advance_stream(worker, now)
        flush_s = (
            (worker.produced - worker.sent) / self._stream_bps if self.upgrade.strategy == "move" else 0.0
        )
        worker.epoch += 1
        worker.busy = True
        self._push(now + flush_s, _MOVE_OUT, worker, worker.epoch)

    def _on_move_out(self, worker: _Worker, epoch: int) -> None:
        """The drained worker flushed (or aborts): each of its requests is moved."""
        assert self.upgrade is not None
        if epoch != worker.epoch:
            return
        now = self._now
        moved: list[tuple[_Req, int]] = []  # (request, context tokens computed on the drained worker)
        for req in list(worker.waiting) + worker.prefill + list(worker.decoding.values()):
            if req.phase == _DECODE:
                req.gen = req.gen_base + int(worker.progress - req.base_progress + 1e-9)
            computed = self._context(worker, req) if req.phase != _WAITING else 0
            # A flushed streamer (``move``) has every computed token durable on the holders.
            req.durable_at_failure = computed if self.upgrade.strategy == "move" and req.holders else 0
            req.phase = _LOST
            req.interrupted = True
            req.target_ctx = req.prompt + req.gen
            req.prefilled = 0
            req.marks = []
            req.pending_stream = 0
            req.reported = 0
            moved.append((req, computed))
        self._reset(worker)
        reprefill = self.upgrade.strategy == "abort"
        for req, computed in sorted(moved, key=lambda m: m[0].rid):
            if req.durable_at_failure and req.holders:
                for holder_id in req.holders:  # the flushed worker's word on its replicas
                    self.driver.apply(CheckpointGrew(now, req.rid, holder_id, req.durable_at_failure))
            self._reroute(req, self.driver.move(now, req.rid, reprefill=reprefill))
            self._upgrade_reprefill += max(0, computed - req.prefilled)  # _reroute set the restored prefix
            self._num_moved += 1
        for other in self.workers:
            self._kick(other)
        self._on_free(worker)

    def _reset(self, worker: _Worker) -> None:
        """Empty a worker that runs nothing from here on (its iteration in flight is void)."""
        worker.epoch += 1
        worker.busy = False
        worker.waiting.clear()
        worker.prefill = []
        worker.heap = []
        worker.decoding = {}
        worker.n_dec = 0
        worker.ctx_base = 0.0
        worker.ckpt = {}
        worker.ckpt_dec = 0
        worker.kv_used = 0
        worker.history.clear()
        worker.sent = worker.produced
        worker.sent_t = self._now

    def _on_free(self, worker: _Worker) -> None:
        """The drained worker runs nothing: retired (as the gateway does when a drained worker
        exits), restarted, back after the reload time."""
        now = self._now
        self._drains[-1][2] = now
        worker.state = WorkerState.FAILED
        worker.epoch += 1
        self.driver.apply(WorkerFailed(now, worker.wid))
        self._push(now + self.reload_s, _REJOIN, worker, worker.epoch)

    def _on_rejoin(self, worker: _Worker, epoch: int) -> None:
        if epoch != worker.epoch:
            return
        now = self._now
        self.driver.apply(
            WorkerJoined(now, worker.wid, self.config.holder_budget_bytes, self.config.domain_of(worker.wid))
        )
        worker.state = WorkerState.SERVING
        worker.progress = 0.0
        self._unpark()
        self._drains[-1][3] = now
        self._next_drain(now)

    def _next_drain(self, now: float) -> None:
        if self._upgrade_order:
            self._push(now, _DRAIN, self.workers[self._upgrade_order.pop(0)])

    # ---- speculative assist gain (injected into the planner) ---------------------------------------
    def _gain(self, monitor: LoadMonitor, survivor_id: int, num_draft_tokens: int) -> float:
        """Tokens per verify step at the steady acceptance rate, minus the verify step's cost
        expressed in plain decode steps of the survivor's current batch."""
        del monitor  # the simulator's own state is the truth the cost model prices
        survivor = self.workers[survivor_id]
        n_dec = survivor.n_dec
        if n_dec == 0:
            gain = -1.0
        else:
            ctx = survivor.ctx_base + n_dec * survivor.progress
            step = self.cost.decode_step_time_s(n_dec, ctx)
            verify = self.cost.verify_step_time_s(n_dec, ctx, num_draft_tokens)
            gain = expected_tokens_per_step(self.config.acceptance, num_draft_tokens) - verify / step
        return gain


def _progress_bar(fraction: float, sim_s: float) -> None:
    width = 30
    filled = int(fraction * width)
    sys.stderr.write(f"\r  [{'#' * filled}{'.' * (width - filled)}] {fraction * 100:5.1f}%  t={sim_s:8.1f}s")
    sys.stderr.flush()
