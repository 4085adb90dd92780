"""Speculative decoding with a draft model: the draft/target pair, the draft proposer (the
assistant's side) and a driver that verifies the drafts on the engine (the survivor's side)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace

import torch

from lumen_core.engine.block_manager import BlockManager
from lumen_core.engine.cache import PagedKVCache
from lumen_core.engine.config import CacheConfig, ModelConfig, SamplingParams
from lumen_core.engine.engine import Engine, StepOutput
from lumen_core.engine.model import Llama, random_weights
from lumen_core.engine.request import Request, RequestStatus
from lumen_core.engine.runner import Chunk, ModelRunner


def truncated_draft(target: Llama, num_layers: int) -> Llama:
    """A draft made of ``target``'s embeddings, first ``num_layers`` layers, final norm and LM
    head (copies, so it can be saved and loaded on its own). Same vocabulary by construction."""
    if not 1 <= num_layers <= target.config.num_layers:
        raise ValueError(f"`num_layers` must be in [1, {target.config.num_layers}], got {num_layers}")
    draft = Llama(replace(target.config, num_layers=num_layers))
    state = {
        name: tensor
        for name, tensor in target.state_dict().items()
        if not name.startswith("model.layers.") or int(name.split(".")[2]) < num_layers
    }
    draft.load_state_dict(state)
    return draft.to(device=target.device, dtype=target.dtype)


def build_draft_pair(
    config: ModelConfig,
    *,
    seed: int,
    draft_num_layers: int,
    late_layer_scale: float,
    dtype: str | torch.dtype = "float32",
) -> tuple[Llama, Llama]:
    """``(target, draft)``: the target's layers past the first ``draft_num_layers`` write
    their residual branches at ``late_layer_scale`` of the usual size, and the draft is the
    target truncated to ``draft_num_layers`` layers. The scale sets how often the two agree:
    0 makes them identical, 1 gives an unrelated-looking draft (bench/RESULTS.md has measured
    acceptance rates)."""
    if not 1 <= draft_num_layers < config.num_layers:
        raise ValueError(
            f"`draft_num_layers` must be in [1, {config.num_layers - 1}], got {draft_num_layers}"
        )
    if not late_layer_scale >= 0.0:
        raise ValueError(f"`late_layer_scale` must be >= 0, got {late_layer_scale}")
    scales = [1.0] * draft_num_layers + [late_layer_scale] * (config.num_layers - draft_num_layers)
    target = random_weights(config, seed=seed, dtype=dtype, layer_output_scales=scales)
    return target, truncated_draft(target, draft_num_layers)


class DraftProposer:
    """Proposes greedy drafts from a draft model that keeps its own paged KV per request.

    ``propose`` takes each request's authoritative token ids; the proposer keeps the KV of
    the longest prefix it already computed that still matches (rolling back rejected
    drafts), computes the rest (the first call per request is its cold-start prefill), then
    drafts. Requests for which the draft cache has no room get shorter (or no) drafts.
    """

    def __init__(self, model: Llama, cache_config: CacheConfig | None = None) -> None:
        self.model = model
        self.cache_config = cache_config or CacheConfig()
        self.cache = PagedKVCache(model.config, self.cache_config, dtype=model.dtype, device=model.device)
        self.block_manager = BlockManager(self.cache_config.num_blocks, self.cache_config.block_size)
        self.runner = ModelRunner(model, self.cache)
        self._requests: dict[str, Request] = {}

    def propose(self, token_ids: Mapping[str, Sequence[int]], num_draft_tokens: int) -> dict[str, list[int]]:
        """Up to ``num_draft_tokens`` greedy draft tokens for each request of ``token_ids``."""
        if num_draft_tokens < 0:
            raise ValueError(f"`num_draft_tokens` must be >= 0, got {num_draft_tokens}")
        active: list[Request] = []
        for request_id, tokens in token_ids.items():
            request = self._requests.get(request_id)
            if request is None:
                request = Request(request_id, [], 0, SamplingParams())
                self._requests[request_id] = request
            common = 0
            for a, b in zip(request.token_ids[: request.num_computed_tokens], tokens, strict=False):
                if a != b:
                    break
                common += 1
            # Recompute at least the last token: its logits give the first draft (the KV of
            # every token may already be there when the tokens grew by drafts it made).
            common = min(common, len(tokens) - 1)
            request.num_computed_tokens = common
            self.block_manager.truncate(request, common)
            request.token_ids = [int(t) for t in tokens]
            request.num_prompt_tokens = len(request.token_ids)
            active.append(request)
        for _ in range(num_draft_tokens):
            active = [r for r in active if self.block_manager.can_allocate(r, r.num_tokens)]
            if not active:
                break
            chunks = []
            for r in active:
                self.block_manager.allocate(r, r.num_tokens)
                start = r.num_computed_tokens
                chunks.append(
                    Chunk(
                        r.token_ids[start:],
                        start,
                        self.block_manager.slot_ids(r, start, r.num_tokens),
                        list(r.block_ids),
                        1,
                    )
                )
            logits = self.runner.execute(chunks)
            for r, row in zip(active, logits, strict=True):
                r.num_computed_tokens = r.num_tokens
                r.token_ids.append(int(row[0].argmax()))
        return {
            request_id: self._requests[request_id].token_ids[len(tokens) :]
            for request_id, tokens in token_ids.items()
        }

    def release(self, request_id: str) -> None:
        """Forget ``request_id`` and free its draft KV (no-op if unknown)."""
        request = self._requests.pop(request_id, None)
        if request is not None:
            self.block_manager.free(request)


@dataclass
class SpecStats:
    """Counts over a speculative run (per request and verify step)."""

    num_verify_steps: int = 0
    num_draft_tokens: int = 0
    num_accepted: int = 0
    num_rejected: int = 0
    num_emitted: int = 0

    @property
    def acceptance_rate(self) -> float:
        """Accepted / proposed drafts (docs/design.md, Metrics). Drafts after a rejection count
        as not accepted although they were never tested."""
        return self.num_accepted / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def chain_acceptance_rate(self) -> float:
        """Accepted / tested drafts: the per-position acceptance probability ``a`` that
        ``policy.expected_tokens_per_step`` assumes (a chain stops at its first rejection)."""
        tested = self.num_accepted + self.num_rejected
        return self.num_accepted / tested if tested else 0.0

    @property
    def tokens_per_verify_step(self) -> float:
        """Tokens emitted per request per verify (accepted drafts + 1)."""
        return self.num_emitted / self.num_verify_steps if self.num_verify_steps else 0.0


class SpeculativeDecoder:
    """Drives ``engine`` with drafts from ``proposer``: before each step, every decoding
    request gets up to ``num_draft_tokens`` drafts (fewer near its ``max_tokens``), which the
    step verifies with ``verify_draft``. Greedy requests give exactly the engine's greedy
    output; sampled ones the target distribution."""

    def __init__(self, engine: Engine, proposer: DraftProposer, num_draft_tokens: int) -> None:
        if num_draft_tokens < 1:
            raise ValueError(f"`num_draft_tokens` must be >= 1, got {num_draft_tokens}")
        self.engine = engine
        self.proposer = proposer
        self.num_draft_tokens = num_draft_tokens
        self.stats = SpecStats()

    def step(self) -> StepOutput:
        decoding = {
            r.request_id: r.token_ids
            for r in self.engine.scheduler.running
            if r.status is RequestStatus.RUNNING and r.num_uncomputed_tokens == 1
        }
        drafts = self.proposer.propose(decoding, self.num_draft_tokens)
        for request_id, tokens in drafts.items():
            request = self.engine.requests[request_id]
            room = request.params.max_tokens - request.num_output_tokens - 1
            if tokens[:room]:
                self.engine.set_drafts(request_id, tokens[:room])
        out = self.engine.step()
        for request_id, k in out.num_draft_tokens.items():
            self.stats.num_verify_steps += 1
            self.stats.num_draft_tokens += k
            self.stats.num_accepted += out.num_accepted[request_id]
            self.stats.num_rejected += int(out.num_accepted[request_id] < k)
            self.stats.num_emitted += out.num_accepted[request_id] + 1
        for request_id in out.finished:
            self.proposer.release(request_id)
        return out

    def generate(
        self, prompts: Sequence[Sequence[int]], params: SamplingParams | Sequence[SamplingParams]
    ) -> list[list[int]]:
        """Like ``Engine.generate``, with drafts verified at every decode step."""
        return self.engine.generate(prompts, params, step=self.step, id_prefix="spec")
