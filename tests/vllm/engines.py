"""Helpers of the vLLM tests: tiny models built here, engine arguments, and the holder checks.

Models are random Llama weights saved with ``save_pretrained``; the LM head is scaled so the
top-2 logit gap at every greedy position is far above fp32 noise (tests assert it from the
reference run's logprobs), so token-for-token identity cannot flake.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from vllm import SamplingParams

from lumen_core.auth import CapabilityIssuer, Rights
from lumen_core.stream import request_key
from lumen_core.transport import Client, Rejected

VOCAB = 512
NUM_LAYERS = 2
NUM_KV_HEADS = 2
HEAD_DIM = 32
# fp32 logits of this model differ between kernels by ~1e-5; a gap 100x that cannot flip.
FP32_NOISE = 1e-3
TLS = "tcp"


def build_model(path: Path, *, seed: int = 0) -> Path:
    """A 2-layer Llama (GQA 4/2 heads, head_dim 32) saved in fp32 under ``path``."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=NUM_LAYERS,
        num_attention_heads=4,
        num_key_value_heads=NUM_KV_HEADS,
        head_dim=HEAD_DIM,
        max_position_embeddings=4096,
        initializer_range=0.1,  # large enough that outputs depend on the context
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(100.0)  # top-2 gaps of ~0.1-10 logits
    model.save_pretrained(path)
    return path


def record_bytes() -> int:
    return NUM_LAYERS * 2 * NUM_KV_HEADS * HEAD_DIM * 4  # fp32


def transfer_config(
    secret_file: Path, issuer_key_file: Path, port: int | None, **extra: Any
) -> dict[str, Any]:
    """``kv_transfer_config`` loading LumenConnector with one static holder (None: no holders),
    issuing its own capabilities with the key in ``issuer_key_file`` (gateway-less mode)."""
    return {
        "kv_connector": "LumenConnector",
        "kv_connector_module_path": "lumen_core.integrations.vllm",
        "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {
            "secret_file": str(secret_file),
            "issuer_key_file": str(issuer_key_file),
            "holders": [] if port is None else [f"127.0.0.1:{port}"],
            "tls": TLS,
            **extra,
        },
    }


def engine_kwargs(model: Path, **overrides: Any) -> dict[str, Any]:
    return {
        "model": str(model),
        "skip_tokenizer_init": True,
        "dtype": "float32",
        "enforce_eager": True,
        "max_model_len": 2048,
        "seed": 0,
        **overrides,
    }


def durable_tokens(client: Client, issuer: CapabilityIssuer, request_id: str, *, epoch: int = 0) -> int:
    """The holder's durable length of ``request_id`` (0 when it holds none)."""
    key = request_key(request_id)
    capability = issuer.issue(key, 0, epoch, holder_id=0, rights=Rights.READ)
    try:
        result = client.read(key, 0, epoch, 0, 1, record_bytes(), capability)
    except Rejected:
        return 0
    return int(result.durable_tokens)


def greedy(max_tokens: int, **kwargs: Any) -> SamplingParams:
    """Greedy sampling of exactly ``max_tokens`` output tokens: EOS is ignored, because these
    random models emit it wherever it happens to be the argmax (one resume prompt ends after
    135 of 200 tokens) and a request that ends early releases its checkpoint before the
    tests' kill."""
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, **kwargs)


def params(request_id: str, **lumen: Any) -> dict[str, Any]:
    return {"kv_transfer_params": {"lumen": {"request_id": request_id, **lumen}}}


def dump(value: Any) -> str:
    return json.dumps(value)
