"""Reference engine: a small Llama-style model with paged KV (vLLM flash layout), continuous
batching, chunked prefill, draft verification and LUMEN checkpoint hooks (docs/engine.md)."""

from lumen_core.engine.config import CacheConfig, ModelConfig, SamplingParams, SchedulerConfig
from lumen_core.engine.connector import (
    Checkpoint,
    HostCheckpointConnector,
    KVConnector,
    SavedTokens,
)
from lumen_core.engine.draft import (
    DraftProposer,
    SpecStats,
    SpeculativeDecoder,
    build_draft_pair,
    truncated_draft,
)
from lumen_core.engine.engine import Engine, StepOutput
from lumen_core.engine.model import (
    Llama,
    forward_contiguous,
    load_model,
    model_fingerprint,
    random_weights,
    save_model,
)
from lumen_core.engine.pretrained import load_pretrained, pretrained_config

__all__ = [
    "CacheConfig",
    "Checkpoint",
    "DraftProposer",
    "Engine",
    "HostCheckpointConnector",
    "KVConnector",
    "Llama",
    "ModelConfig",
    "SamplingParams",
    "SavedTokens",
    "SchedulerConfig",
    "SpecStats",
    "SpeculativeDecoder",
    "StepOutput",
    "build_draft_pair",
    "forward_contiguous",
    "load_model",
    "load_pretrained",
    "model_fingerprint",
    "pretrained_config",
    "random_weights",
    "save_model",
    "truncated_draft",
]
