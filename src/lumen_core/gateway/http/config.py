"""FrontDoorConfig: what the front door serves and the bounds every request is checked against."""

from __future__ import annotations

from dataclasses import dataclass

from lumen_core._validate import check_int

MAX_STOP_SEQUENCES = 4  # OpenAI's limit
MAX_STOP_CHARS = 256  # per stop sequence: the front door holds back this much streamed text
ENGINES = ("reference", "vllm")


@dataclass(frozen=True)
class FrontDoorConfig:
    """model_name: the one model id served (``GET /v1/models``; any other is a 404).
    vocab_size: token ids must be below it (a worker's embedding lookup never sees a bad id).
    max_model_len: prompt tokens + ``max_tokens`` must fit in it. max_concurrent_requests:
    requests in flight at once; one more is a 429. max_body_bytes: larger bodies are a 400.
    engine: what the workers run. "reference": seeded draws are keyed by output position, so a
    request moved by a failover draws the same tokens. "vllm": a server's per-request
    generator starts again at the resume point, so a moved seeded stream at temperature > 0
    is marked ``resumed_inexact`` from then on (docs/front_door.md)."""

    model_name: str
    vocab_size: int
    max_model_len: int = 4096
    max_concurrent_requests: int = 64
    max_body_bytes: int = 1 << 20
    engine: str = "reference"

    def __post_init__(self) -> None:
        if self.engine not in ENGINES:
            raise ValueError(f"`engine` must be one of {ENGINES}, got {self.engine!r}")
        if not isinstance(self.model_name, str) or not self.model_name.strip():
            raise ValueError(f"`model_name` must be a non-empty str, got {self.model_name!r}")
        check_int("vocab_size", self.vocab_size, low=1)
        check_int("max_model_len", self.max_model_len, low=2)
        check_int("max_concurrent_requests", self.max_concurrent_requests, low=1)
        check_int("max_body_bytes", self.max_body_bytes, low=64)
