"""The engine loop: schedule, run, sample or verify, save, free. One call of ``step`` is one
forward pass over a continuous batch."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from lumen_core.engine.block_manager import BlockManager
from lumen_core.engine.cache import PagedKVCache
from lumen_core.engine.config import CacheConfig, SamplingParams, SchedulerConfig
from lumen_core.engine.connector import KVConnector, SavedTokens
from lumen_core.engine.model import Llama
from lumen_core.engine.request import Request
from lumen_core.engine.runner import Chunk, ModelRunner
from lumen_core.engine.sampler import sample_tokens
from lumen_core.engine.scheduler import ScheduledRequest, Scheduler
from lumen_core.verify import verify_draft


@dataclass(frozen=True)
class StepOutput:
    """What one step did.

    ``new_token_ids``: tokens appended per request this step (1 per decode, up to ``k + 1``
    per verified draft). ``saves``: slots and token ids of the KV written for accepted
    tokens (what a checkpoint streamer takes). ``num_draft_tokens`` / ``num_accepted``: per
    request that had drafts verified.
    """

    new_token_ids: dict[str, list[int]] = field(default_factory=dict)
    finished: dict[str, str] = field(default_factory=dict)
    saves: list[SavedTokens] = field(default_factory=list)
    num_draft_tokens: dict[str, int] = field(default_factory=dict)
    num_accepted: dict[str, int] = field(default_factory=dict)
    preempted: list[str] = field(default_factory=list)
    num_batched_tokens: int = 0


class _ConnectorPrefixLoader:
    """Adapts a ``KVConnector`` to the scheduler's ``PrefixLoader``."""

    def __init__(self, connector: KVConnector, block_manager: BlockManager) -> None:
        self.connector = connector
        self.block_manager = block_manager

    def num_matched_tokens(self, request: Request) -> int:
        return self.connector.get_num_new_matched_tokens(request)

    def load(self, request: Request, num_tokens: int) -> int:
        self.connector.start_load_kv(request, self.block_manager.slot_ids(request, 0, num_tokens))
        failed = self.connector.get_block_ids_with_load_errors()
        for index, block_id in enumerate(request.block_ids):
            if block_id in failed:
                return min(num_tokens, index * self.block_manager.block_size)
        return num_tokens


