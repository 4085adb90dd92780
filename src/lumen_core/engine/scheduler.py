"""Continuous batching: chunked prefill under a token budget, admission by KV capacity,
preemption by recompute. Plain Python over requests and the block manager; no tensors."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from lumen_core.engine.block_manager import BlockManager
from lumen_core.engine.config import SchedulerConfig
from lumen_core.engine.request import Request, RequestStatus


class PrefixLoader(Protocol):
    """Restores the KV of a request's prefix from a checkpoint instead of prefilling it."""

    def num_matched_tokens(self, request: Request) -> int:
        """How many leading tokens of ``request`` a load can supply (0: none)."""
        ...

    def load(self, request: Request, num_tokens: int) -> int:
        """Write the K and V of the first ``num_tokens`` tokens into the request's pages
        (already allocated); return how many leading tokens were loaded intact."""
        ...


@dataclass
class ScheduledRequest:
    """``num_tokens`` new tokens of ``request`` run this step, the last ``num_draft_tokens``
    of them its drafts."""

    request: Request
    num_tokens: int
    num_draft_tokens: int = 0


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_tokens for s in self.scheduled)


class Scheduler:
    """Chooses what runs each step.

    Running requests go first, oldest first: a decoding request takes 1 token (plus its
    drafts, trimmed to the budget), a prefilling one the next chunk of its prompt that fits
    the budget. When a running request cannot get pages, the newest running request is
    preempted (its pages freed, to be recomputed later; ``before_free`` runs first so that
    pending saves of those pages finish). Waiting requests are then admitted in arrival order
    while the budget, ``max_num_seqs`` and free pages allow; a request whose prefix a
    ``PrefixLoader`` can restore gets that prefix loaded and prefills only its tail.
    """

    def __init__(
        self,
        config: SchedulerConfig,
        block_manager: BlockManager,
        *,
        prefix_loader: PrefixLoader | None = None,
        before_free: Callable[[Request], None] | None = None,
    ) -> None:
        self.config = config
        self.block_manager = block_manager
        self.prefix_loader = prefix_loader
        self.before_free = before_free
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []

    def add(self, request: Request) -> None:
        request.status = RequestStatus.WAITING
        self.waiting.append(request)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        i = 0
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            num_drafts = 0
            if request.num_uncomputed_tokens == 1:
                num_drafts = min(len(request.draft_token_ids), budget - 1)
            num_tokens = min(request.num_uncomputed_tokens, budget - num_drafts) + num_drafts
            total = request.num_computed_tokens + num_tokens
            while not self.block_manager.can_allocate(request, total):
                victim = self.running[-1]
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is request:
                    break
            if request.status is not RequestStatus.RUNNING:
                break
            self.block_manager.allocate(request, total)
            out.scheduled.append(ScheduledRequest(request, num_tokens, num_drafts))
            budget -= num_tokens
            i += 1
        while (
            self.waiting and budget > 0 and not out.preempted and len(self.running) < self.config.max_num_seqs
        ):
            request = self.waiting[0]
            num_matched = 0
            if self.prefix_loader is not None:
                # The last token is always recomputed: its logits give the next token.
                num_matched = min(self.prefix_loader.num_matched_tokens(request), request.num_tokens - 1)
            total = min(request.num_tokens, num_matched + budget)
            if not self.block_manager.can_allocate(request, total):
                break
            self.block_manager.allocate(request, total)
            if num_matched > 0:
                assert self.prefix_loader is not None
                loaded = self.prefix_loader.load(request, num_matched)
                request.num_computed_tokens = loaded
                request.num_loaded_tokens = loaded
                # Fewer loaded tokens never need more pages: loaded + chunk <= total.
                self.block_manager.truncate(request, min(request.num_tokens, loaded + budget))
            self.waiting.popleft()
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            num_tokens = min(request.num_uncomputed_tokens, budget)
            out.scheduled.append(ScheduledRequest(request, num_tokens))
            budget -= num_tokens
        return out

    def finish(self, request: Request, reason: str) -> None:
        """Remove ``request`` (running or waiting) and free its pages."""
        if request.status is RequestStatus.RUNNING:
            self.running.remove(request)
        elif request.status is RequestStatus.WAITING:
            self.waiting.remove(request)
        self._free(request)
        request.status = RequestStatus.FINISHED
        request.finish_reason = reason

    def _preempt(self, request: Request) -> None:
        self.running.remove(request)
        self._free(request)
        request.num_computed_tokens = 0
        request.draft_token_ids = []
        request.draft_probs = None
        request.status = RequestStatus.WAITING
        self.waiting.appendleft(request)

    def _free(self, request: Request) -> None:
        if request.block_ids and self.before_free is not None:
            self.before_free(request)
        self.block_manager.free(request)
