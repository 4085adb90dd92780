"""``lumen demo --engine vllm``: three vLLM servers (CPU), each with its ``lumen agent``, behind
the gateway's front door; one server SIGKILLed mid-stream, under S&R, FC and LUMEN.

The official ``openai`` client streams ``--streams`` greedy completions through the front door;
once each has ``KILL_AFTER_TOKENS`` tokens the busiest server's process group is SIGKILLed.
One JSON row per policy: streams broken (an error instead of a finish), tokens duplicated,
missing or changed against the failure-free run (run once, on the first policy's cluster
before its failure), the interrupted requests by the gateway's recovery action, what the
survivors restored (their connectors' control ``stats``), and the longest pause an
interrupted stream saw. Mechanisms 1 (checkpoints streamed to holders, restored on a
survivor) and 2 (placement and routing) run here; mechanism 3 (a recovering worker drafting
for a survivor) is absent: vLLM has no API for outside drafts. Needs the ``vllm`` extra and
``transformers`` (the tiny model is built here, random weights).
"""

from __future__ import annotations

import argparse
import json
import os
import select
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lumen_core.metrics import count_token_errors
from lumen_core.policy.events import RecoveryAction

__all__ = ["VllmCluster", "run_vllm_demo", "write_tiny_llama"]

NUM_SERVERS = 3
PROMPT_TOKENS = 300  # long enough that a restore saves a real prefill
MAX_TOKENS = 96
KILL_AFTER_TOKENS = 8
# The tiny Llama of write_tiny_llama (the vLLM tests build theirs here too).
VOCAB = 512
NUM_LAYERS = 2
NUM_KV_HEADS = 2
HEAD_DIM = 32
MODEL_NAME = "tiny"
_KEY = "lumen-demo-vllm-key-0123456789ab"
_SERVER_ARGS = "--skip-tokenizer-init --enforce-eager --max-model-len 1024 --seed 0"
_START_TIMEOUT_S = 600.0


