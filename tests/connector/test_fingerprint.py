"""The engine-neutral model fingerprint."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from lumen_core.connector import model_fingerprint


@pytest.fixture
def model_dir(tmp_path: Path) -> Path:
    (tmp_path / "config.json").write_text(json.dumps({"hidden_size": 64}))
    (tmp_path / "model.safetensors").write_bytes(b"weights-1")
    return tmp_path


def test_same_files_same_fingerprint_and_each_input_counts(model_dir: Path) -> None:
    base = model_fingerprint(model_dir, dtype="torch.float32")
    assert base == model_fingerprint(model_dir, dtype="torch.float32")
    assert base != model_fingerprint(model_dir, dtype="torch.bfloat16")
    assert base != model_fingerprint(model_dir, dtype="torch.float32", quantization="fp8")
    assert base != model_fingerprint(model_dir, dtype="torch.float32", tensor_parallel_size=2)
    assert base != model_fingerprint(model_dir, dtype="torch.float32", revision="v1")
    (model_dir / "model.safetensors").write_bytes(b"weights-2")
    assert base != model_fingerprint(model_dir, dtype="torch.float32")


def test_refuses_what_it_cannot_name(tmp_path: Path, model_dir: Path) -> None:
    with pytest.raises(ValueError, match="must hold a config.json"):
        model_fingerprint(tmp_path / "missing", dtype="torch.float32")
    (model_dir / "model.safetensors").unlink()
    with pytest.raises(ValueError, match=r"must hold \*.safetensors weights or a `revision`"):
        model_fingerprint(model_dir, dtype="torch.float32")
    assert model_fingerprint(model_dir, dtype="torch.float32", revision="v1")
    with pytest.raises(ValueError, match=r"`tensor_parallel_rank` must be in \[0, 2\)"):
        model_fingerprint(model_dir, dtype="torch.float32", tensor_parallel_size=2, tensor_parallel_rank=2)
