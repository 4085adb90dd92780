"""One live scenario: a ``LocalCluster`` replays arrivals, optionally SIGKILLs a worker that
runs enough requests with durable checkpoints and restarts it; the client-side records.

``run_scenario`` is what ``lumen demo`` runs once per policy (plus once failure-free) and
what the end-to-end tests run with fewer workers and requests.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from lumen_core.metrics import RequestRecords
from lumen_core.policy.driver import FailurePlan
from lumen_core.policy.events import RouteDecision
from lumen_core.sim.workload import Workload
from lumen_core.worker.cluster import TINY_MODEL, LocalCluster, RequestResult
from lumen_core.worker.process import WorkerConfig

PROGRESS_EVERY_S = 60.0  # real seconds between a run's progress lines


@dataclass(frozen=True)
class Arrival:
    time_s: float
    prompt_token_ids: tuple[int, ...]
    max_new_tokens: int


def arrivals_from_workload(
    workload: Workload,
    *,
    seed: int,
    prompt_scale: float = 1 / 8,
    output_scale: float = 1.0,
    max_prompt_tokens: int = 192,
    max_output_tokens: int = 192,
    min_output_tokens: int = 24,
) -> list[Arrival]:
    """Trace requests as tiny-model requests: token counts scaled and clipped, prompt token
    ids drawn from ``seed`` (the same arrivals for every policy)."""
    rng = np.random.default_rng(seed)
    out = []
    for t, p, o in zip(workload.arrival_s, workload.prompt_tokens, workload.output_tokens, strict=True):
        n_prompt = int(np.clip(round(p * prompt_scale), 4, max_prompt_tokens))
        n_out = int(np.clip(round(o * output_scale), min_output_tokens, max_output_tokens))
        prompt = tuple(int(x) for x in rng.integers(0, TINY_MODEL.vocab_size, size=n_prompt))
        out.append(Arrival(float(t), prompt, n_out))
    return out


@dataclass(frozen=True)
class KillRule:
    """Kill a worker once one runs at least ``min_requests`` requests whose checkpoints hold
    at least ``min_durable_tokens`` durable tokens each (requests the policy does not
    checkpoint: that many tokens computed), not before ``not_before_s``; restart it at once
    (as a recovering worker). A request in the last quarter of its expected output does not
    count: it may finish between the choice and the kill, and the kill is meant to interrupt
    ``min_requests``. Times are modelled seconds (``run_scenario``'s ``time_scale``).

    ``arrivals_wait_for_restart``: the arrival clock stands still from the kill until the
    restarted worker has registered, so every arrival after the kill comes that much later.
    The restart's process start (imports, real loads) is real time on the test machine, which
    the model leaves out (it models the loads), and a loaded machine can stretch it past the
    survivors' work: a run that tests the recovering worker's assist needs arrivals left
    when it pairs."""

    not_before_s: float
    min_requests: int = 4
    min_durable_tokens: int = 16
    give_up_s: float = 60.0
    arrivals_wait_for_restart: bool = False


class _ArrivalClock:
    """When arrivals are due, in modelled seconds of ``now_s`` (``time_scale`` real seconds
    each); ``stop`` / ``resume`` shift every arrival not yet due by the time in between."""

    def __init__(self, now_s: Callable[[], float], time_scale: float) -> None:
        self._now_s = now_s
        self._time_scale = time_scale
        self._changed = threading.Condition()
        self._stopped_at_s: float | None = None
        self.shift_s = 0.0  # modelled seconds the clock stood still

    def stop(self) -> None:
        with self._changed:
            if self._stopped_at_s is None:
                self._stopped_at_s = self._now_s()

    def resume(self) -> None:
        with self._changed:
            if self._stopped_at_s is not None:
                self.shift_s += self._now_s() - self._stopped_at_s
                self._stopped_at_s = None
                self._changed.notify_all()

    def wait_until(self, time_s: float) -> None:
        """Returns once ``time_s``, shifted by the time stood still, has come."""
        with self._changed:
            while True:
                if self._stopped_at_s is not None:
                    self._changed.wait()
                    continue
                remaining_s = time_s + self.shift_s - self._now_s()
                if remaining_s <= 0:
                    return
                self._changed.wait(remaining_s * self._time_scale)


@dataclass
class ScenarioResult:
    policy: str
    results: list[RequestResult]
    failure_s: float = math.nan
    failed_worker_id: int = -1
    restart_s: float = math.nan
    interrupted_ids: tuple[int, ...] = ()
    routes: tuple[RouteDecision, ...] = ()  # the router's decisions at the failure
    # Every failure the gateway handled in the run: the injected one, and any other (a lease
    # that ran out on a starved machine fails that worker too, and its requests resume).
    failures: tuple[FailurePlan, ...] = ()
    coverage: float = math.nan
    holder_balance: float = math.nan
    acceptance: float = math.nan
    proposed_drafts: int = 0
    accepted_drafts: int = 0
    worker_stats: list[dict[str, object]] = field(default_factory=list)
    duration_s: float = 0.0
    time_scale: float = 1.0  # real seconds per modelled second; every *_s here is modelled

    def records(self) -> RequestRecords:
        """Per-request times for ``lumen_core.metrics`` in modelled seconds (the results'
        real times over ``time_scale``; NaN where never reached)."""
        n = len(self.results)
        first = np.full(n, np.nan)
        finish = np.full(n, np.nan)
        replay = np.full(n, np.nan)
        interrupted = np.zeros(n, dtype=bool)
        ids = set(self.interrupted_ids)
        scale = self.time_scale
        for i, r in enumerate(self.results):
            if r.token_times_s:
                first[i] = r.token_times_s[0] / scale
            if r.finished:
                finish[i] = r.token_times_s[-1] / scale if r.token_times_s else np.nan
            if r.request_id in ids:
                interrupted[i] = True
                later = [t / scale for t in r.token_times_s if t / scale > self.failure_s]
                replay[i] = later[0] if later else np.nan
        return RequestRecords(
            arrival_s=np.array([r.arrival_s / scale for r in self.results]),
            first_token_s=first,
            finish_s=finish,
            num_output_tokens=np.array([len(r.token_ids) for r in self.results]),
            interrupted=interrupted,
            replay_token_s=replay,
        )

    @property
    def restored(self) -> int:
        return sum(int(s.get("restored", 0)) for s in self.worker_stats)  # type: ignore[call-overload]

    @property
    def reprefilled(self) -> int:
        return sum(int(s.get("reprefilled", 0)) for s in self.worker_stats)  # type: ignore[call-overload]

    @property
    def paced_overrun_fraction(self) -> float:
        """Share of paced engine steps whose real compute overran, over the workers that
        stopped cleanly (a SIGKILLed worker reports nothing); NaN when nothing was paced."""
        steps = sum(int(s.get("paced_steps", 0)) for s in self.worker_stats)  # type: ignore[call-overload]
        overruns = sum(int(s.get("paced_overruns", 0)) for s in self.worker_stats)  # type: ignore[call-overload]
        return overruns / steps if steps else math.nan


def _victim(cluster: LocalCluster, plan: KillRule) -> int | None:
    with cluster.gateway.condition:
        monitor = cluster.gateway.coordinator.monitor
        for worker_id in sorted(monitor.live_worker_ids()):
            durable = 0
            for request_id in monitor.running_on(worker_id):
                view = monitor.request(request_id)
                generated = len(cluster.gateway.coordinator.tokens(request_id)[0])
                if 4 * generated >= 3 * view.expected_output_tokens:
                    continue
                # A request its policy keeps no checkpoint of (S&R) counts once it has run
                # as long as a checkpointed one would have to.
                tokens = (
                    max((d for _, d in view.durable_tokens), default=0)
                    if view.holder_ids
                    else view.prompt_tokens + generated
                )
                if tokens >= plan.min_durable_tokens:
                    durable += 1
            if durable >= plan.min_requests:
                return worker_id
    return None


def kv_blocks_for(arrivals: list[Arrival]) -> int:
    """KV cache pages for a worker to hold ``max_num_seqs`` of these requests at the longest
    one's full length (at least the worker's default): the cache never queues a request, as
    the modelled GPUs' (hundreds of thousands of tokens, ``cost.kv_capacity_tokens``) do not at
    this scale. With the default 1,024 pages (16,384 tokens) the survivors of the --full run
    hit it after a failure and queued new requests 0.2-0.9 modelled s, which the simulator
    rightly did not (S&R mean TTFT 0.040 s live vs 0.029 s simulated; 0.031 s with room)."""
    longest = max((len(a.prompt_token_ids) + a.max_new_tokens for a in arrivals), default=0)
    pages = math.ceil(WorkerConfig.max_num_seqs * longest / WorkerConfig.block_size)
    return max(WorkerConfig.num_blocks, pages)


def run_scenario(
    workdir: Path,
    policy: str,
    arrivals: list[Arrival],
    *,
    num_workers: int,
    failure: KillRule | None,
    request_timeout_s: float = 120.0,
    progress: Callable[[str], None] | None = None,
    time_scale: float = 1.0,
    **cluster_options: object,
) -> ScenarioResult:
    """Run the arrivals on a fresh cluster; see module doc. Every process is reaped.

    ``time_scale`` stretches the arrival clock as the workers stretch their paced steps:
    arrival times, the failure plan's times, ``request_timeout_s`` and the result's figures are
    modelled seconds (a request waits out a modelled reload whatever the scale)."""
    say = progress or (lambda _: None)
    label = policy if failure is not None else "failure-free"
    cluster_options.setdefault("num_blocks", kv_blocks_for(arrivals))
    cluster = LocalCluster(
        workdir,
        policy=policy,
        num_workers=num_workers,
        time_scale=time_scale,
        **cluster_options,  # type: ignore[arg-type]
    )
    result = ScenarioResult(policy, [], time_scale=time_scale)

    def now_s() -> float:  # modelled
        return cluster.now_s() / time_scale

    clock = _ArrivalClock(now_s, time_scale)
    timeout_real_s = request_timeout_s * time_scale
    done = threading.Event()  # ends the progress lines
    try:
        cluster.start()
        cluster.clock0 = time.monotonic()
        threads: list[threading.Thread] = []
        results = [RequestResult(i, a.time_s) for i, a in enumerate(arrivals)]
        result.results = results

        def submit_all() -> None:
            for arrival, record in zip(arrivals, results, strict=True):
                clock.wait_until(arrival.time_s)
                record.arrival_s = cluster.now_s()
                thread = threading.Thread(
                    target=cluster.run_request,
                    args=(record, list(arrival.prompt_token_ids), arrival.max_new_tokens, timeout_real_s),
                    daemon=True,
                )
                thread.start()
                threads.append(thread)

        submitter = threading.Thread(target=submit_all, daemon=True)
        submitter.start()

        def report_progress() -> None:
            while not done.wait(PROGRESS_EVERY_S):
                finished = sum(r.finished for r in results)
                say(f"{label}: {finished}/{len(results)} requests finished at {now_s():.0f} modelled s")

        threading.Thread(target=report_progress, name="lumen-demo-progress", daemon=True).start()
        if failure is not None:
            deadline = failure.not_before_s + failure.give_up_s
            victim = None
            while victim is None and now_s() < deadline:
                time.sleep(0.05)
                if now_s() >= failure.not_before_s:
                    victim = _victim(cluster, failure)
            if victim is None:
                raise RuntimeError(
                    f"no worker ran {failure.min_requests} requests with >= {failure.min_durable_tokens} "
                    f"durable tokens within {failure.give_up_s} s"
                )
            with cluster.gateway.condition:
                metrics = cluster.gateway.coordinator.metrics()
            result.coverage, result.holder_balance = metrics.coverage, metrics.holder_balance
            result.failed_worker_id = victim
            if failure.arrivals_wait_for_restart:
                clock.stop()
            try:
                result.failure_s = cluster.kill(victim) / time_scale
                with cluster.gateway.condition:
                    outcome = cluster.gateway.coordinator.failures[-1]
                interrupted = tuple(route.request_id for route in outcome.routes)
                result.interrupted_ids = interrupted
                result.routes = outcome.routes
                say(
                    f"{policy}: SIGKILL worker {victim} at {result.failure_s:.1f} s "
                    f"({len(interrupted)} requests running)"
                )
                cluster.restart(victim)
            finally:
                clock.resume()
            result.restart_s = now_s()
            say(f"{policy}: worker {victim} restarted (recovering) at {result.restart_s:.1f} s")
        submitter.join(
            timeout=max(1.0, (arrivals[-1].time_s + clock.shift_s - now_s()) * time_scale + 30.0)
            if arrivals
            else 1.0
        )
        end = time.monotonic() + timeout_real_s
        for thread in list(threads):
            thread.join(timeout=max(0.1, end - time.monotonic()))
        say(f"{label}: {sum(r.finished for r in results)}/{len(results)} requests finished")
        with cluster.gateway.condition:
            metrics = cluster.gateway.coordinator.metrics()
        result.acceptance = metrics.acceptance
        result.duration_s = now_s()
        with cluster.gateway.condition:
            result.failures = cluster.gateway.coordinator.failures
    finally:
        done.set()
        cluster.close()
    result.worker_stats = cluster.worker_stats()
    result.proposed_drafts = sum(int(s.get("proposed_drafts", 0)) for s in result.worker_stats)  # type: ignore[call-overload]
    result.accepted_drafts = sum(int(s.get("accepted_drafts", 0)) for s in result.worker_stats)  # type: ignore[call-overload]
    return result
