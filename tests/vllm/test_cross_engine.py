"""A checkpoint made by the reference engine restores into vLLM: both serve the same
transformers files, name them with one fingerprint and write one record format, so vLLM loads
the reference engine's KV for the durable prefix and continues exactly as its own
uninterrupted run (the model's top-2 logit gaps are far above fp32 noise)."""

from __future__ import annotations

import gc
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from engines import FP32_NOISE, build_model, durable_tokens, engine_kwargs, params, transfer_config
from vllm import LLM, SamplingParams

from lumen_core.auth import CapabilityIssuer
from lumen_core.connector import model_fingerprint
from lumen_core.engine import CacheConfig, Engine, load_model
from lumen_core.engine import SamplingParams as ReferenceSampling
from lumen_core.integrations.reference import StreamingConnector
from lumen_core.transport import Client

PROMPT_TOKENS = 300
TOTAL_TOKENS = 120
DECODED_BY_REFERENCE = 40


@pytest.mark.timeout(600)
def test_a_reference_engine_checkpoint_resumes_in_vllm(
    tmp_path: Path,
    holder: Callable[..., Any],
    secret: bytes,
    secret_file: Path,
    issuer: CapabilityIssuer,
    issuer_key_file: Path,
) -> None:
    model = build_model(tmp_path / "model")
    prompt = np.random.default_rng(3).integers(1, 500, PROMPT_TOKENS).tolist()
    llm = LLM(**engine_kwargs(model))
    [full] = llm.generate(
        [{"prompt_token_ids": prompt}], SamplingParams(max_tokens=TOTAL_TOKENS, temperature=0.0, logprobs=2)
    )
    for position in full.outputs[0].logprobs:
        top = sorted((lp.logprob for lp in position.values()), reverse=True)
        assert top[0] - top[1] > FP32_NOISE
    expected = list(full.outputs[0].token_ids)
    del llm
    gc.collect()

    # The reference engine serves the same files, streams to the holder, and dies mid-decode
    # (its connector closed without releasing: what a SIGKILL leaves on the holder).
    server = holder(1 << 30)
    connector = StreamingConnector(
        secret,
        model_fingerprint(model, dtype="torch.float32"),
        holders=[("127.0.0.1", server.port)],
        capability_for=lambda key, _: issuer.issue(key, 0, 0, holder_id=0),
        tls="tcp",
    )
    engine = Engine(load_model(model), CacheConfig(num_blocks=64, block_size=16), connector=connector)
    engine.add_request("x", prompt, ReferenceSampling(max_tokens=TOTAL_TOKENS))
    emitted: list[int] = []
    while len(emitted) < DECODED_BY_REFERENCE:
        emitted += engine.step().new_token_ids.get("x", [])
    deadline = time.monotonic() + 30
    while connector.durable_tokens()["x"] < PROMPT_TOKENS + DECODED_BY_REFERENCE - 8:
        assert time.monotonic() < deadline, connector.durable_tokens()
        time.sleep(0.05)
    connector.close()
    assert emitted == expected[: len(emitted)]  # the two engines agree token for token
    with Client("127.0.0.1", server.port, secret, tls="tcp") as client:
        durable = durable_tokens(client, issuer, "x")
    assert durable >= PROMPT_TOKENS + DECODED_BY_REFERENCE - 8

    llm = LLM(
        **engine_kwargs(model, kv_transfer_config=transfer_config(secret_file, issuer_key_file, server.port))
    )
    sampling = SamplingParams(
        max_tokens=TOTAL_TOKENS - len(emitted), temperature=0.0, extra_args=params("x", epoch=1, restore={})
    )
    [output] = llm.generate([{"prompt_token_ids": prompt + emitted}], sampling)
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    worker = get_kv_transfer_group().worker
    assert list(output.outputs[0].token_ids) == expected[len(emitted) :]
    assert output.num_cached_tokens == min(durable, len(prompt) + len(emitted) - 1)
    assert worker.restores["x"].restored_tokens == output.num_cached_tokens
    del llm
    gc.collect()
