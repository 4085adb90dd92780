"""A request as the scheduler and block manager see it: token ids, cache progress, pages."""

from __future__ import annotations

import enum

import torch

from lumen_core.engine.config import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class Request:
    """One generation request.

    ``token_ids`` holds the prompt followed by the outputs so far; the first
    ``num_computed_tokens`` of them have their K and V in the pages ``block_ids`` (token ``i``
    lives in slot ``block_ids[i // block_size] * block_size + i % block_size``). The last
    sampled token is not in the cache until the next step feeds it. ``draft_token_ids`` are
    proposals to verify in the next step (speculative assist), with their draft
    probabilities ``[k, vocab_size]`` or ``None`` for a greedy (one-hot) draft.
    """

    def __init__(
        self,
        request_id: str,
        token_ids: list[int],
        num_prompt_tokens: int,
        params: SamplingParams,
    ) -> None:
        self.request_id = request_id
        self.token_ids = token_ids
        self.num_prompt_tokens = num_prompt_tokens
        self.params = params
        self.status = RequestStatus.WAITING
        self.finish_reason: str | None = None
        self.num_computed_tokens = 0
        self.block_ids: list[int] = []
        self.draft_token_ids: list[int] = []
        self.draft_probs: torch.Tensor | None = None
        self.num_loaded_tokens = 0

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_uncomputed_tokens(self) -> int:
        """Tokens whose K and V are not in the cache yet (1 while decoding)."""
        return len(self.token_ids) - self.num_computed_tokens

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, {self.status.value}, tokens={self.num_tokens}, "
            f"computed={self.num_computed_tokens}, blocks={len(self.block_ids)})"
        )
