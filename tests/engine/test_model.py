"""The model against transformers' Llama with the same weights, and weights on disk."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from lumen_core.engine import (
    Llama,
    ModelConfig,
    forward_contiguous,
    load_model,
    random_weights,
    save_model,
)
from lumen_core.engine.config import CacheConfig, SamplingParams, SchedulerConfig, resolve_dtype


def hf_twin(model: Llama) -> LlamaForCausalLM:
    c = model.config
    config = LlamaConfig(
        vocab_size=c.vocab_size,
        hidden_size=c.hidden_size,
        intermediate_size=c.intermediate_size,
        num_hidden_layers=c.num_layers,
        num_attention_heads=c.num_heads,
        num_key_value_heads=c.num_kv_heads,
        head_dim=c.head_dim,
        rms_norm_eps=c.rms_norm_eps,
        rope_theta=c.rope_theta,
        max_position_embeddings=c.max_position_embeddings,
        tie_word_embeddings=False,
    )
    twin = LlamaForCausalLM(config).to(model.dtype).eval()
    twin.load_state_dict(model.state_dict(), strict=True)
    return twin


# fp32: logits have a standard deviation of ~2.5; the two implementations order their
# reductions differently (and transformers builds RoPE angles in float32), which moves a
# logit by a few 1e-6 over 4 layers. 1e-4 leaves room and still catches any real mistake
# (a wrong RoPE pairing or GQA grouping moves logits by O(1)). In float64 the remaining
# difference is transformers' float32 RoPE angles (~1e-6), so 2e-5 there.
@pytest.mark.parametrize(("dtype", "atol"), [(torch.float32, 1e-4), (torch.float64, 2e-5)])
@pytest.mark.parametrize(
    "config",
    [ModelConfig(), ModelConfig(num_heads=4, num_kv_heads=4, num_layers=1, vocab_size=97)],
    ids=["gqa", "mha"],
)
def test_logits_match_transformers(config: ModelConfig, dtype: torch.dtype, atol: float) -> None:
    model = random_weights(config, seed=7, dtype=dtype)
    twin = hf_twin(model)
    generator = torch.Generator().manual_seed(1)
    seqs = [torch.randint(0, config.vocab_size, (n,), generator=generator).tolist() for n in (1, 17, 300)]
    ours = forward_contiguous(model, seqs)
    with torch.no_grad():
        for seq, logits in zip(seqs, ours, strict=True):
            theirs = twin(torch.tensor([seq])).logits[0]
            torch.testing.assert_close(logits, theirs, atol=atol, rtol=0)


def test_a_wrong_rope_would_fail_the_comparison(model32: Llama) -> None:
    twin = hf_twin(model32)
    seq = list(range(40))
    ours = forward_contiguous(model32, [seq])[0]
    twin.model.rotary_emb.inv_freq.mul_(1.01)
    with torch.no_grad():
        theirs = twin(torch.tensor([seq])).logits[0]
    assert (ours - theirs).abs().max() > 1e-2


def test_random_weights_are_deterministic_and_seeded() -> None:
    a = random_weights(ModelConfig(), seed=3)
    b = random_weights(ModelConfig(), seed=3)
    c = random_weights(ModelConfig(), seed=4)
    for (name, x), y, z in zip(
        a.state_dict().items(), b.state_dict().values(), c.state_dict().values(), strict=True
    ):
        assert torch.equal(x, y), name
        if "norm" not in name:
            assert not torch.equal(x, z), name


def test_layer_output_scales_scale_the_residual_branches() -> None:
    base = random_weights(ModelConfig(num_layers=2), seed=0)
    scaled = random_weights(ModelConfig(num_layers=2), seed=0, layer_output_scales=[1.0, 0.5])
    s0, s1 = base.state_dict(), scaled.state_dict()
    for name in s0:
        factor = (
            0.5
            if name.startswith("model.layers.1.") and name.endswith(("o_proj.weight", "down_proj.weight"))
            else 1.0
        )
        torch.testing.assert_close(s1[name], s0[name] * factor, rtol=1e-6, atol=0)
    with pytest.raises(ValueError, match="`layer_output_scales` must have num_layers=2"):
        random_weights(ModelConfig(num_layers=2), seed=0, layer_output_scales=[1.0])


def test_save_load_roundtrip_gives_identical_logits(tmp_path, model32: Llama) -> None:
    path = tmp_path / "tiny.pt"
    save_model(model32, path)
    loaded = load_model(path)
    assert loaded.config == model32.config and loaded.dtype == torch.float32
    seq = [[3, 1, 4, 1, 5, 9, 2, 6]]
    assert torch.equal(forward_contiguous(loaded, seq)[0], forward_contiguous(model32, seq)[0])
    as64 = load_model(path, dtype="float64")
    assert as64.dtype == torch.float64


def test_load_model_rejects_foreign_files(tmp_path, model32: Llama) -> None:
    path = tmp_path / "other.pt"
    torch.save({"weights": torch.zeros(2)}, path)
    with pytest.raises(ValueError, match="`path` must be a file written by save_model"):
        load_model(path)
    save_model(model32, path)
    payload = torch.load(path, weights_only=True)
    payload["config"]["num_layers"] = 5
    torch.save(payload, path)
    with pytest.raises(ValueError, match="`path` weights must match its config"):
        load_model(path)


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"vocab_size": 0}, ValueError, "`vocab_size` must be >= 1, got 0"),
        ({"hidden_size": 1.5}, TypeError, "`hidden_size` must be an int, got float"),
        ({"num_heads": 6, "num_kv_heads": 4}, ValueError, "`num_heads` must be a multiple"),
        ({"head_dim": 7}, ValueError, "`head_dim` must be even"),
        ({"rope_theta": 0.0}, ValueError, "`rope_theta` and `rms_norm_eps` must be > 0"),
    ],
)
def test_model_config_validation(kwargs: dict, error: type, match: str) -> None:
    with pytest.raises(error, match=match):
        ModelConfig(**kwargs)


@pytest.mark.parametrize(
    ("build", "error", "match"),
    [
        (lambda: CacheConfig(num_blocks=0), ValueError, "`num_blocks` must be >= 1, got 0"),
        (lambda: CacheConfig(block_size=-1), ValueError, "`block_size` must be >= 1, got -1"),
        (lambda: SchedulerConfig(max_num_batched_tokens=0), ValueError, "`max_num_batched_tokens`"),
        (lambda: SchedulerConfig(max_num_seqs=0), ValueError, "`max_num_seqs` must be >= 1, got 0"),
        (lambda: SamplingParams(temperature=-1.0), ValueError, "`temperature` must be >= 0"),
        (lambda: SamplingParams(temperature="hot"), TypeError, "`temperature` must be a float"),
        (lambda: SamplingParams(seed=-1), ValueError, r"`seed` must be an int in \[0, 2\*\*64\)"),
        (lambda: SamplingParams(max_tokens=0), ValueError, "`max_tokens` must be >= 1, got 0"),
        (lambda: resolve_dtype("int8"), ValueError, "`dtype` must be one of"),
        (lambda: resolve_dtype(torch.int8), ValueError, "`dtype` must be one of"),
        (lambda: resolve_dtype(3), TypeError, "`dtype` must be a str or torch.dtype"),
    ],
)
def test_config_validation(build, error: type, match: str) -> None:
    with pytest.raises(error, match=match):
        build()


def test_kv_bytes_per_token_follows_eq1() -> None:
    c = ModelConfig()
    assert c.kv_bytes_per_token(torch.float32) == 2 * 4 * 2 * 16 * 4


def test_forward_contiguous_rejects_empty(model32: Llama) -> None:
    with pytest.raises(ValueError, match="`sequences` must be a non-empty list"):
        forward_contiguous(model32, [[1], []])
