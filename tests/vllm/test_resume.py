"""A real vLLM engine streams every computed token to a `lumen holder`; it is SIGKILLed
mid-decode; a fresh engine resumes each request from the holder and continues exactly as an
uninterrupted run. Bad checkpoints (a corrupted record, a wrong capability) are recomputed."""

from __future__ import annotations

import collections
import gc
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from engines import (
    FP32_NOISE,
    build_model,
    build_qwen3,
    durable_tokens,
    engine_kwargs,
    greedy,
    params,
    record_bytes,
    transfer_config,
)
from vllm import LLM

from lumen_core.auth import CapabilityIssuer
from lumen_core.stream import request_key
from lumen_core.transport import Client

HERE = Path(__file__).parent
# Prompt lengths around vLLM's CPU block size (128) and across several blocks.
PROMPT_LENGTHS = {"r0": 100, "r1": 127, "r2": 128, "r3": 129, "r4": 200, "r5": 255, "r6": 300, "r7": 513}
# Output tokens of every request of the uninterrupted run (EOS ignored). A step takes ~5 ms,
# so the kill at DECODED_BEFORE_KILL leaves seconds, not the ~1 s 200 tokens left, for a slow
# first connection to the holder or a stalled poll (CI failed both resume tests that way).
TOTAL_TOKENS = 1200
DECODED_BEFORE_KILL = 32  # durable output tokens every request holds when A dies
CORRUPTED = "r4"
BAD_CAPABILITY = "r6"
QWEN3_REQUESTS = ("r1", "r3", "r7")  # below, just past and several blocks past one block


def _prompts() -> dict[str, list[int]]:
    rng = np.random.default_rng(7)
    return {r: rng.integers(1, 500, n).tolist() for r, n in PROMPT_LENGTHS.items()}


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_model(tmp_path_factory.mktemp("model"))


@pytest.fixture(scope="module")
def reference(model: Path) -> dict[str, list[int]]:
    return _greedy_reference(model, _prompts())


def _greedy_reference(model: Path, prompts: dict[str, list[int]]) -> dict[str, list[int]]:
    """Greedy outputs of an engine without the connector; asserts each position's top-2 gap
    exceeds fp32 noise, so identity below cannot flake."""
    llm = LLM(**engine_kwargs(model))
    sampling = greedy(TOTAL_TOKENS, logprobs=2)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts.values()], sampling)
    result = {}
    for request_id, output in zip(prompts, outputs):
        completion = output.outputs[0]
        assert len(completion.token_ids) == TOTAL_TOKENS, request_id
        for position in completion.logprobs:
            top = sorted((lp.logprob for lp in position.values()), reverse=True)
            assert top[0] - top[1] > FP32_NOISE, f"{request_id}: top-2 gap {top[0] - top[1]} is within noise"
        result[request_id] = list(completion.token_ids)
    del llm
    gc.collect()
    return result


def _run_and_kill(
    model: Path, secret_file: Path, issuer_key_file: Path, server: Any, requests: dict[str, dict[str, Any]],
    client: Client, issuer: CapabilityIssuer, *, epoch: int, multiprocess: bool = False,
) -> dict[str, dict[str, Any]]:  # fmt: skip
    """An engine in its own process group (engine_proc.py; ``multiprocess``: vLLM's default
    mode, EngineCore in a child process), SIGKILLed once every request's checkpoint at
    ``epoch`` holds DECODED_BEFORE_KILL more tokens than its prompt; returns what it emitted
    per request (tokens, num_cached_tokens)."""
    job = {
        "model": str(model), "secret_file": str(secret_file), "issuer_key_file": str(issuer_key_file),
        "port": server.port, "requests": requests,
    }  # fmt: skip
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")]),
        "VLLM_ENABLE_V1_MULTIPROCESSING": "1" if multiprocess else "0",
    }
    proc = subprocess.Popen(
        [sys.executable, str(HERE / "engine_proc.py"), json.dumps(job)],
        stdout=subprocess.PIPE, text=True, start_new_session=True, env=env,
    )  # fmt: skip
    latest: list[dict[str, dict[str, Any]]] = [{}]
    log: collections.deque[str] = collections.deque(maxlen=40)  # vLLM's own lines, for failures

    def read_lines() -> None:  # it prints after every step; EOF once it is dead
        assert proc.stdout is not None
        with proc.stdout:
            for line in proc.stdout:
                if line.startswith("emitted "):
                    latest[0] = json.loads(line[len("emitted ") :])
                else:
                    log.append(line)

    # The holder is polled on a clock, not per line: in the multiprocess mode the engine core
    # runs ahead of the process that prints, and a finished request's checkpoint is released.
    reader = threading.Thread(target=read_lines, daemon=True)
    reader.start()
    killed = False
    past_prompt: dict[str, int] = {}  # request -> durable tokens past its prompt, last read
    try:
        while proc.poll() is None:
            short = False
            for r, q in requests.items():
                past_prompt[r] = durable_tokens(client, issuer, r, epoch=epoch) - len(q["prompt"])
                if past_prompt[r] < DECODED_BEFORE_KILL:
                    short = True
                    break
            if not short:
                os.killpg(proc.pid, signal.SIGKILL)
                killed = True
                break
            time.sleep(0.02)
    finally:
        if not killed:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
        reader.join(timeout=30)
    emitted = latest[0]
    ends = {r: (len(e["tokens"]), e["finish_reason"]) for r, e in emitted.items()}
    assert killed, (
        f"the engine ended first (exit {proc.returncode}): durable past prompt, last read {past_prompt}, "
        f"emitted and finish reasons {ends}; holder {server.ask('stats')}; its last lines:\n{''.join(log)}"
    )
    _assert_group_gone(proc.pid)
    finished = {r: ends[r] for r, q in requests.items() if ends.get(r, (0,))[0] >= q["max_tokens"]}
    assert not finished, f"requests finished before the kill: {finished}; durable past prompt {past_prompt}"
    return emitted


