"""A planned drain on a live loopback cluster (issue 22): reference-engine ``lumen worker``
processes behind a gateway; one worker runs at least ``min_running`` requests, each of which
has streamed at least ``min_tokens`` tokens and has that many durable on its holder (as the
kill rule of ``worker.scenario``), when it is drained (``Drain``, the admin call of
``lumen drain``). Every request must complete with the outputs of the undisturbed run (one
in-process engine on the same prompts: float64 greedy decoding does not depend on the batch).

Figures, all from this one run: ``drain_s`` (drain call until the worker is told to stop: every
request moved), ``graceful_wait_s`` (drain call until the last of those requests finished where
it was moved: the least a graceful drain, which waits for them, would have kept the worker
busy), ``moved`` and ``reprefilled_tokens_per_moved_request`` (context tokens the workers
computed again on resume, counted by the workers themselves, per moved request).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from lumen_core._validate import check_int
from lumen_core.engine import Engine, SamplingParams, load_model
from lumen_core.policy.events import WorkerState
from lumen_core.worker.cluster import LocalCluster, RequestResult


@dataclass(frozen=True)
class DrainResult:
    """The run's figures and what the checks read (``results`` in submission order)."""

    drain_s: float
    graceful_wait_s: float
    moved: int
    num_reprefilled_at_deadline: int
    reprefilled_tokens: int
    identical: int
    total: int
    results: tuple[RequestResult, ...]
    worker_stats: tuple[dict[str, object], ...]  # each worker's ``stopped`` line
    retired: bool  # the drained worker reported its exit and the gateway retired it
    num_failures: int  # failures the gateway counted (a drain is none)

    @property
    def reprefilled_tokens_per_moved_request(self) -> float:
        return self.reprefilled_tokens / self.moved if self.moved else float("nan")

    def rows(self) -> list[dict[str, object]]:
        """The rows of ``lumen demo --scenario drain --json`` (``metric``, ``value``)."""
        figures = {
            "drain_s": self.drain_s,
            "graceful_wait_s": self.graceful_wait_s,
            "reprefilled_tokens_per_moved_request": self.reprefilled_tokens_per_moved_request,
            "moved": self.moved,
            "reprefilled_at_deadline": self.num_reprefilled_at_deadline,
            "identical": self.identical,
            "total": self.total,
        }
        return [{"metric": name, "value": value} for name, value in figures.items()]


def run_drain(
    workdir: Path,
    *,
    policy: str = "LUMEN",
    num_workers: int = 2,
    num_requests: int = 32,
    prompt_tokens: int = 48,
    max_new_tokens: int = 192,
    min_running: int = 16,
    min_tokens: int = 8,
    deadline_s: float = 30.0,
    seed: int = 0,
    timeout_s: float = 120.0,
    progress: Callable[[str], None] | None = None,
) -> DrainResult:
    """Run the scenario (module doc) in ``workdir``; worker 0 is drained. Raises ValueError
    for counts out of range, RuntimeError when worker 0 never runs ``min_running`` requests
    with ``min_tokens`` each (a starved machine) or the drain does not end in time."""
    check_int("num_requests", num_requests, low=1)
    check_int("min_running", min_running, low=1)
    say = progress or (lambda message: None)
    rng = np.random.default_rng(seed)
    prompts = [[int(t) for t in rng.integers(1, 200, prompt_tokens)] for _ in range(num_requests)]
    with LocalCluster(workdir, policy=policy, num_workers=num_workers, seed=seed) as cluster:
        cluster.start()
        say(f"{num_workers} workers up; submitting {num_requests} requests")
        results = [RequestResult(i, cluster.now_s()) for i in range(num_requests)]
        threads = [
            threading.Thread(target=cluster.run_request, args=(r, p, max_new_tokens, timeout_s), daemon=True)
            for r, p in zip(results, prompts)
        ]
        for thread in threads:
            thread.start()
        coordinator = cluster.gateway.coordinator
        give_up_s = time.monotonic() + timeout_s
        while True:
            with cluster.gateway.condition:
                # as the kill rule of worker.scenario: streamed tokens and a durable checkpoint
                ready = [
                    r
                    for r in coordinator.monitor.running_on(0)
                    if len(coordinator.tokens(r)[0]) >= min_tokens
                    and max((d for _, d in coordinator.monitor.request(r).durable_tokens), default=0)
                    >= min_tokens
                ]
            if len(ready) >= min_running:
                break
            if time.monotonic() > give_up_s:
                raise RuntimeError(
                    f"worker 0 never ran {min_running} requests with {min_tokens} tokens (and durable) each"
                )
            time.sleep(0.005)
        with cluster.gateway.condition:
            on_drained = set(coordinator.monitor.running_on(0))
        drain_called_s = cluster.now_s()
        reply = cluster.client.drain(0, deadline_s=deadline_s)
        say(f"draining worker 0: {reply.num_requests} requests running there")
        while reply.state == "flushing" and time.monotonic() < give_up_s:
            time.sleep(0.005)
            reply = cluster.client.drain(0, deadline_s=deadline_s)
        if reply.state != "stopped":
            raise RuntimeError(f"the drain of worker 0 ended {reply.state!r}, not 'stopped'")
        drain_s = reply.finished_s - reply.started_s
        for thread in threads:
            thread.join(timeout=max(0.1, give_up_s - time.monotonic()))
        last_token_s = max(
            (r.token_times_s[-1] for r in results if r.request_id in on_drained and r.token_times_s),
            default=float("nan"),
        )
        graceful_wait_s = last_token_s - drain_called_s
        drained = cluster.workers[0].process
        drained.wait(timeout=max(0.1, give_up_s - time.monotonic()))  # it exits when told to stop
        with cluster.gateway.condition:
            retired = coordinator.worker_state(0) == WorkerState.FAILED
            num_failures = len(coordinator.failures)
        say(f"drained in {drain_s:.3f} s; its requests finished {graceful_wait_s:.3f} s after the call")
    stats = cluster.worker_stats()
    reprefilled_tokens = sum(int(s.get("reprefilled_tokens", 0)) for s in stats)  # type: ignore[call-overload]
    engine = Engine(load_model(workdir / "target.pt"))
    reference = engine.generate(prompts, [SamplingParams(max_tokens=max_new_tokens) for _ in prompts])
    identical = sum(1 for r, ref in zip(results, reference) if r.finished and r.token_ids == ref)
    return DrainResult(
        drain_s=drain_s,
        graceful_wait_s=graceful_wait_s,
        moved=reply.num_moved,
        num_reprefilled_at_deadline=reply.num_reprefilled,
        reprefilled_tokens=reprefilled_tokens,
        identical=identical,
        total=num_requests,
        results=tuple(results),
        worker_stats=tuple(stats),
        retired=retired,
        num_failures=num_failures,
    )
