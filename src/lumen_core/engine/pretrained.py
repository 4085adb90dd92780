"""Llama models in transformers' ``save_pretrained`` format (``config.json`` and
``*.safetensors``), the files vLLM serves, loaded into the reference engine's ``Llama``.

The reference model's parameter names are transformers' ``LlamaForCausalLM``'s, so the
weights load by name; the config's fields map onto ``ModelConfig``. Anything the reference
model does not compute (biases, another activation, RoPE scaling, another architecture such
as Qwen3's q/k norms) is refused rather than silently ignored.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch

from lumen_core.engine.config import ModelConfig, resolve_dtype
from lumen_core.engine.model import Llama


def _rope_theta(config: dict[str, Any]) -> float:
    """The RoPE base from either spelling: ``rope_parameters`` (transformers 5) or
    ``rope_theta`` with ``rope_scaling`` (earlier); only unscaled RoPE is computed here."""
    params = config.get("rope_parameters") or {}
    scaling = config.get("rope_scaling") or {}
    kind = params.get("rope_type", scaling.get("rope_type", scaling.get("type", "default")))
    if kind != "default":
        raise ValueError(f"`config.json` must use unscaled RoPE (rope_type 'default'), got {kind!r}")
    return float(params.get("rope_theta", config.get("rope_theta", 10000.0)))


def pretrained_config(model_dir: str | os.PathLike[str]) -> ModelConfig:
    """The ``ModelConfig`` of a transformers Llama directory.

    Raises:
        ValueError: no ``config.json``, or a config the reference model does not compute.
    """
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise ValueError(f"`model_dir` must hold a config.json, got {os.fspath(model_dir)!r}")
    config = json.loads(path.read_text())
    if config.get("model_type") != "llama":
        raise ValueError(
            f"`config.json` must describe a Llama (model_type 'llama'), got {config.get('model_type')!r}"
        )
    unsupported = {
        "hidden_act": ("silu", config.get("hidden_act", "silu")),
        "attention_bias": (False, config.get("attention_bias", False)),
        "mlp_bias": (False, config.get("mlp_bias", False)),
    }
    for name, (wanted, got) in unsupported.items():
        if got != wanted:
            raise ValueError(
                f"`config.json` must have {name}={wanted!r} (what the reference model computes), got {got!r}"
            )
    heads = int(config["num_attention_heads"])
    return ModelConfig(
        vocab_size=int(config["vocab_size"]),
        hidden_size=int(config["hidden_size"]),
        intermediate_size=int(config["intermediate_size"]),
        num_layers=int(config["num_hidden_layers"]),
        num_heads=heads,
        num_kv_heads=int(config.get("num_key_value_heads") or heads),
        head_dim=int(config.get("head_dim") or int(config["hidden_size"]) // heads),
        rope_theta=_rope_theta(config),
        rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)),
        max_position_embeddings=int(config.get("max_position_embeddings", 4096)),
    )


def load_pretrained(
    model_dir: str | os.PathLike[str],
    *,
    dtype: str | torch.dtype | None = None,
    device: str | torch.device = "cpu",
) -> Llama:
    """A ``Llama`` with the weights of a transformers Llama directory, in the weights' dtype
    unless ``dtype`` is given. Tied embeddings (no ``lm_head.weight`` in the files, and
    ``tie_word_embeddings``) share the embedding's weights.

    Raises:
        ValueError: see ``pretrained_config``; no ``*.safetensors`` file, or weights that are
            missing, unexpected or of the wrong shape for the config.
    """
    from safetensors.torch import load_file  # only this loader needs it

    config = pretrained_config(model_dir)
    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        raise ValueError(f"`model_dir` must hold *.safetensors weights, got {os.fspath(model_dir)!r}")
    state: dict[str, torch.Tensor] = {}
    for file in files:
        state.update(load_file(file))
    tied = json.loads((Path(model_dir) / "config.json").read_text()).get("tie_word_embeddings", False)
    if "lm_head.weight" not in state and tied and "model.embed_tokens.weight" in state:
        state["lm_head.weight"] = state["model.embed_tokens.weight"]
    model = Llama(config)
    try:
        missing, unexpected = model.load_state_dict(state, strict=False)
    except RuntimeError as exc:  # a shape mismatch
        raise ValueError(f"`model_dir` weights must fit its config.json: {exc}") from None
    if missing or unexpected:
        raise ValueError(
            f"`model_dir` weights must match its config.json, got missing {missing} unexpected {unexpected}"
        )
    saved_dtype = next(iter(state.values())).dtype
    return model.to(device=device, dtype=resolve_dtype(dtype) if dtype is not None else saved_dtype)