def _assert_group_gone(pgid: int) -> None:
    """No process of the group is left (orphaned children are reaped by init within moments)."""
    deadline = time.monotonic() + 10.0
    while time.monotonic() < deadline:
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.05)
    raise AssertionError(f"processes of group {pgid} outlived its SIGKILL")


def _first_run(prompts: dict[str, list[int]]) -> dict[str, dict[str, Any]]:
    return {r: {"prompt": p, "max_tokens": TOTAL_TOKENS, "lumen": {}} for r, p in prompts.items()}


def _corrupt(client: Client, issuer: CapabilityIssuer, request_id: str, position: int) -> None:
    """Rewrites ``request_id``'s checkpoint on the holder with one byte of the record at
    ``position`` flipped and its crc kept (the holder runs with --no-verify-records, so only
    the restore's checks can catch it; a holder never overwrites durable records in place).
    The planted checkpoint is at epoch 1, the epoch the resuming engine reads and writes: a
    released checkpoint is re-created only at a newer epoch."""
    key = request_key(request_id)
    capability = issuer.issue(key, 0, 0, holder_id=0)
    durable = durable_tokens(client, issuer, request_id)
    read = client.read(key, 0, 0, 0, durable, record_bytes(), capability)
    assert len(read.token_ids) == durable
    records = read.records.copy()
    records[position] ^= 0x40  # every value's exponent: served, it would change the output
    client.release(key, 0, 0, capability)
    planted = issuer.issue(key, 0, 1, holder_id=0)
    client.open(key, 0, 1, record_bytes(), read.layout_fingerprint, read.model_fingerprint, planted)
    assert client.append(key, 0, 1, 0, read.token_ids, read.crcs, records, planted) == durable