class Engine:
    """A continuous-batching engine over one model and its paged KV cache.

    ``add_request`` queues a request (with ``output_token_ids`` it resumes one whose outputs
    so far are known, e.g. after a failure: a ``connector`` that holds its checkpoint restores
    the prefix, the rest is prefilled); ``set_drafts`` hands draft tokens to verify in the
    next step; ``step`` runs one batch.
    """

    def __init__(
        self,
        model: Llama,
        cache_config: CacheConfig | None = None,
        scheduler_config: SchedulerConfig | None = None,
        *,
        connector: KVConnector | None = None,
    ) -> None:
        self.model = model
        self.cache_config = cache_config or CacheConfig()
        self.cache = PagedKVCache(model.config, self.cache_config, dtype=model.dtype, device=model.device)
        self.block_manager = BlockManager(self.cache_config.num_blocks, self.cache_config.block_size)
        self.runner = ModelRunner(model, self.cache)
        self.connector = connector
        loader = None
        if connector is not None:
            connector.register_kv_caches(self.cache.layout())
            loader = _ConnectorPrefixLoader(connector, self.block_manager)
        self.scheduler = Scheduler(
            scheduler_config or SchedulerConfig(),
            self.block_manager,
            prefix_loader=loader,
            before_free=self._before_free,
        )
        self.requests: dict[str, Request] = {}

    # ----------------------------------------------------------------- requests

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        params: SamplingParams | None = None,
        *,
        output_token_ids: Sequence[int] = (),
    ) -> Request:
        """Queue a request. ``output_token_ids`` are outputs it already produced elsewhere
        (they count towards ``max_tokens``). Raises TypeError / ValueError on bad arguments."""
        params = params if params is not None else SamplingParams()
        if not isinstance(request_id, str):
            raise TypeError(f"`request_id` must be a str, got {type(request_id).__name__}")
        if request_id in self.requests:
            raise ValueError(f"`request_id` must be new, got {request_id!r} (already present)")
        if not isinstance(params, SamplingParams):
            raise TypeError(f"`params` must be SamplingParams, got {type(params).__name__}")
        prompt = self._check_token_ids("prompt_token_ids", prompt_token_ids)
        outputs = self._check_token_ids("output_token_ids", output_token_ids)
        if not prompt:
            raise ValueError("`prompt_token_ids` must be non-empty, got 0 tokens")
        if len(outputs) >= params.max_tokens:
            raise ValueError(
                f"`output_token_ids` must be shorter than max_tokens={params.max_tokens}, got {len(outputs)}"
            )
        num_blocks = self.block_manager.num_blocks_for(len(prompt) + params.max_tokens)
        if num_blocks > self.cache_config.num_blocks:
            raise ValueError(
                f"`prompt_token_ids` plus max_tokens must fit the cache's "
                f"{self.cache_config.num_blocks} blocks, got {num_blocks} blocks"
            )
        request = Request(request_id, prompt + outputs, len(prompt), params)
        self.requests[request_id] = request
        self.scheduler.add(request)
        return request

    def set_drafts(
        self,
        request_id: str,
        draft_token_ids: Sequence[int],
        draft_probs: torch.Tensor | None = None,
    ) -> None:
        """Draft tokens to verify for ``request_id`` in its next decode step (replacing any).

        ``draft_probs`` ``[k, vocab_size]``: the draft's distribution at each draft position
        (``None``: a greedy, one-hot draft). Raises KeyError for an unknown request.
        """
        request = self.requests[request_id]
        drafts = self._check_token_ids("draft_token_ids", draft_token_ids)
        if draft_probs is not None:
            expected = (len(drafts), self.model.config.vocab_size)
            if not isinstance(draft_probs, torch.Tensor) or tuple(draft_probs.shape) != expected:
                got = tuple(draft_probs.shape) if isinstance(draft_probs, torch.Tensor) else draft_probs
                raise ValueError(f"`draft_probs` must have shape {expected}, got {got}")
        request.draft_token_ids = drafts
        request.draft_probs = draft_probs

    def abort(self, request_id: str) -> None:
        """Drop ``request_id`` (waiting or running) and free its pages."""
        request = self.requests.pop(request_id)
        self.scheduler.finish(request, "abort")
        if self.connector is not None:
            self.connector.request_finished(request_id)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    # --------------------------------------------------------------------- step

    def step(self) -> StepOutput:
        """Schedule and run one batch; append sampled or verified tokens; save; free."""
        plan = self.scheduler.schedule()
        chunks = [self._chunk(s) for s in plan.scheduled]
        logits = self.runner.execute(chunks)
        out = StepOutput(
            preempted=[r.request_id for r in plan.preempted],
            num_batched_tokens=plan.num_batched_tokens,
        )
        plain = [i for i, c in enumerate(chunks) if c.num_logits == 1]
        drafted = [i for i, s in enumerate(plan.scheduled) if s.num_draft_tokens > 0]
        new_tokens: dict[int, list[int]] = {}
        if plain:
            requests = [plan.scheduled[i].request for i in plain]
            tokens = sample_tokens(
                torch.cat([logits[i] for i in plain]),
                [r.params.temperature for r in requests],
                [r.params.seed for r in requests],
                [r.num_tokens for r in requests],
            )
            new_tokens.update({i: [t] for i, t in zip(plain, tokens, strict=True)})
        if drafted:
            new_tokens.update(self._verify([plan.scheduled[i] for i in drafted], drafted, logits))
        for i, s in enumerate(plan.scheduled):
            request = s.request
            start = request.num_computed_tokens
            tokens = new_tokens.get(i, [])
            # Tokens whose K and V this step wrote and that stay: the fed ones plus the
            # accepted drafts (the last emitted token is fed next step).
            num_kept = s.num_tokens - s.num_draft_tokens
            if s.num_draft_tokens:
                out.num_draft_tokens[request.request_id] = s.num_draft_tokens
                out.num_accepted[request.request_id] = len(tokens) - 1
                num_kept += len(tokens) - 1
            request.draft_token_ids = []
            request.draft_probs = None
            old_len = request.num_tokens
            request.token_ids.extend(tokens)
            reason = self._check_finished(request, old_len)
            num_kept = min(num_kept, request.num_tokens - start)
            request.num_computed_tokens = start + num_kept
            if s.num_draft_tokens:
                self.block_manager.truncate(request, request.num_computed_tokens)
            out.saves.append(
                SavedTokens(
                    request.request_id,
                    start,
                    tuple(chunks[i].slot_ids[:num_kept]),
                    tuple(request.token_ids[start : start + num_kept]),
                )
            )
            if tokens:
                out.new_token_ids[request.request_id] = request.token_ids[old_len:]
            if reason is not None:
                out.finished[request.request_id] = reason
        if self.connector is not None:
            self.connector.save_kv(out.saves)
        for request_id, reason in out.finished.items():
            request = self.requests.pop(request_id)
            self.scheduler.finish(request, reason)
            if self.connector is not None:
                self.connector.request_finished(request_id)
        return out

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        params: SamplingParams | Sequence[SamplingParams],
        *,
        step: Callable[[], StepOutput] | None = None,
        id_prefix: str = "generate",
    ) -> list[list[int]]:
        """Run ``prompts`` to completion together; the output token ids of each, in order.
        ``step`` advances the engine (default ``self.step``; a speculative decoder passes its
        own draft-and-verify step)."""
        step = self.step if step is None else step
        all_params = [params] * len(prompts) if isinstance(params, SamplingParams) else list(params)
        ids = [f"{id_prefix}-{len(self.requests)}-{i}" for i in range(len(prompts))]
        outputs: dict[str, list[int]] = {i: [] for i in ids}
        for request_id, prompt, p in zip(ids, prompts, all_params, strict=True):
            self.add_request(request_id, prompt, p)
        pending = set(ids)
        while pending:
            out = step()
            for request_id, tokens in out.new_token_ids.items():
                if request_id in outputs:
                    outputs[request_id].extend(tokens)
            pending -= out.finished.keys()
        return [outputs[i] for i in ids]

    # ---------------------------------------------------------------- internals

    def _chunk(self, s: ScheduledRequest) -> Chunk:
        request = s.request
        start = request.num_computed_tokens
        num_fed = s.num_tokens - s.num_draft_tokens
        token_ids = request.token_ids[start : start + num_fed]
        token_ids = token_ids + request.draft_token_ids[: s.num_draft_tokens]
        ends_known_tokens = start + num_fed == request.num_tokens
        return Chunk(
            token_ids=token_ids,
            start_position=start,
            slot_ids=self.block_manager.slot_ids(request, start, start + s.num_tokens),
            block_ids=list(request.block_ids),
            num_logits=s.num_draft_tokens + 1 if ends_known_tokens else 0,
        )

    def _verify(
        self, scheduled: list[ScheduledRequest], indices: list[int], logits: list[torch.Tensor]
    ) -> dict[int, list[int]]:
        requests = [s.request for s in scheduled]
        ks = [s.num_draft_tokens for s in scheduled]
        target = torch.cat([logits[i] for i in indices]).to("cpu", torch.float64)
        draft_ids = torch.tensor(
            [t for r, k in zip(requests, ks, strict=True) for t in r.draft_token_ids[:k]],
            dtype=torch.long,
        )
        draft_probs = None
        if any(r.draft_probs is not None for r in requests):
            vocab = self.model.config.vocab_size
            rows = []
            for r, k in zip(requests, ks, strict=True):
                if r.draft_probs is None:
                    rows.append(
                        torch.nn.functional.one_hot(draft_ids.new_tensor(r.draft_token_ids[:k]), vocab)
                    )
                else:
                    rows.append(r.draft_probs[:k])
            draft_probs = torch.cat([row.to(torch.float64) for row in rows])
        result = verify_draft(
            target,
            draft_ids,
            draft_probs,
            num_draft_tokens=torch.tensor(ks, dtype=torch.long),
            temperature=torch.tensor([r.params.temperature for r in requests], dtype=torch.float64),
            # verify_draft reads int64 seeds as uint64 bits: pass seeds >= 2**63 wrapped.
            seeds=torch.tensor(
                [r.params.seed - (r.params.seed >= 2**63) * 2**64 for r in requests],
                dtype=torch.long,
            ),
            positions=torch.tensor([r.num_tokens for r in requests], dtype=torch.long),
        )
        emitted = result.output_token_ids.tolist()
        counts = result.num_emitted.tolist()
        return {i: emitted[j][: counts[j]] for j, i in enumerate(indices)}

    def _check_finished(self, request: Request, old_len: int) -> str | None:
        """Cut ``request.token_ids`` after an EOS among the new tokens or at max_tokens and
        say why it finished, or return None."""
        limit = request.num_prompt_tokens + request.params.max_tokens
        eos = request.params.eos_token_id
        for p in range(old_len, min(limit, request.num_tokens)):
            if request.token_ids[p] == eos:
                del request.token_ids[p + 1 :]
                return "stop"
        if request.num_tokens >= limit:
            del request.token_ids[limit:]
            return "length"
        return None

    def _before_free(self, request: Request) -> None:
        if self.connector is not None:
            self.connector.wait_for_save(request.request_id)

    def _check_token_ids(self, name: str, token_ids: Sequence[int]) -> list[int]:
        if isinstance(token_ids, torch.Tensor):
            token_ids = token_ids.tolist()
        if not isinstance(token_ids, Sequence) or isinstance(token_ids, str):
            raise TypeError(f"`{name}` must be a sequence of ints, got {type(token_ids).__name__}")
        ids = [int(t) for t in token_ids]
        vocab = self.model.config.vocab_size
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"`{name}` must be token ids in [0, {vocab}), got {bad[0]}")
        return ids
