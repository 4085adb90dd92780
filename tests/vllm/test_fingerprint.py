"""vLLM's LumenConnector names a model exactly as any other engine does from the same files:
``lumen_core.connector.model_fingerprint`` of the safetensors directory, dtype and TP rank."""

from __future__ import annotations

from pathlib import Path

import pytest
from engines import build_model, engine_kwargs, transfer_config
from vllm import LLM

from lumen_core.connector import model_fingerprint


@pytest.mark.timeout(300)
def test_the_connector_fingerprint_is_the_engine_neutral_one(
    tmp_path: Path, secret_file: Path, issuer_key_file: Path
) -> None:
    model = build_model(tmp_path / "model")
    # What the reference engine's adapter (or any other) computes for these files, without vLLM.
    expected = model_fingerprint(model, dtype="torch.float32", tensor_parallel_size=1, tensor_parallel_rank=0)
    llm = LLM(**engine_kwargs(model, kv_transfer_config=transfer_config(secret_file, issuer_key_file, None)))
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    worker = get_kv_transfer_group().worker
    assert worker is not None and worker.core.model_fingerprint == expected
    # A file changed on disk is another model (the cache is keyed by size and mtime).
    (model / "model.safetensors").write_bytes(b"other weights")
    assert model_fingerprint(model, dtype="torch.float32") != expected
    del llm