def write_tiny_llama(path: Path, *, seed: int = 0) -> Path:
    """A 2-layer Llama (vocabulary 512, GQA 4/2 heads of 32) with random fp32 weights, saved
    under ``path``; the LM head is scaled so greedy choices are far from ties (fp32 kernels
    then agree token for token)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=VOCAB, hidden_size=128, intermediate_size=256, num_hidden_layers=NUM_LAYERS,
        num_attention_heads=4, num_key_value_heads=NUM_KV_HEADS, head_dim=HEAD_DIM,
        max_position_embeddings=4096,
        initializer_range=0.1,  # large enough that outputs depend on the context
        tie_word_embeddings=False,
    )  # fmt: skip
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(100.0)  # top-2 gaps of ~0.1-10 logits
    model.save_pretrained(path)
    return path


@dataclass
class _Stream:
    request_id: int = 0
    token_ids: list[int] = field(default_factory=list)
    times_s: list[float] = field(default_factory=list)  # when each chunk arrived
    finish_reasons: list[str] = field(default_factory=list)
    error: str = ""


def _prompt(i: int, seed: int) -> list[int]:
    return [(7 * i + 3 * j + 11 * seed) % (VOCAB - 8) + 5 for j in range(PROMPT_TOKENS)]


def _consume(client: Any, prompt: list[int], stream: _Stream) -> None:
    try:
        events = client.completions.create(
            model=MODEL_NAME, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0.0, stream=True
        )
        for chunk in events:
            stream.request_id = int(chunk.id.removeprefix("cmpl-"))
            for choice in chunk.choices:
                stream.token_ids.extend(choice.token_ids)
                stream.times_s.append(time.monotonic())
                if choice.finish_reason is not None:
                    stream.finish_reasons.append(choice.finish_reason)
    except Exception as exc:  # noqa: BLE001 - a broken stream is what the demo counts
        stream.error = f"{type(exc).__name__}: {exc}"


def _run_streams(
    client: Any, prompts: list[list[int]], during: Callable[[list[_Stream]], None] | None
) -> list[_Stream]:
    streams = [_Stream() for _ in prompts]
    threads = [threading.Thread(target=_consume, args=(client, p, s)) for p, s in zip(prompts, streams)]
    for thread in threads:
        thread.start()
    if during is not None:
        during(streams)
    for thread in threads:
        thread.join(timeout=600.0)
    return streams


def _read_line(proc: subprocess.Popen[str], timeout_s: float) -> dict[str, Any]:
    assert proc.stdout is not None
    ready, _, _ = select.select([proc.stdout], [], [], timeout_s)
    line = proc.stdout.readline() if ready else ""
    if not line:
        raise RuntimeError(f"an agent did not register within {timeout_s:.0f} s (exit status {proc.poll()})")
    return json.loads(line)


class VllmCluster:
    """A gateway (``policy``) with its front door, and ``num_servers`` agents each starting a
    server (``registered[w]["server_url"]`` is server ``w``'s own OpenAI endpoint)."""

    def __init__(
        self, policy: str, model: Path, workdir: Path, secret_file: Path, *, num_servers: int = NUM_SERVERS
    ) -> None:
        from lumen_core.auth import read_secret_file
        from lumen_core.gateway.config import GatewayConfig
        from lumen_core.gateway.http.config import FrontDoorConfig
        from lumen_core.gateway.http.front_door import FrontDoor
        from lumen_core.gateway.server import GatewayServer
        from lumen_core.policy.load import LoadConfig
        from lumen_core.worker.agent import record_bytes_of

        self.workdir = workdir
        load = LoadConfig(kv_bytes_per_token=record_bytes_of(model, "float32"))
        self.gateway = GatewayServer(
            GatewayConfig(policy=policy, load_config=load),
            read_secret_file(secret_file),
            port=0,
            max_streams=256,
        ).start()
        self.agents: list[subprocess.Popen[str]] = []
        self.registered: list[dict[str, Any]] = []
        try:
            for worker_id in range(num_servers):
                argv = [
                    sys.executable, "-m", "lumen_core.cli", "agent", "--worker-id", str(worker_id),
                    "--gateway", self.gateway.address, "--secret-file", str(secret_file),
                    "--model", str(model), "--workdir", str(workdir), "--tls", "tcp", "--kv-space-gib", "1",
                    "--server-args", _SERVER_ARGS, "--start-timeout-s", str(_START_TIMEOUT_S),
                ]  # fmt: skip
                self.agents.append(subprocess.Popen(argv, stdout=subprocess.PIPE, text=True))
            self.registered = [_read_line(agent, _START_TIMEOUT_S + 30) for agent in self.agents]
            config = FrontDoorConfig(MODEL_NAME, vocab_size=VOCAB, max_model_len=1024, engine="vllm")
            self.door = FrontDoor(self.gateway, config, frozenset([_KEY])).start()
        except BaseException:
            self.close()
            raise

    api_key = _KEY  # the front door's one client key

    def client(self) -> Any:
        import openai

        return openai.OpenAI(base_url=self.door.url, api_key=_KEY, max_retries=0, timeout=600.0)

    def busiest(self) -> int:
        coordinator = self.gateway.coordinator
        with self.gateway.condition:
            running = {
                w: len(coordinator.monitor.running_on(w)) for w in coordinator.monitor.live_worker_ids()
            }
        return max(running, key=lambda w: running[w])

    def kill_server(self, worker_id: int) -> None:
        os.killpg(self.registered[worker_id]["server_pid"], signal.SIGKILL)

    def connector_stats(self, worker_id: int) -> dict[str, Any]:
        from lumen_core.integrations.vllm import control

        return control.ask(self.workdir / f"control-{worker_id}.sock", "stats")["worker"]

    def close(self) -> None:
        """SIGTERM every agent (each ends its server), then the gateway."""
        for agent in self.agents:
            if agent.poll() is None:
                agent.send_signal(signal.SIGTERM)
        for agent in self.agents:
            try:
                agent.wait(timeout=60)
            except subprocess.TimeoutExpired:
                agent.kill()
                agent.wait(timeout=10)
            if agent.stdout is not None:
                agent.stdout.close()
        for registered in self.registered:  # an agent that could not end its server
            try:
                os.killpg(registered["server_pid"], signal.SIGKILL)
            except ProcessLookupError:
                pass
        if hasattr(self, "door"):
            self.door.stop()
        self.gateway.stop(grace_s=0.5)


def _run_policy(
    policy: str, model: Path, workdir: Path, secret_file: Path, prompts: list[list[int]],
    expected: list[list[int]] | None, say: Callable[[str], None],
) -> tuple[dict[str, Any], list[list[int]]]:  # fmt: skip
    """One policy's row, and the failure-free outputs (run here when ``expected`` is None)."""
    say(f"{policy}: starting {NUM_SERVERS} vLLM servers with their agents")
    cluster = VllmCluster(policy, model, workdir / policy.replace("&", "n"), secret_file)
    try:
        client = cluster.client()
        if expected is None:
            say(f"{policy}: the failure-free run")
            reference = _run_streams(client, prompts, None)
            broken = [s.error for s in reference if s.error]
            if broken:
                raise RuntimeError(f"the failure-free run broke: {broken[0]}")
            expected = [s.token_ids for s in reference]
        killed: list[tuple[int, float]] = []

        def kill_the_busiest(streams: list[_Stream]) -> None:
            deadline = time.monotonic() + 600.0
            while min(len(s.token_ids) for s in streams) < KILL_AFTER_TOKENS and time.monotonic() < deadline:
                if any(s.error for s in streams):
                    return
                time.sleep(0.002)
            victim = cluster.busiest()
            cluster.kill_server(victim)
            killed.append((victim, time.monotonic()))

        say(f"{policy}: streaming, one server SIGKILLed once every stream has {KILL_AFTER_TOKENS} tokens")
        streams = _run_streams(client, prompts, kill_the_busiest)
        (victim, killed_at_s), = killed  # fmt: skip
        coordinator = cluster.gateway.coordinator
        with cluster.gateway.condition:
            failure = next(f for f in coordinator.failures if f.worker_ids == (victim,))
        survivors = [w for w in range(NUM_SERVERS) if w != victim]
        restored = [cluster.connector_stats(w) for w in survivors]
    finally:
        cluster.close()
    moved = {r.route.request_id for r in failure.reroutes}
    actions = [r.route.action for r in failure.reroutes]
    errors = [count_token_errors(e, s.token_ids) for e, s in zip(expected, streams)]
    pauses = [
        max((b - a for a, b in zip(s.times_s, s.times_s[1:]) if b >= killed_at_s), default=0.0)
        for s in streams
        if s.request_id in moved
    ]
    row = {
        "policy": policy,
        "streams": len(streams),
        "broken_streams": sum(1 for s in streams if s.error or s.finish_reasons != ["length"]),
        "duplicate_tokens": sum(e[0] for e in errors),
        "missing_tokens": sum(e[1] for e in errors),
        "changed_tokens": sum(e[2] for e in errors),
        "interrupted": len(moved),
        "restore": actions.count(RecoveryAction.RESTORE),
        "remote_restore": actions.count(RecoveryAction.REMOTE_RESTORE),
        "reprefill": actions.count(RecoveryAction.REPREFILL),
        "restored_tokens": sum(int(s.get("restored_tokens", 0)) for s in restored),
        "max_pause_s": round(max(pauses, default=0.0), 3),
        "mechanism_3": "absent (vLLM takes no outside drafts)",
    }
    return row, expected


def run_vllm_demo(args: argparse.Namespace) -> int:
    """The ``lumen demo --engine vllm`` command: prints the rows, writes them to ``--json``;
    status 1 when a stream broke or a token was duplicated, missing or changed."""
    import tempfile

    from lumen_core.auth import write_secret_file

    policies = ("S&R", "FC", "LUMEN") if args.policy == "all" else (args.policy,)
    num_streams = args.streams
    if num_streams < 1:
        print(f"lumen demo: --streams must be >= 1, got {num_streams}", file=sys.stderr)
        return 2
    started = time.monotonic()

    def say(message: str) -> None:
        print(f"[{time.monotonic() - started:6.1f} s] {message}", file=sys.stderr, flush=True)

    rows = []
    with tempfile.TemporaryDirectory(prefix="lumen-demo-vllm-") as scratch:
        workdir = Path(args.workdir) if args.workdir else Path(scratch)
        for policy in policies:
            (workdir / policy.replace("&", "n")).mkdir(parents=True, exist_ok=True)
        secret_file = workdir / "cluster.secret"
        if not secret_file.exists():
            write_secret_file(secret_file)
        model = workdir / "model"
        if not (model / "config.json").exists():
            write_tiny_llama(model)
        prompts = [_prompt(i, args.seed) for i in range(num_streams)]
        expected = None
        for policy in policies:
            row, expected = _run_policy(policy, model, workdir, secret_file, prompts, expected, say)
            rows.append(row)
            say(json.dumps(row))
    print(f"vLLM servers (CPU) behind the front door, {num_streams} greedy streams, one server SIGKILLed:")
    columns = [c for c in rows[0] if c != "mechanism_3"]
    print("  ".join(columns))
    for row in rows:
        print("  ".join(str(row[c]).ljust(len(c)) for c in columns))
    print("mechanism 3 (assisted recovery): absent over vLLM (no API for outside drafts)")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1) + "\n")
        print(f"json: {args.json}")
    failed = [r["policy"] for r in rows if r["broken_streams"] or r["duplicate_tokens"] or r["missing_tokens"]
              or r["changed_tokens"]]  # fmt: skip
    if failed:
        print(f"FAILED: streams broke or tokens differ under {', '.join(failed)}")
    print(f"wall time {time.monotonic() - started:.1f} s")
    return 1 if failed else 0
