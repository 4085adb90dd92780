"""A real vLLM engine streams every computed token to a `lumen holder`; it is SIGKILLed
mid-decode; a fresh engine resumes each request from the holder and continues exactly as an
uninterrupted run. Bad checkpoints (a corrupted record, a wrong capability) are recomputed."""

from __future__ import annotations

import gc
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from engines import (
    FP32_NOISE,
    build_model,
    durable_tokens,
    engine_kwargs,
    params,
    record_bytes,
    transfer_config,
)
from vllm import LLM, SamplingParams

from lumen_core.stream import request_key
from lumen_core.transport import Client, issue_capability

HERE = Path(__file__).parent
# Prompt lengths around vLLM's CPU block size (128) and across several blocks.
PROMPT_LENGTHS = {"r0": 100, "r1": 127, "r2": 128, "r3": 129, "r4": 200, "r5": 255, "r6": 300, "r7": 513}
TOTAL_TOKENS = 160  # output tokens of the uninterrupted run
DECODED_BEFORE_KILL = 32  # durable output tokens every request holds when A dies
CORRUPTED = "r4"
BAD_CAPABILITY = "r6"


def _prompts() -> dict[str, list[int]]:
    rng = np.random.default_rng(7)
    return {r: rng.integers(1, 500, n).tolist() for r, n in PROMPT_LENGTHS.items()}


def _reference(model: Path, prompts: dict[str, list[int]]) -> dict[str, list[int]]:
    """Greedy outputs of an engine without the connector; asserts each position's top-2 gap
    exceeds fp32 noise, so identity below cannot flake."""
    llm = LLM(**engine_kwargs(model))
    sampling = SamplingParams(max_tokens=TOTAL_TOKENS, temperature=0.0, logprobs=2)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts.values()], sampling)
    reference = {}
    for request_id, output in zip(prompts, outputs):
        completion = output.outputs[0]
        for position in completion.logprobs:
            top = sorted((lp.logprob for lp in position.values()), reverse=True)
            assert top[0] - top[1] > FP32_NOISE, f"{request_id}: top-2 gap {top[0] - top[1]} is within noise"
        reference[request_id] = list(completion.token_ids)
    del llm
    gc.collect()
    return reference


def _run_and_kill_a(model: Path, secret_file: Path, port: int, prompts: dict[str, list[int]], client: Client,
                    secret: bytes) -> dict[str, list[int]]:  # fmt: skip
    """Engine A in its own process group, SIGKILLed once every request's checkpoint holds
    DECODED_BEFORE_KILL output tokens; returns what A emitted per request."""
    job = {"model": str(model), "secret_file": str(secret_file), "port": port, "prompts": prompts,
           "max_tokens": TOTAL_TOKENS}  # fmt: skip
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.Popen(
        [sys.executable, str(HERE / "engine_a.py"), json.dumps(job)],
        stdout=subprocess.PIPE, text=True, start_new_session=True, env=env,
    )  # fmt: skip
    emitted: dict[str, list[int]] = {}
    killed = False
    try:
        assert proc.stdout is not None
        last_poll = 0.0
        for line in proc.stdout:  # A prints after every step; EOF once it is dead
            if not line.startswith("emitted "):
                continue
            emitted = json.loads(line[len("emitted ") :])
            if killed or time.monotonic() - last_poll < 0.05:
                continue
            last_poll = time.monotonic()
            if all(
                durable_tokens(client, secret, r) >= len(p) + DECODED_BEFORE_KILL for r, p in prompts.items()
            ):
                os.killpg(proc.pid, signal.SIGKILL)
                killed = True
    finally:
        if not killed:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
    assert killed, "engine A finished before every request held enough durable tokens"
    with pytest.raises(ProcessLookupError):  # nothing of A's process group is left
        os.killpg(proc.pid, 0)
    return emitted


def _corrupt(client: Client, secret: bytes, request_id: str, position: int) -> None:
    """Rewrites ``request_id``'s checkpoint on the holder with one byte of the record at
    ``position`` flipped and its crc kept (the holder runs with --no-verify-records, so only
    the restore's checks can catch it; a holder never overwrites durable records in place)."""
    key = request_key(request_id)
    capability = issue_capability(secret, key, 0, 0)
    durable = durable_tokens(client, secret, request_id)
    read = client.read(key, 0, 0, 0, durable, record_bytes(), capability)
    assert len(read.token_ids) == durable
    records = read.records.copy()
    records[position] ^= 0x40  # every value's exponent: served, it would change the output
    client.release(key, 0, 0, capability)
    client.open(key, 0, 0, record_bytes(), read.layout_fingerprint, read.model_fingerprint, capability)
    assert client.append(key, 0, 0, 0, read.token_ids, read.crcs, records, capability) == durable


@pytest.mark.timeout(900)
def test_resume_after_sigkill_equals_uninterrupted_run(
    tmp_path: Path, holder: Callable[..., Any], secret: bytes, secret_file: Path
) -> None:
    model = build_model(tmp_path / "model")
    prompts = _prompts()
    reference = _reference(model, prompts)
    server = holder(1 << 30, "--no-verify-records")
    client = Client("127.0.0.1", server.port, secret, tls="tcp")
    try:
        emitted = _run_and_kill_a(model, secret_file, server.port, prompts, client, secret)
        durable = {r: durable_tokens(client, secret, r) for r in prompts}
        for r, p in prompts.items():
            assert len(p) + DECODED_BEFORE_KILL <= durable[r] < len(p) + TOTAL_TOKENS
            assert emitted[r] == reference[r][: len(emitted[r])]  # A was right until it died
        corrupted_at = len(prompts[CORRUPTED]) + 10
        _corrupt(client, secret, CORRUPTED, corrupted_at)
    finally:
        client.close()

    llm = LLM(**engine_kwargs(model, kv_transfer_config=transfer_config(secret_file, server.port)))
    resumed = {r: prompts[r] + emitted[r] for r in prompts}
    samplings = []
    for r in prompts:
        restore: dict[str, Any] = {}
        if r == BAD_CAPABILITY:
            restore["capability"] = "00" * 32
        samplings.append(
            SamplingParams(
                max_tokens=TOTAL_TOKENS - len(emitted[r]),
                temperature=0.0,
                extra_args=params(r, epoch=1, restore=restore),
            )
        )
    outputs = llm.generate([{"prompt_token_ids": resumed[r]} for r in prompts], samplings)

    from vllm.distributed.kv_transfer import get_kv_transfer_group

    worker = get_kv_transfer_group().worker
    for r, output in zip(prompts, outputs):
        assert list(output.outputs[0].token_ids) == reference[r][len(emitted[r]) :], r
        if r == BAD_CAPABILITY:  # the holder refused the lookup: nothing claimed, all recomputed
            assert output.num_cached_tokens == 0, r
            continue
        # vLLM counts what the connector claimed; a block that then fails verification is
        # recomputed without lowering it.
        assert output.num_cached_tokens == min(durable[r], len(resumed[r]) - 1), r
        restored = worker.restores[r].restored_tokens
        assert restored == (corrupted_at if r == CORRUPTED else output.num_cached_tokens), r
    assert worker.counters["restores"] == len(prompts) - 1  # not the refused one
    assert worker.counters["restore_crc_mismatch"] == 1
    assert server.ask("stats")["server"]["bad_capability"] >= 1
