"""Paced engine steps: a live worker emulating a modelled GPU setup (issue 21).

Under ``lumen worker --pace MODEL/GPUxTP`` each engine step lasts what the cost model
(``lumen_core.cost``, the simulator's) gives for that step's real contents, times
``time_scale``: the real compute runs first, then the worker sleeps out the rest of the
modelled duration. A step whose real compute took longer than its paced duration overran:
the emulation is then slower than the modelled hardware, and the worker counts it (a run
with more than ``FAITHFUL_OVERRUN_FRACTION`` of its steps overrun is not faithful).

Checkpoint streaming is paced too (``PacedSaves``): a step's saved tokens leave for their
holders no faster than the modelled link carries the modelled model's KV, so the durable
prefix at a failure is what it would be on the modelled hardware.

Only durations are paced; tokens, KV bytes and checkpoints stay real.
"""

from __future__ import annotations

import re
import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from lumen_core.cost import GPUS, MODELS, CostModel

if TYPE_CHECKING:  # the engine (and torch) only for the type: the demo's CLI stays light
    from lumen_core.engine.connector import SavedTokens
    from lumen_core.engine.engine import StepOutput

# Above this share of overrun steps a paced run no longer emulates the modelled hardware.
FAITHFUL_OVERRUN_FRACTION = 0.05
_PACE = re.compile(r"(?P<model>[^/]+)/(?P<gpu>.+?)(?:x(?P<tp>[0-9]+))?")


@dataclass(frozen=True)
class StepChunk:
    """One request's part of an engine step: ``num_tokens`` tokens fed from position
    ``start`` (the KV before it is read from HBM), the last ``num_draft_tokens`` of them
    drafts to verify (0: a prefill chunk or a plain decode)."""

    start: int
    num_tokens: int
    num_draft_tokens: int = 0

    def __post_init__(self) -> None:
        if self.start < 0:
            raise ValueError(f"`start` must be >= 0, got {self.start}")
        if self.num_tokens < 1:
            raise ValueError(f"`num_tokens` must be >= 1, got {self.num_tokens}")
        if not 0 <= self.num_draft_tokens < self.num_tokens:
            raise ValueError(
                f"`num_draft_tokens` must be in [0, num_tokens={self.num_tokens}), got "
                f"{self.num_draft_tokens}"
            )


def step_time_s(cost: CostModel, chunks: Iterable[StepChunk]) -> float:
    """Modelled duration of one forward pass over ``chunks`` (0 for none). Token ``i`` of a
    chunk attends to ``start + i + 1`` positions; each chunk reads its ``start`` cached
    tokens: the accounting of ``CostModel.iteration_time_s`` the simulator uses."""
    num_tokens = 0
    attn = 0.0
    kv_read = 0.0
    for chunk in chunks:
        n = chunk.num_tokens
        num_tokens += n
        attn += n * chunk.start + n * (n + 1) / 2.0
        kv_read += chunk.start
    return cost.iteration_time_s(num_tokens, attn, kv_read)


def step_chunks(out: StepOutput) -> list[StepChunk]:
    """What an engine step ran, from its output: each save starts where the request's
    chunk started; a verified request fed ``kept - accepted`` tokens (at least the one
    uncomputed token) plus its ``num_draft_tokens`` drafts."""
    chunks = []
    for save in out.saves:
        num_drafts = out.num_draft_tokens.get(save.request_id, 0)
        num_kept = len(save.slot_ids)
        num_fed = max(1, num_kept - out.num_accepted.get(save.request_id, 0)) if num_drafts else num_kept
        if num_fed > 0:
            chunks.append(StepChunk(save.start_position, num_fed + num_drafts, num_drafts))
    return chunks


def modelled_step_s(cost: CostModel, out: StepOutput, restores: Iterable[tuple[int, bool]] = ()) -> float:
    """Modelled duration of an engine step: its forward pass (``step_time_s``) plus the
    restores it loaded, ``(num_tokens, remote)`` each: host DRAM over PCIe, or a peer's
    holder over the NIC (``CostModel.restore_time_s`` / ``remote_restore_time_s``)."""
    duration = step_time_s(cost, step_chunks(out))
    for num_tokens, remote in restores:
        duration += cost.remote_restore_time_s(num_tokens) if remote else cost.restore_time_s(num_tokens)
    return duration


def parse_pace(spec: str) -> CostModel:
    """``"qwen3-32b/h100x2"`` -> the cost model of Qwen3-32B on 2 H100s (names as in
    ``cost.MODELS`` and ``cost.GPUS``, any case; ``xTP`` defaults to 1).

    Raises ``ValueError`` naming the known models and GPUs for an unknown spec."""
    if not isinstance(spec, str):
        raise TypeError(f"`pace` must be str, got {type(spec).__name__}")
    match = _PACE.fullmatch(spec.strip().lower())
    models = {name.lower(): name for name in MODELS}
    gpus = {name.lower(): name for name in GPUS}
    if match is None or match["model"] not in models or match["gpu"] not in gpus:
        raise ValueError(
            f"`pace` must be MODEL/GPUxTP with MODEL in {sorted(models)} and GPU in {sorted(gpus)}, "
            f"got {spec!r}"
        )
    model_name, gpu_name, tp_text = match["model"], match["gpu"], match["tp"] or "1"
    return CostModel(models[model_name.lower()], gpus[gpu_name.lower()], int(tp_text))


