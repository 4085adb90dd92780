"""Configuration of the reference engine: the model shape, the KV cache and the scheduler."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from lumen_core._validate import check_int

_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float64": torch.float64,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}


@dataclass(frozen=True)
class ModelConfig:
    """Shape of a Llama-style decoder (the field names follow transformers' ``LlamaConfig``).

    The default is the tiny model the CPU tests, benchmark and demo use.
    """

    vocab_size: int = 256
    hidden_size: int = 64
    intermediate_size: int = 128
    num_layers: int = 4
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 16
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 4096

    def __post_init__(self) -> None:
        for name in (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_layers",
            "num_heads",
            "num_kv_heads",
            "head_dim",
            "max_position_embeddings",
        ):
            check_int(name, getattr(self, name), low=1)
        if self.num_heads % self.num_kv_heads != 0:
            raise ValueError(
                f"`num_heads` must be a multiple of `num_kv_heads` ({self.num_kv_heads}), "
                f"got {self.num_heads}"
            )
        if self.head_dim % 2 != 0:
            raise ValueError(f"`head_dim` must be even (RoPE rotates pairs), got {self.head_dim}")
        if self.rope_theta <= 0 or self.rms_norm_eps <= 0:
            raise ValueError(
                f"`rope_theta` and `rms_norm_eps` must be > 0, got {self.rope_theta} and {self.rms_norm_eps}"
            )

    def kv_bytes_per_token(self, dtype: torch.dtype) -> int:
        """Bytes of K and V of one token over all layers (docs/data_plane.md)."""
        element_bytes = torch.empty((), dtype=dtype).element_size()
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * element_bytes


@dataclass(frozen=True)
class CacheConfig:
    """Paged KV cache: ``num_blocks`` pages of ``block_size`` token slots per layer."""

    num_blocks: int = 512
    block_size: int = 16

    def __post_init__(self) -> None:
        check_int("num_blocks", self.num_blocks, low=1)
        check_int("block_size", self.block_size, low=1)


@dataclass(frozen=True)
class SchedulerConfig:
    """Continuous batching limits.

    ``max_num_batched_tokens`` is the token budget of one step (prefill chunks, decode tokens
    and draft tokens together); ``max_num_seqs`` caps the running requests.
    """

    max_num_batched_tokens: int = 512
    max_num_seqs: int = 64

    def __post_init__(self) -> None:
        check_int("max_num_batched_tokens", self.max_num_batched_tokens, low=1)
        check_int("max_num_seqs", self.max_num_seqs, low=1)


@dataclass(frozen=True)
class SamplingParams:
    """How one request samples: ``temperature`` 0 is greedy; otherwise the token at position
    ``p`` is drawn with the package's Philox uniform keyed by ``(seed, p)``, so it does not
    depend on the batch it ran in. Generation stops after ``max_tokens`` new tokens or at
    ``eos_token_id`` (``None``: never)."""

    temperature: float = 0.0
    seed: int = 0
    max_tokens: int = 16
    eos_token_id: int | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.temperature, (int, float)) or isinstance(self.temperature, bool):
            raise TypeError(f"`temperature` must be a float, got {type(self.temperature).__name__}")
        if not self.temperature >= 0.0:
            raise ValueError(f"`temperature` must be >= 0, got {self.temperature}")
        if not isinstance(self.seed, int) or not 0 <= self.seed < 2**64:
            raise ValueError(f"`seed` must be an int in [0, 2**64), got {self.seed!r}")
        check_int("max_tokens", self.max_tokens, low=1)


def resolve_dtype(dtype: str | torch.dtype) -> torch.dtype:
    """A torch dtype from a name such as ``"float64"`` or a torch dtype."""
    if isinstance(dtype, torch.dtype):
        if dtype not in _DTYPES.values():
            raise ValueError(f"`dtype` must be one of {sorted(_DTYPES)}, got {dtype}")
        return dtype
    if not isinstance(dtype, str):
        raise TypeError(f"`dtype` must be a str or torch.dtype, got {type(dtype).__name__}")
    if dtype not in _DTYPES:
        raise ValueError(f"`dtype` must be one of {sorted(_DTYPES)}, got {dtype!r}")
    return _DTYPES[dtype]
