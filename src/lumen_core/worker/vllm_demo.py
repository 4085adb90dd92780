"""``lumen demo --engine vllm``: three vLLM servers (CPU), each with its ``lumen agent``, behind
the gateway's front door; one server SIGKILLed mid-stream, under S&R, FC and LUMEN.

The official ``openai`` client streams ``--streams`` greedy completions through the front door;
once the busiest server's requests each have ``KILL_AFTER_TOKENS`` tokens (and, under FC and
LUMEN, their prompts checkpointed) its process group is SIGKILLed. One JSON row per policy:
streams broken (an error instead of a finish), tokens duplicated, missing or changed against
the failure-free run (run once, on the first policy's cluster before its failure), the
interrupted requests by the gateway's recovery action, what the survivors restored (their
connectors' control ``stats``), the longest pause an interrupted stream saw, and each
interrupted stream's failover gap in parts (``FailoverGap``). Mechanisms 1 (checkpoints
streamed to holders, restored on a survivor) and 2 (placement and routing) run here;
mechanism 3 (a recovering worker drafting for a survivor) is absent: vLLM has no API for
outside drafts. Needs the ``vllm`` extra and ``transformers`` (the tiny model is built here,
random weights).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import select
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from lumen_core.metrics import count_token_errors
from lumen_core.policy.events import RecoveryAction

if TYPE_CHECKING:
    from lumen_core.policy.driver import FailurePlan

__all__ = [
    "FailoverGap",
    "VllmCluster",
    "failover_gaps",
    "gap_summary",
    "ready_victim",
    "run_vllm_demo",
    "write_tiny_llama",
]

NUM_SERVERS = 3
MAX_TOKENS = 512  # long enough to be mid-way when the holders have reported the prompts
MAX_POSITIONS = 4096  # the tiny Llama's max_position_embeddings
KILL_AFTER_TOKENS = 8
# The tiny Llama of write_tiny_llama (the vLLM tests build theirs here too).
VOCAB = 512
NUM_LAYERS = 2
NUM_KV_HEADS = 2
HEAD_DIM = 32
MODEL_NAME = "tiny"
_KEY = "lumen-demo-vllm-key-0123456789ab"
# No prefix caching: a re-prefill must not be served from what the failure-free run (on the
# first policy's servers) left cached, or the failover gaps would flatter re-prefilling.
_SERVER_ARGS = "--skip-tokenizer-init --enforce-eager --no-enable-prefix-caching --seed 0"
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
        max_position_embeddings=MAX_POSITIONS,
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
    ends: list[int] = field(default_factory=list)  # tokens received once each chunk arrived
    finish_reasons: list[str] = field(default_factory=list)
    error: str = ""

    def received_s(self, position: int) -> float:
        """When output ``position`` reached the client (nan: never)."""
        return next((t for t, end in zip(self.times_s, self.ends) if end > position), math.nan)


@dataclass(frozen=True)
class FailoverGap:
    """One interrupted stream's gap from the SIGKILL to its next token at its client, in parts
    (seconds, all on the host's monotonic clock): ``detection`` until the gateway failed the
    server and moved the request; ``directive`` until the RESUME reached the new server's
    agent; ``server`` until that server's first token came back to the agent (its queueing,
    the restore or the prefill, one step); ``relay`` until the client had it (agent, gateway,
    front door). A request that restored, with its server's ``LookupTiming``, has ``server``
    in parts too (``server_parts``): ``api`` until vLLM's API server took the request (the
    agent's POST, HTTP), ``admit`` until its scheduler had it (input processing, the engine's
    input queue), ``queue`` until the scheduler first looked at it, ``lookup`` until the
    holder answered, ``load`` until the first token came back (the restore, one step, the
    server's event)."""

    request_id: int
    restored: bool
    detection_s: float
    directive_s: float
    server_s: float
    relay_s: float
    server_parts: dict[str, float] | None = None

    @property
    def total_s(self) -> float:
        return self.detection_s + self.directive_s + self.server_s + self.relay_s


SERVER_PARTS = ("api", "admit", "queue", "lookup", "load")
_CLOCK_SLACK_S = 0.01  # vLLM's wall-clock arrival time, mapped onto the monotonic clock


def _server_parts(timing: dict[str, Any], lookups: Sequence[dict[str, Any]]) -> dict[str, float] | None:
    """The parts of a RESUME's server time from its server's first lookup of it after the
    agent had the RESUME (None without one)."""
    request_id = str(timing["request_id"])
    lookup = min(
        (t for t in lookups
         if t["request_id"] == request_id and t["arrived_s"] >= timing["received_s"] - _CLOCK_SLACK_S),
        key=lambda t: t["arrived_s"], default=None,
    )  # fmt: skip
    if lookup is None:
        return None
    edges = [timing["received_s"], lookup["arrived_s"], lookup["added_s"], lookup["asked_s"],
             lookup["planned_s"], timing["first_token_s"]]  # fmt: skip
    return {part: b - a for part, a, b in zip(SERVER_PARTS, edges, edges[1:])}


def failover_gaps(
    killed_s: float, detected_s: float, actions: dict[int, RecoveryAction], resumes: list[dict[str, Any]],
    streams: list[_Stream], lookups: Sequence[dict[str, Any]] = (),
) -> list[FailoverGap]:  # fmt: skip
    """The gap of each moved request (``actions``: request id -> its recovery action) from the
    agents' RESUME timings after the kill (``ResumeTiming`` rows), the servers' lookups
    (``LookupTiming`` rows, for the parts of a restore) and its client's stream; a request
    without a timing or whose next token never arrived is left out."""
    by_id = {s.request_id: s for s in streams}
    actions = dict(actions)
    gaps = []
    for timing in sorted(resumes, key=lambda t: t["received_s"]):
        request_id = timing["request_id"]
        if request_id not in actions or timing["received_s"] < killed_s or request_id not in by_id:
            continue
        received_s = by_id[request_id].received_s(timing["position"])
        if math.isnan(received_s):
            continue
        restored = actions.pop(request_id) != RecoveryAction.REPREFILL  # the first RESUME after the kill
        gaps.append(FailoverGap(
            request_id,
            restored,
            detected_s - killed_s,
            timing["received_s"] - detected_s,
            timing["first_token_s"] - timing["received_s"],
            received_s - timing["first_token_s"],
            _server_parts(timing, lookups) if restored else None,
        ))  # fmt: skip
    return gaps


def gap_summary(gaps: list[FailoverGap]) -> dict[str, dict[str, float]]:
    """Mean parts in ms of the restored and of the re-prefilled gaps (``n``: how many), and of
    the restored ones' server parts (``n_parts``: how many had them)."""
    summary = {}
    for kind, restored in (("restored", True), ("reprefilled", False)):
        chosen = [g for g in gaps if g.restored == restored]
        if not chosen:
            continue
        summary[kind] = {"n": len(chosen)} | {
            f"{part}_ms": round(1e3 * sum(getattr(g, f"{part}_s") for g in chosen) / len(chosen), 1)
            for part in ("detection", "directive", "server", "relay", "total")
        }
        parted = [g.server_parts for g in chosen if g.server_parts is not None]
        if parted:
            summary[kind] |= {"n_parts": len(parted)} | {
                f"server_{part}_ms": round(1e3 * sum(p[part] for p in parted) / len(parted), 1)
                for part in SERVER_PARTS
            }
    return summary


def _prompt(i: int, seed: int, length: int) -> list[int]:
    return [(7 * i + 3 * j + 11 * seed) % (VOCAB - 8) + 5 for j in range(length)]


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
                stream.ends.append(len(stream.token_ids))
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


def ready_victim(gateway: Any, min_tokens: int, checkpointed: int) -> int | None:
    """The live server running the most requests, at least 2, once each of them has
    ``min_tokens`` output tokens and (``checkpointed`` > 0) that many tokens durable as its
    holders last reported; None while no server is. ``gateway``: a running ``GatewayServer``."""
    coordinator = gateway.coordinator
    monitor = coordinator.monitor
    victim, most = None, 1
    with gateway.condition:
        for worker_id in monitor.live_worker_ids():
            running = monitor.running_on(worker_id)
            if len(running) > most and all(
                len(coordinator.tokens(r)[0]) >= min_tokens and _durable(monitor, r) >= checkpointed
                for r in running
            ):
                victim, most = worker_id, len(running)
    return victim


def _durable(monitor: Any, request_id: int) -> int:
    return max((d for _, d in monitor.request(request_id).durable_tokens), default=0)


def _read_rest(proc: subprocess.Popen[str], into: dict[int, list[str]], key: int) -> None:
    if proc.stdout is not None:
        into[key] = proc.stdout.readlines()
        proc.stdout.close()


class VllmCluster:
    """A gateway (``policy``) with its front door, and ``num_servers`` agents each starting a
    server of ``max_model_len`` (``registered[w]["server_url"]`` is server ``w``'s own OpenAI
    endpoint; ``stopped[w]``, once closed, its agent's last line, with its stats)."""

    def __init__(
        self, policy: str, model: Path, workdir: Path, secret_file: Path, *, num_servers: int = NUM_SERVERS,
        max_model_len: int = 1024,
    ) -> None:  # fmt: skip
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
        self.stopped: dict[int, dict[str, Any]] = {}
        server_args = f"{_SERVER_ARGS} --max-model-len {max_model_len}"
        try:
            for worker_id in range(num_servers):
                argv = [
                    sys.executable, "-m", "lumen_core.cli", "agent", "--worker-id", str(worker_id),
                    "--gateway", self.gateway.address, "--secret-file", str(secret_file),
                    "--model", str(model), "--workdir", str(workdir), "--tls", "tcp", "--kv-space-gib", "1",
                    "--server-args", server_args, "--start-timeout-s", str(_START_TIMEOUT_S),
                ]  # fmt: skip
                self.agents.append(subprocess.Popen(argv, stdout=subprocess.PIPE, text=True))
            self.registered = [_read_line(agent, _START_TIMEOUT_S + 30) for agent in self.agents]
            config = FrontDoorConfig(MODEL_NAME, vocab_size=VOCAB, max_model_len=max_model_len, engine="vllm")
            self.door = FrontDoor(self.gateway, config, frozenset([_KEY])).start()
        except BaseException:
            self.close()
            raise

    api_key = _KEY  # the front door's one client key

    def client(self) -> Any:
        import openai

        return openai.OpenAI(base_url=self.door.url, api_key=_KEY, max_retries=0, timeout=600.0)

    def kill_server(self, worker_id: int) -> None:
        os.killpg(self.registered[worker_id]["server_pid"], signal.SIGKILL)

    def tokens_on(self, worker_id: int) -> list[int]:
        """How many output tokens the gateway has of each request ``worker_id`` runs."""
        coordinator = self.gateway.coordinator
        with self.gateway.condition:
            return [len(coordinator.tokens(r)[0]) for r in coordinator.monitor.running_on(worker_id)]

    def failure_of(self, worker_id: int, timeout_s: float = 30.0) -> FailurePlan:
        """The gateway's ``FailurePlan`` of ``worker_id`` alone (its exit report may come after
        the streams ended); RuntimeError if there is none within ``timeout_s``."""
        coordinator = self.gateway.coordinator

        def failure() -> FailurePlan | None:
            return next((f for f in coordinator.failures if f.worker_ids == (worker_id,)), None)

        with self.gateway.condition:
            found = self.gateway.condition.wait_for(failure, timeout_s)
        if found is None:
            raise RuntimeError(f"the gateway did not fail server {worker_id} within {timeout_s:.0f} s")
        return found

    def connector_stats(self, worker_id: int) -> dict[str, Any]:
        """Server ``worker_id``'s connector ``stats`` (docs/vllm.md): its worker's counters
        under ``worker``, its restoring requests' ``lookups``."""
        from lumen_core.integrations.vllm import control

        return control.ask(self.workdir / f"control-{worker_id}.sock", "stats")

    def close(self) -> None:
        """SIGTERM every agent (each ends its server), then the gateway."""
        for agent in self.agents:
            if agent.poll() is None:
                agent.send_signal(signal.SIGTERM)
        # Read while waiting (a stopped line with its timings may exceed a pipe's buffer), from
        # the text stream that read the registered line (it may hold what followed).
        lines: dict[int, list[str]] = {}
        readers = [threading.Thread(target=_read_rest, args=(a, lines, w)) for w, a in enumerate(self.agents)]
        for reader in readers:
            reader.start()
        for agent in self.agents:
            try:
                agent.wait(timeout=60)
            except subprocess.TimeoutExpired:
                agent.kill()
                agent.wait(timeout=10)
        for reader in readers:
            reader.join(timeout=10)
        for worker_id, output in lines.items():
            for line in output:
                if line.startswith("{") and '"stopped"' in line:
                    self.stopped[worker_id] = json.loads(line)
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
    max_model_len = max(1024, len(prompts[0]) + MAX_TOKENS)
    cluster = VllmCluster(
        policy, model, workdir / policy.replace("&", "n"), secret_file, max_model_len=max_model_len
    )
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
        victim_tokens: list[int] = []  # the output tokens of each of its requests the gateway had

        # A checkpointing policy's failure comes once the holders reported the victim's prompts:
        # the router then restores, instead of re-prefilling what it has not heard of yet.
        checkpointed = 0 if policy == "S&R" else len(prompts[0])

        def kill_the_busiest(streams: list[_Stream]) -> None:
            deadline = time.monotonic() + 600.0
            while (victim := ready_victim(cluster.gateway, KILL_AFTER_TOKENS, checkpointed)) is None:
                if any(s.error for s in streams) or time.monotonic() > deadline:
                    return  # no failure: said below
                if all(s.finish_reasons for s in streams):
                    return
                time.sleep(0.005)
            killed_at_s = time.monotonic()  # the SIGKILL is delivered within the call
            cluster.kill_server(victim)
            killed.append((victim, killed_at_s))
            victim_tokens.extend(cluster.tokens_on(victim))

        say(
            f"{policy}: streaming, the busiest server SIGKILLed once each of its requests has "
            f"{KILL_AFTER_TOKENS} tokens" + ("" if policy == "S&R" else " and its prompt checkpointed")
        )
        streams = _run_streams(client, prompts, kill_the_busiest)
        if not killed:
            raise RuntimeError(
                f"{policy}: no server was killed: a stream broke, or the streams ended before a server ran "
                "2 requests that met the failure's rule"
            )
        (victim, killed_at_s), = killed  # fmt: skip
        failure = cluster.failure_of(victim)
        detected_s = cluster.gateway.monotonic_s(failure.time_s)
        survivors = [w for w in range(NUM_SERVERS) if w != victim]
        connectors = [cluster.connector_stats(w) for w in survivors]
    finally:
        cluster.close()
    actions = {r.route.request_id: r.route.action for r in failure.reroutes}
    resumes = [t for w in survivors for t in cluster.stopped.get(w, {}).get("resumes", ())]
    restored = [c["worker"] for c in connectors]
    lookups = [t for c in connectors for t in c.get("lookups", ())]
    gaps = failover_gaps(killed_at_s, detected_s, actions, resumes, streams, lookups)
    exited_s = cluster.stopped.get(victim, {}).get("server_exited_s")
    restore_us = sum(int(s.get("restore_us", 0)) for s in restored)
    num_restores = sum(int(s.get("restores", 0)) for s in restored)
    counts = Counter(actions.values())
    errors = [count_token_errors(e, s.token_ids) for e, s in zip(expected, streams)]
    pauses = [
        max((b - a for a, b in zip(s.times_s, s.times_s[1:]) if b >= killed_at_s), default=0.0)
        for s in streams
        if s.request_id in actions
    ]
    row = {
        "policy": policy,
        "streams": len(streams),
        "broken_streams": sum(1 for s in streams if s.error or s.finish_reasons != ["length"]),
        "duplicate_tokens": sum(e[0] for e in errors),
        "missing_tokens": sum(e[1] for e in errors),
        "changed_tokens": sum(e[2] for e in errors),
        "victim_tokens": sorted(victim_tokens),
        "interrupted": len(actions),
        "restore": counts[RecoveryAction.RESTORE],
        "remote_restore": counts[RecoveryAction.REMOTE_RESTORE],
        "reprefill": counts[RecoveryAction.REPREFILL],
        "restored_tokens": sum(int(s.get("restored_tokens", 0)) for s in restored),
        "max_pause_s": round(max(pauses, default=0.0), 3),
        # Of the detection: the victim's agent saw its server's exit (the rest: its report).
        "exit_seen_ms": round(1e3 * (exited_s - killed_at_s), 1) if exited_s is not None else None,
        # Of a restore's server part: the connector's own time (reads, checks, writes).
        "restore_load_ms": round(1e-3 * restore_us / num_restores, 1) if num_restores else None,
        "failover_gap": gap_summary(gaps),
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
    most = MAX_POSITIONS - MAX_TOKENS  # the tiny model's positions less the outputs
    if not 1 <= args.prompt_tokens <= most:
        message = f"--prompt-tokens must be in [1, {most}], got {args.prompt_tokens}"
        print(f"lumen demo: {message}", file=sys.stderr)
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
        prompts = [_prompt(i, args.seed, args.prompt_tokens) for i in range(num_streams)]
        expected = None
        for policy in policies:
            row, expected = _run_policy(policy, model, workdir, secret_file, prompts, expected, say)
            rows.append(row)
            say(json.dumps(row))
    print(f"vLLM servers (CPU) behind the front door, {num_streams} greedy streams of "
          f"{args.prompt_tokens}-token prompts, one server SIGKILLed:")  # fmt: skip
    columns = [c for c in rows[0] if c not in ("mechanism_3", "failover_gap", "victim_tokens")]
    print("  ".join(columns))
    for row in rows:
        print("  ".join(str(row[c]).ljust(len(c)) for c in columns))
    print("failover gap per interrupted stream, mean ms from the SIGKILL (one host clock):")
    parts = ("n", "detection_ms", "directive_ms", "server_ms", "relay_ms", "total_ms")
    print("policy  kind         " + "  ".join(parts))
    for row in rows:
        for kind, summary in row["failover_gap"].items():
            print(f"{row['policy']:<7} {kind:<12} " + "  ".join(str(summary[p]).ljust(len(p)) for p in parts))
    parted = [(row["policy"], s) for row in rows for s in row["failover_gap"].values() if "n_parts" in s]
    if parted:
        print("a restored stream's server part, mean ms: until vLLM's API server, its scheduler, its first")
        print("look, the holder's answer, the first token back")
        parts = ("n_parts", *(f"server_{p}_ms" for p in SERVER_PARTS))
        print("policy  " + "  ".join(parts))
        for policy, summary in parted:
            print(f"{policy:<7} " + "  ".join(str(summary[p]).ljust(len(p)) for p in parts))
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
