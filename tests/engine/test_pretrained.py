"""Transformers Llama directories (config.json + safetensors, what vLLM serves) in the
reference engine: the same logits as transformers' own model, the same fingerprint as any
other engine computes from the files, and clear refusals of what the model does not compute."""

import json
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from lumen_core.connector import model_fingerprint
from lumen_core.engine import Engine, SamplingParams, forward_contiguous, load_model, load_pretrained
from lumen_core.worker.process import Worker, WorkerConfig

pytestmark = pytest.mark.timeout(120)


def save_llama(path: Path, *, dtype: torch.dtype = torch.float32, **overrides: object) -> LlamaForCausalLM:
    fields: dict[str, object] = {
        "vocab_size": 97, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
        "max_position_embeddings": 512, "rope_theta": 5000.0, "tie_word_embeddings": False,
    }  # fmt: skip
    config = LlamaConfig(**{**fields, **overrides})
    torch.manual_seed(3)
    model = LlamaForCausalLM(config).to(dtype).eval()
    model.save_pretrained(path)
    return model


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_logits_and_greedy_output_match_transformers(tmp_path: Path, tied: bool) -> None:
    theirs = save_llama(tmp_path, tie_word_embeddings=tied)
    ours = load_pretrained(tmp_path)
    assert ours.dtype == torch.float32 and ours.config.rope_theta == 5000.0
    seq = torch.randint(0, 97, (40,), generator=torch.Generator().manual_seed(1)).tolist()
    with torch.no_grad():
        expected = theirs(torch.tensor([seq])).logits[0]
    torch.testing.assert_close(forward_contiguous(ours, [seq])[0], expected, atol=1e-4, rtol=0)
    with torch.no_grad():
        greedy = theirs.generate(torch.tensor([seq[:8]]), max_new_tokens=12, do_sample=False)[0, 8:]
    assert (
        Engine(load_model(tmp_path)).generate([seq[:8]], [SamplingParams(max_tokens=12)])[0]
        == greedy.tolist()
    )


def test_a_worker_names_a_directory_as_every_engine_does(tmp_path: Path) -> None:
    save_llama(tmp_path)
    worker = Worker(WorkerConfig(worker_id=0, gateway="127.0.0.1:1", model_path=str(tmp_path)), b"s" * 32)
    worker.model = load_model(tmp_path)
    worker._build_engine()
    try:
        # What vLLM's LumenConnector computes for the same files (tests/vllm/test_fingerprint.py).
        assert worker.connector.core.model_fingerprint == model_fingerprint(tmp_path, dtype="torch.float32")
    finally:
        worker.connector.close()


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"model_type": "qwen3"}, "must describe a Llama"),
        ({"hidden_act": "gelu"}, "must have hidden_act='silu'"),
        ({"attention_bias": True}, "must have attention_bias=False"),
        ({"rope_scaling": {"rope_type": "linear", "factor": 2.0}, "rope_parameters": None}, "unscaled RoPE"),
    ],
)
def test_configs_the_model_does_not_compute_are_refused(tmp_path: Path, change: dict, message: str) -> None:
    save_llama(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config.update(change)
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=message):
        load_pretrained(tmp_path)


def test_missing_or_misshapen_weights_are_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="must hold a config.json"):
        load_pretrained(tmp_path)
    save_llama(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 3}))
    with pytest.raises(ValueError, match="must match its config.json, got missing"):
        load_pretrained(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({**config, "intermediate_size": 96}))
    with pytest.raises(ValueError, match="must fit its config.json"):
        load_pretrained(tmp_path)
    for file in tmp_path.glob("*.safetensors"):
        file.unlink()
    with pytest.raises(ValueError, match=r"must hold \*.safetensors"):
        load_pretrained(tmp_path)
