"""The request bodies the front door accepts (a subset of OpenAI's), validated by pydantic.

Unknown fields are refused (400), as OpenAI's own API does, so that a parameter the workers
would not honour (``logprobs``, ``presence_penalty``, ...) never passes silently. Types are
strict: ``"5"`` is not a ``max_tokens``.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from lumen_core.gateway.http.config import MAX_STOP_CHARS, MAX_STOP_SEQUENCES

_STRICT = ConfigDict(extra="forbid", strict=True)


class StreamOptions(BaseModel):
    model_config = _STRICT
    include_usage: bool = False


class _Sampling(BaseModel):
    """Fields both endpoints share. No ``temperature`` (or 0) is greedy decoding; ``top_p``
    below 1 is refused by the app (the workers' sampler has no nucleus cut)."""

    model_config = _STRICT
    model: str
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    seed: int | None = Field(default=None, ge=0, lt=2**63)
    stop: str | list[str] | None = None
    n: int = Field(default=1, ge=1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = Field(default=None, max_length=256)

    def stop_sequences(self) -> tuple[str, ...]:
        """``stop`` as a tuple (empty strings dropped). Raises ValueError past OpenAI's bounds."""
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        stops = [s for s in stops if s]
        if len(stops) > MAX_STOP_SEQUENCES:
            raise ValueError(f"`stop` must hold at most {MAX_STOP_SEQUENCES} sequences, got {len(stops)}")
        for stop in stops:
            if len(stop) > MAX_STOP_CHARS:
                raise ValueError(
                    f"`stop` sequences must be at most {MAX_STOP_CHARS} characters, got {len(stop)}"
                )
        return tuple(stops)


class CompletionRequest(_Sampling):
    """``prompt``: text (needs a tokenizer) or token ids."""

    prompt: str | list[int]


class ResumeRequest(BaseModel):
    """``POST /v1/resume``: the response ``id`` of a stream, the number of output tokens the
    client has (``position``), and the stream's ``x-lumen-resume-token``."""

    model_config = _STRICT
    id: str = Field(pattern=r"^(cmpl|chatcmpl)-[0-9]{1,19}$")
    position: int = Field(ge=0)
    resume_token: str = Field(min_length=64, max_length=64)
    stream_options: StreamOptions | None = None


class ChatMessage(BaseModel):
    model_config = _STRICT
    role: Literal["system", "user", "assistant"]
    content: str


class ChatCompletionRequest(_Sampling):
    """``messages`` go through the tokenizer's chat template; ``max_completion_tokens`` is the
    newer name of ``max_tokens`` (give at most one)."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