@pytest.mark.timeout(900)
def test_resume_after_sigkill_equals_uninterrupted_run(
    model: Path,
    reference: dict[str, list[int]],
    holder: Callable[..., Any],
    secret: bytes,
    secret_file: Path,
    issuer: CapabilityIssuer,
    issuer_key_file: Path,
) -> None:
    prompts = _prompts()
    server = holder(1 << 30, "--no-verify-records")
    client = Client("127.0.0.1", server.port, secret, tls="tcp")
    try:
        run = _run_and_kill(
            model, secret_file, issuer_key_file, server, _first_run(prompts), client, issuer, epoch=0
        )
        emitted = {r: run[r]["tokens"] for r in prompts}
        durable = {r: durable_tokens(client, issuer, r) for r in prompts}
        for r, p in prompts.items():
            assert len(p) + DECODED_BEFORE_KILL <= durable[r] < len(p) + TOTAL_TOKENS
            assert emitted[r] == reference[r][: len(emitted[r])]  # A was right until it died
        corrupted_at = len(prompts[CORRUPTED]) + 10
        _corrupt(client, issuer, CORRUPTED, corrupted_at)
    finally:
        client.close()

    llm = LLM(
        **engine_kwargs(model, kv_transfer_config=transfer_config(secret_file, issuer_key_file, server.port))
    )
    resumed = {r: prompts[r] + emitted[r] for r in prompts}
    samplings = []
    for r in prompts:
        restore: dict[str, Any] = {}
        if r == BAD_CAPABILITY:
            restore["capability"] = "00" * 128  # the right size, signed by no one
        samplings.append(
            greedy(TOTAL_TOKENS - len(emitted[r]), extra_args=params(r, epoch=1, restore=restore))
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
    del llm
    gc.collect()


@pytest.mark.timeout(900)
def test_two_failures_in_a_row_resume(
    model: Path,
    reference: dict[str, list[int]],
    holder: Callable[..., Any],
    secret: bytes,
    secret_file: Path,
    issuer: CapabilityIssuer,
    issuer_key_file: Path,
) -> None:
    """A dies, B (vLLM's multiprocess mode: scheduler and worker sides in other processes)
    resumes every request at epoch 1, re-streaming the restored prefix, and dies too; C
    resumes from B's checkpoints at epoch 2."""
    prompts = _prompts()
    server = holder()
    client = Client("127.0.0.1", server.port, secret, tls="tcp")
    try:
        run_a = _run_and_kill(
            model, secret_file, issuer_key_file, server, _first_run(prompts), client, issuer, epoch=0
        )
        requests_b = {}
        for r, p in prompts.items():
            tokens = run_a[r]["tokens"]
            requests_b[r] = {"prompt": p + tokens, "max_tokens": TOTAL_TOKENS - len(tokens),
                             "lumen": {"epoch": 1, "restore": {}}}  # fmt: skip
        durable_a = {r: durable_tokens(client, issuer, r) for r in prompts}
        run_b = _run_and_kill(
            model,
            secret_file,
            issuer_key_file,
            server,
            requests_b,
            client,
            issuer,
            epoch=1,
            multiprocess=True,
        )
        durable_b = {r: durable_tokens(client, issuer, r, epoch=1) for r in prompts}
        # B's saves overlapping A's durable records were not sent again: a holder refuses an
        # overlap that differs (a recomputed record's last bits) and the replica is lost.
        assert server.ask("stats")["store"]["conflicts"] == 0
    finally:
        client.close()
    for r, q in requests_b.items():
        assert run_b[r]["num_cached_tokens"] == min(durable_a[r], len(q["prompt"]) - 1), r
        assert durable_b[r] >= len(q["prompt"]) + DECODED_BEFORE_KILL, (
            r, q["max_tokens"], len(run_b[r]["tokens"]), run_b[r]["finish_reason"], server.ask("stats")
        )  # fmt: skip

    llm = LLM(
        **engine_kwargs(model, kv_transfer_config=transfer_config(secret_file, issuer_key_file, server.port))
    )
    emitted = {r: run_a[r]["tokens"] + run_b[r]["tokens"] for r in prompts}
    samplings = [
        greedy(TOTAL_TOKENS - len(emitted[r]), extra_args=params(r, epoch=2, restore={})) for r in prompts
    ]
    outputs = llm.generate([{"prompt_token_ids": prompts[r] + emitted[r]} for r in prompts], samplings)
    for r, output in zip(prompts, outputs):
        assert emitted[r] == reference[r][: len(emitted[r])], r
        assert list(output.outputs[0].token_ids) == reference[r][len(emitted[r]) :], r
        assert output.num_cached_tokens == min(durable_b[r], len(prompts[r]) + len(emitted[r]) - 1), r
    del llm
    gc.collect()


@pytest.mark.timeout(900)
def test_a_qwen3_model_resumes_after_sigkill(
    tmp_path: Path,
    holder: Callable[..., Any],
    secret: bytes,
    secret_file: Path,
    issuer: CapabilityIssuer,
    issuer_key_file: Path,
) -> None:
    """The kill and resume of the Llama above on a Qwen3 (RMS norms on q and k before RoPE):
    the restored K is the one vLLM's kernel wrote, so the continuation is the uninterrupted
    run's token for token."""
    model = build_qwen3(tmp_path / "qwen3")
    prompts = {r: p for r, p in _prompts().items() if r in QWEN3_REQUESTS}
    reference = _greedy_reference(model, prompts)
    server = holder()
    client = Client("127.0.0.1", server.port, secret, tls="tcp")
    try:
        run = _run_and_kill(
            model, secret_file, issuer_key_file, server, _first_run(prompts), client, issuer, epoch=0
        )
        emitted = {r: run[r]["tokens"] for r in prompts}
        durable = {r: durable_tokens(client, issuer, r) for r in prompts}
    finally:
        client.close()
    for r in prompts:
        assert emitted[r] == reference[r][: len(emitted[r])], r  # A was right until it died

    llm = LLM(
        **engine_kwargs(model, kv_transfer_config=transfer_config(secret_file, issuer_key_file, server.port))
    )
    resumed = {r: prompts[r] + emitted[r] for r in prompts}
    samplings = [
        greedy(TOTAL_TOKENS - len(emitted[r]), extra_args=params(r, epoch=1, restore={})) for r in prompts
    ]
    outputs = llm.generate([{"prompt_token_ids": resumed[r]} for r in prompts], samplings)

    from vllm.distributed.kv_transfer import get_kv_transfer_group

    worker = get_kv_transfer_group().worker
    for r, output in zip(prompts, outputs):
        assert list(output.outputs[0].token_ids) == reference[r][len(emitted[r]) :], r
        assert output.num_cached_tokens == min(durable[r], len(resumed[r]) - 1), r
        assert worker.restores[r].restored_tokens == output.num_cached_tokens, r
    del llm
    gc.collect()