class Pacer:
    """Stretches each step to its modelled duration times ``time_scale``.

    ``begin()`` before the real compute, ``end(modelled_s)`` after it: sleeps until
    ``time_scale * modelled_s`` has passed since the step began and counts the step as
    overrun if the compute alone took longer. ``clock``/``sleep`` are injected (tests). Not thread-safe:
    one engine loop owns it."""

    def __init__(
        self,
        cost: CostModel,
        time_scale: float = 1.0,
        *,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        if not time_scale > 0:
            raise ValueError(f"`time_scale` must be > 0, got {time_scale}")
        self.cost = cost
        self.time_scale = time_scale
        self._clock = clock
        self._sleep = sleep
        self._started: float | None = None
        self._deadline: float | None = None  # when the last step's paced time ended
        self.num_steps = 0
        self.num_overruns = 0
        self.modelled_s = 0.0  # the sum of paced steps' modelled durations

    def begin(self, *, after_previous: bool = False) -> None:
        """Open a step. ``after_previous``: it follows the last step without idling, so it
        starts where that one's paced time ended and the work done in between (token
        reports, directives) is inside this step's paced time, not added to it."""
        now = self._clock()
        self._started = min(now, self._deadline) if after_previous and self._deadline is not None else now

    def end(self, modelled_s: float) -> None:
        """Close the step ``begin`` opened. A step with ``modelled_s == 0`` (nothing ran)
        is not counted. Raises ``RuntimeError`` without a ``begin``."""
        if self._started is None:
            raise RuntimeError("Pacer.end called without begin")
        started, self._started = self._started, None
        if modelled_s < 0:
            raise ValueError(f"`modelled_s` must be >= 0, got {modelled_s}")
        if modelled_s == 0:
            return
        self.num_steps += 1
        self.modelled_s += modelled_s
        deadline = started + self.time_scale * modelled_s
        remaining = deadline - self._clock()
        if remaining < 0:
            self.num_overruns += 1
            self._deadline = self._clock()
        else:
            self._sleep(remaining)
            self._deadline = deadline

    @property
    def overrun_fraction(self) -> float:
        """Share of paced steps whose real compute overran (0 before any step)."""
        return self.num_overruns / self.num_steps if self.num_steps else 0.0


class PacedSaves:
    """Checkpoint streaming paced to the modelled link: the saves of each step queue in
    order and leave no faster than ``CostModel.stream_bytes_per_s`` carries
    ``kv_bytes_per_token`` of the modelled model per copy (a request streaming to two
    holders sends each token twice), times ``time_scale``: the simulator's per-worker FIFO.
    An idle link banks nothing. ``clock`` is injected (tests). Not thread-safe: the engine
    loop owns it.

    The queued tokens' slots must stay valid until they leave: ``drop`` a request before its
    slots are freed or rewritten (finish, preemption); its saved prefix then ends where its
    last released tokens did, as a link cut there would leave it."""

    def __init__(
        self, cost: CostModel, time_scale: float = 1.0, *, clock: Callable[[], float] = time.monotonic
    ):
        if not time_scale > 0:
            raise ValueError(f"`time_scale` must be > 0, got {time_scale}")
        self.token_s = time_scale * cost.kv_bytes_per_token / cost.stream_bytes_per_s  # per copy
        self._clock = clock
        self._queue: deque[tuple[SavedTokens, int]] = deque()  # (save, copies), oldest first
        self._link_free_at = 0.0  # when the link has carried everything released so far
        self.num_dropped_tokens = 0

    @property
    def backlog_tokens(self) -> int:
        """Tokens saved but not yet released to the streamer."""
        return sum(len(save.slot_ids) for save, _ in self._queue)

    def push(self, saves: Sequence[SavedTokens], copies_of: Callable[[str], int]) -> None:
        """Queues one step's saves; ``copies_of(request_id)``: how many holders each goes to
        (0: not streamed, released at once)."""
        if not self._queue:
            self._link_free_at = max(self._link_free_at, self._clock())
        for save in saves:
            if save.slot_ids:
                self._queue.append((save, int(copies_of(save.request_id))))

    def take(self) -> list[SavedTokens]:
        """The saves, or their leading tokens, the link has carried by now: in order within
        each request, each request's together (one ``save_step`` takes a request's tokens
        adjacent), requests in the order their first released save was queued."""
        now = self._clock()
        out: list[SavedTokens] = []
        while self._queue:
            save, copies = self._queue[0]
            per_token = self.token_s * copies
            n = len(save.slot_ids)
            if per_token > 0:
                n = min(n, int((now - self._link_free_at) / per_token + 1e-9))
            if n <= 0:
                break
            self._link_free_at += n * per_token
            if n == len(save.slot_ids):
                self._queue.popleft()
                out.append(save)
                continue
            out.append(replace(save, slot_ids=save.slot_ids[:n], token_ids=save.token_ids[:n]))
            rest = replace(
                save,
                start_position=save.start_position + n,
                slot_ids=save.slot_ids[n:],
                token_ids=save.token_ids[n:],
            )
            self._queue[0] = (rest, copies)
            break
        first: dict[str, int] = {}
        for save in out:
            first.setdefault(save.request_id, len(first))
        return sorted(out, key=lambda save: first[save.request_id])  # stable

    def drop(self, request_id: str) -> None:
        """Forgets ``request_id``'s queued tokens (counted in ``num_dropped_tokens``)."""
        kept = deque(item for item in self._queue if item[0].request_id != request_id)
        self.num_dropped_tokens += sum(len(s.slot_ids) for s, _ in self._queue) - sum(
            len(s.slot_ids) for s, _ in kept
        )
        self._queue = kept
