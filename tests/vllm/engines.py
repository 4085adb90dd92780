"""Helpers of the vLLM tests: the tiny model, engine arguments, and the holder checks.

The model is the demo's (``vllm_demo.write_tiny_llama``: random Llama weights saved with
``save_pretrained``, LM head scaled so the top-2 logit gap at every greedy position is far above
fp32 noise; tests assert it from the reference run's logprobs), so token-for-token identity
cannot flake.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from vllm import LLM, SamplingParams

from lumen_core.auth import CapabilityIssuer, Rights
from lumen_core.stream import request_key
from lumen_core.transport import Client, Rejected
from lumen_core.worker.vllm_demo import HEAD_DIM, NUM_KV_HEADS, NUM_LAYERS
from lumen_core.worker.vllm_demo import write_tiny_llama as build_model  # the demo's tiny Llama

__all__ = [
    "FP32_NOISE", "HEAD_DIM", "NUM_KV_HEADS", "NUM_LAYERS", "TLS", "build_model", "build_qwen3",
    "controlled_llm", "durable_tokens", "engine_kwargs", "greedy", "params", "record_bytes",
    "transfer_config",
]  # fmt: skip

# fp32 logits of this model differ between kernels by ~1e-5; a gap 100x that cannot flip.
FP32_NOISE = 1e-3
TLS = "tcp"


def record_bytes() -> int:
    return NUM_LAYERS * 2 * NUM_KV_HEADS * HEAD_DIM * 4  # fp32


def build_qwen3(path: Path, *, seed: int = 0) -> Path:
    """A Qwen3 of the tiny Llama's KV geometry (2 layers, 2 KV heads of 32: the same record
    size), random fp32 weights saved under ``path``. Qwen3 differs where a connector could
    care: RMS norms on q and k before RoPE, so a restored K must be the normed, rotated one
    vLLM's own kernel wrote. The LM head is scaled as the Llama's (top-2 gaps far above
    noise)."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from lumen_core.worker.vllm_demo import VOCAB

    config = Qwen3Config(
        vocab_size=VOCAB, hidden_size=128, intermediate_size=256, num_hidden_layers=NUM_LAYERS,
        num_attention_heads=4, num_key_value_heads=NUM_KV_HEADS, head_dim=HEAD_DIM,
        max_position_embeddings=4096, initializer_range=0.1, tie_word_embeddings=False,
    )  # fmt: skip
    torch.manual_seed(seed)
    model = Qwen3ForCausalLM(config).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(100.0)
    model.save_pretrained(path)
    return path


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


def controlled_llm(
    workdir: Path, secret_file: Path, issuer_key_file: Path, port: int, **extra: Any
) -> tuple[LLM, Path]:
    """An in-process engine of the tiny model (built in ``workdir``) streaming to the holder at
    ``port``, and the path of its connector's control channel; ``extra``: more connector
    options."""
    sock = workdir / "control.sock"
    config = transfer_config(secret_file, issuer_key_file, port, control_socket=str(sock), **extra)
    return LLM(**engine_kwargs(build_model(workdir / "model"), kv_transfer_config=config)), sock


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
