"""A Llama-style decoder (RMSNorm, RoPE, grouped-query attention, SwiGLU) in plain torch.

Parameter names equal those of transformers' ``LlamaForCausalLM``, so one state dict loads
into both (the tests use that as an independent check). Attention is a callable handed to
``forward``: the runner passes paged attention over the KV cache, the tests a contiguous one.
Weights are seeded random (no downloads) and are saved to / loaded from a file, so a
restarted worker really reloads them.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Protocol

import torch
from torch import nn
from torch.nn import functional as F

from lumen_core.engine.config import ModelConfig, resolve_dtype

_FILE_FORMAT = "lumen_core.engine.weights/1"


class Attention(Protocol):
    """Attention of one layer over a flat batch of ``T`` new tokens.

    ``q`` is ``[T, num_heads, head_dim]``, ``k`` and ``v`` are ``[T, num_kv_heads, head_dim]``
    (RoPE applied); returns ``[T, num_heads, head_dim]``. A paged implementation also writes
    ``k`` and ``v`` into its cache.
    """

    def __call__(self, layer_id: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor: ...


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        variance = x.pow(2).mean(-1, keepdim=True)
        return self.weight * (x * torch.rsqrt(variance + self.eps))


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class RotaryEmbedding(nn.Module):
    """Non-interleaved RoPE (pairs ``i`` and ``i + head_dim/2``), as in transformers' Llama."""

    def __init__(self, head_dim: int, theta: float) -> None:
        super().__init__()
        exponent = torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim
        self.register_buffer("inv_freq", 1.0 / (theta**exponent), persistent=False)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin ``[T, 1, head_dim]`` for ``positions`` ``[T]``."""
        freqs = positions.to(torch.float64)[:, None] * self.inv_freq[None, :]
        angles = torch.cat((freqs, freqs), dim=-1)[:, None, :]
        return angles.cos().to(dtype), angles.sin().to(dtype)


class LlamaAttention(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        h, d = config.hidden_size, config.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = (
            config.num_heads,
            config.num_kv_heads,
            config.head_dim,
        )
        self.q_proj = nn.Linear(h, config.num_heads * d, bias=False)
        self.k_proj = nn.Linear(h, config.num_kv_heads * d, bias=False)
        self.v_proj = nn.Linear(h, config.num_kv_heads * d, bias=False)
        self.o_proj = nn.Linear(config.num_heads * d, h, bias=False)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        layer_id: int,
        attention: Attention,
    ) -> torch.Tensor:
        num_tokens = x.shape[0]
        q = self.q_proj(x).view(num_tokens, self.num_heads, self.head_dim)
        k = self.k_proj(x).view(num_tokens, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).view(num_tokens, self.num_kv_heads, self.head_dim)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        out = attention(layer_id, q, k, v)
        return self.o_proj(out.reshape(num_tokens, self.num_heads * self.head_dim))


class LlamaMLP(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        h, f = config.hidden_size, config.intermediate_size
        self.gate_proj = nn.Linear(h, f, bias=False)
        self.up_proj = nn.Linear(h, f, bias=False)
        self.down_proj = nn.Linear(f, h, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(config)
        self.mlp = LlamaMLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        layer_id: int,
        attention: Attention,
    ) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, layer_id, attention)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaBackbone(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(LlamaDecoderLayer(config) for _ in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class Llama(nn.Module):
    """The decoder with its LM head; ``forward`` computes logits of chosen token rows only."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.model = LlamaBackbone(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.rotary = RotaryEmbedding(config.head_dim, config.rope_theta)

    @property
    def dtype(self) -> torch.dtype:
        return self.lm_head.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.lm_head.weight.device

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        attention: Attention,
        logits_indices: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Logits ``[n, vocab_size]`` (model dtype) of the rows ``logits_indices`` (all if None).

        ``input_ids`` and ``positions`` are ``[T]`` int64 on the model's device: a flat batch
        of new tokens of one or more requests, laid out as ``attention`` expects.
        """
        cos, sin = self.rotary(positions, self.dtype)
        x = self.model.embed_tokens(input_ids)
        for layer_id, layer in enumerate(self.model.layers):
            x = layer(x, cos, sin, layer_id, attention)
        if logits_indices is not None:
            x = x[logits_indices]
        return self.lm_head(self.model.norm(x))


class CausalAttention:
    """Contiguous causal attention for requests that start at position 0 (no cache).

    ``seq_lens`` gives the length of each request in the flat batch, in order. This is the
    textbook form the paged attention of the runner is tested against.
    """

    def __init__(self, seq_lens: Sequence[int]) -> None:
        self.seq_lens = list(seq_lens)

    def __call__(self, layer_id: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        outs = []
        start = 0
        group = q.shape[1] // k.shape[1]
        for n in self.seq_lens:
            qs = q[start : start + n].transpose(0, 1)
            ks = k[start : start + n].repeat_interleave(group, dim=1).transpose(0, 1)
            vs = v[start : start + n].repeat_interleave(group, dim=1).transpose(0, 1)
            outs.append(F.scaled_dot_product_attention(qs, ks, vs, is_causal=True).transpose(0, 1))
            start += n
        return torch.cat(outs, dim=0)


def forward_contiguous(model: Llama, sequences: Sequence[Sequence[int]]) -> list[torch.Tensor]:
    """Logits ``[len(s), vocab_size]`` of every position of each token sequence, no cache."""
    if not sequences or any(len(s) == 0 for s in sequences):
        raise ValueError("`sequences` must be a non-empty list of non-empty token lists")
    ids = torch.tensor([t for s in sequences for t in s], dtype=torch.long, device=model.device)
    positions = torch.cat([torch.arange(len(s)) for s in sequences]).to(model.device)
    logits = model(ids, positions, CausalAttention([len(s) for s in sequences]))
    return list(logits.split([len(s) for s in sequences]))


def random_weights(
    config: ModelConfig,
    *,
    seed: int,
    dtype: str | torch.dtype = "float32",
    layer_output_scales: Sequence[float] | None = None,
) -> Llama:
    """A model with seeded random weights (deterministic across runs and machines).

    Linear layers are N(0, 1/fan_in), embeddings N(0, 1) and the LM head N(0, 2.5^2/hidden),
    so that logits have a standard deviation of about 2.5 (peaked but not one-hot
    distributions, like a trained model's). ``layer_output_scales[i]`` multiplies the two
    residual-branch outputs (``o_proj``, ``down_proj``) of layer ``i``: a small scale makes that
    layer a small correction, which is how a draft/target pair is built (``draft.py``).
    """
    torch_dtype = resolve_dtype(dtype)
    if layer_output_scales is not None and len(layer_output_scales) != config.num_layers:
        raise ValueError(
            f"`layer_output_scales` must have num_layers={config.num_layers} entries, "
            f"got {len(layer_output_scales)}"
        )
    generator = torch.Generator().manual_seed(seed)
    model = Llama(config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("layernorm.weight") or name == "model.norm.weight":
                param.fill_(1.0)
                continue
            values = torch.randn(param.shape, generator=generator, dtype=torch.float64)
            if name == "model.embed_tokens.weight":
                std = 1.0
            elif name == "lm_head.weight":
                std = 2.5 / math.sqrt(config.hidden_size)
            else:
                std = 1.0 / math.sqrt(param.shape[1])
            if layer_output_scales is not None and name.endswith(("o_proj.weight", "down_proj.weight")):
                std *= layer_output_scales[int(name.split(".")[2])]
            param.copy_(values * std)
    return model.to(torch_dtype)


def model_fingerprint(model: Llama) -> str:
    """Hex digest of the config and every weight's dtype, shape and bytes: a checkpoint made
    with one model is only restored into the same model."""
    digest = hashlib.sha256(json.dumps(asdict(model.config), sort_keys=True).encode())
    for name, tensor in model.state_dict().items():
        digest.update(f"{name}:{tensor.dtype}:{tuple(tensor.shape)}".encode())
        digest.update(tensor.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()[:32]


def save_model(model: Llama, path: str | os.PathLike[str]) -> None:
    """Write the config and weights of ``model`` to ``path`` (torch.save of plain tensors)."""
    state = {name: tensor.detach().cpu().clone() for name, tensor in model.state_dict().items()}
    torch.save({"format": _FILE_FORMAT, "config": asdict(model.config), "state_dict": state}, path)


def load_model(
    path: str | os.PathLike[str],
    *,
    dtype: str | torch.dtype | None = None,
    device: str | torch.device = "cpu",
) -> Llama:
    """A model read from a file written by ``save_model``, or from a transformers Llama
    directory (``engine.pretrained.load_pretrained``), in its saved dtype unless given.

    Raises ValueError when the file is not such a file or its weights do not fit its config.
    """
    if Path(path).is_dir():
        from lumen_core.engine.pretrained import load_pretrained  # it imports this module

        return load_pretrained(path, dtype=dtype, device=device)
    payload = torch.load(path, map_location="cpu", weights_only=True)
    if not isinstance(payload, dict) or payload.get("format") != _FILE_FORMAT:
        raise ValueError(f"`path` must be a file written by save_model, got {os.fspath(path)!r}")
    config = ModelConfig(**payload["config"])
    state = payload["state_dict"]
    model = Llama(config)
    missing, unexpected = model.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise ValueError(
            f"`path` weights must match its config, got missing {missing} unexpected {unexpected}"
        )
    saved_dtype = next(iter(state.values())).dtype
    return model.to(device=device, dtype=resolve_dtype(dtype) if dtype is not None else saved_dtype)
