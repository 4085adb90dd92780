"""Engine figures of LumenConnector in vLLM's CPU build (issue 18): what checkpointing every
token and restoring cost a real engine, each against a same-run baseline. bench/vllm_stream.py
measures the copy half (gather and scatter against memcpy).

Two geometries, random fp32 weights built here (``transformers`` + ``save_pretrained``; fp32
because CPUs with AMX prepack bf16 blocks, which the connector refuses):

- ``stream_stress``: 32 layers x 8 KV heads x head_dim 128 on hidden size 256, 256 KiB of KV
  per token: every decoded token of every request streams 256 KiB to the holder.
  ``itl_p50_ratio`` / ``itl_p99_ratio``: decode step time (the inter-token latency of every
  running request) of ``--requests`` concurrent requests with the connector streaming each
  token to a ``lumen holder``, over the same engine without the connector; rounds interleaved
  (plain, connector, connector, plain) ``--reps`` times, a fresh engine each. Every prompt
  has 32 tokens, so all requests end a K line in the same step; ``--prompt-spread 16`` gives
  request i 32 + i % 16, spreading those steps as mixed prompt lengths do.
  ``itl_mean_ratio`` and ``step_ms_p50`` of the plain engine beside them.
  ``durable_within_2_steps``: of the tokens computed, the share durable on the holder two
  steps later ("never blocks the step" must not be met by falling behind). The connector
  saves vLLM CPU's K in whole 64-byte lines (16 fp32 tokens, ``KVLayout.line_tokens``),
  holding at most 15 tokens of a request back (``ConnectorCore.save_step``), as issue 18
  allows: ``durable_within_2_steps_of_line`` counts from the step that filled a token's line,
  and ``durable_lag_max_tokens`` is the most a request's durable length trailed what it had
  computed two steps before; ``durable_within_2_steps_decoded`` leaves out the tokens of each
  request's prefill step (all requests prefill together: 256 MiB at 32 requests, staged one
  64 MiB buffer a step unless ``--staging-mib`` sets the connector's ``staging_bytes``).
  ``--no-hold-lines`` saves every token in its step (the connector's ``hold_lines``).
  ``--split-cores`` runs the forward on the first CPU with one OpenMP thread,
  and the connector's threads (its ``cpus``) and the holder on the others, as on a server
  whose forward has cores (or an accelerator) of its own; plain rounds get the same forward.
  The holder maps ``--holder-reserve-bytes`` at its start (4 GiB, more than a round's records;
  ``lumen holder --reserve-bytes``); with 0 it maps memory as checkpoints grow, and the
  kernel's zeroing of each new page runs on the engine's cores.
- ``prefill_costly``: hidden size 1024, 8 layers, a 2,000-token prefill of 1 s or more here.
  ``replay_ttft_restore_vs_recompute``: time to the first token of a 2,000-token request resumed
  from its checkpoint over the same request recomputed, in one fresh engine (prefix caching off),
  alternating. ``itl_p99_during_restores_ratio``: p99 decode step time of 32 running requests
  while 4 others of 2,000 tokens are restored into the same engine, over the same steps of a
  run without the restores.

Rows carry ``geometry``, ``metric`` and ``value``. Needs the ``vllm`` extra (``make vllm-env``);
runs vLLM in-process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``) to time each step.

    VLLM_CPU_KVCACHE_SPACE=4 python bench/vllm_engine.py --json vllm_engine.json
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # one process: steps timed here

import numpy as np

from lumen_core.auth import (
    read_issuer_key_file,
    write_issuer_key_file,
    write_issuer_public_key_file,
    write_secret_file,
)

VOCAB = 512
GEOMETRIES: dict[str, dict[str, int]] = {
    "stream_stress": {"hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 32,
                      "num_attention_heads": 8, "num_key_value_heads": 8, "head_dim": 128},
    "prefill_costly": {"hidden_size": 1024, "intermediate_size": 4096, "num_hidden_layers": 8,
                       "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 64},
}  # fmt: skip
LONG_PROMPT = 2000
RESTORED = 4  # requests restored while RUNNING decode
RUNNING = 32
# A holder that reserves its memory takes no page fault while it receives (docs/streaming.md).
# A 64-request round's records are 2 GiB (128 tokens x 256 KiB each); with a 2 GiB reserve the
# holder still mapped memory in that round (17 ms of its CPU a step, 8 with 4 GiB).
HOLDER_RESERVE_BYTES = 4 << 30


class _Cores:
    """``--split-cores``: the forward (this process's main thread, one OpenMP thread) on the
    first CPU; the connector's threads (its ``cpus``) and the holder on the rest, as on a
    server whose forward runs on its accelerator, or on the cores vLLM's CPU binding gives it
    (with a KV connector it keeps one more core back). Off: nothing is placed."""

    def __init__(self, split: bool) -> None:
        cpus = sorted(os.sched_getaffinity(0))
        if split and len(cpus) < 2:
            raise SystemExit("--split-cores needs at least 2 CPUs")
        self.host: list[int] | None = cpus[1:] if split else None
        if split:
            os.environ["OMP_NUM_THREADS"] = "1"  # read once, when torch's OpenMP starts
            os.sched_setaffinity(0, cpus[:1])  # this thread; the threads it starts inherit it

    def holder_preexec(self) -> Any:
        host = self.host
        return None if host is None else (lambda: os.sched_setaffinity(0, host))


def _progress(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def _build(path: Path, geometry: str) -> Path:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=VOCAB, max_position_embeddings=4096, initializer_range=0.05,
                         tie_word_embeddings=False, **GEOMETRIES[geometry])  # fmt: skip
    torch.manual_seed(0)
    LlamaForCausalLM(config).eval().save_pretrained(path)
    return path


class _Holder:
    """A `lumen holder` process on loopback, trusting the bench's issuer."""

    def __init__(
        self, secret_file: Path, public_key: Path, budget_bytes: int, reserve_bytes: int, cores: _Cores
    ) -> None:
        argv = [sys.executable, "-m", "lumen_core.cli", "holder", "--port", "0", "--budget-bytes",
                str(budget_bytes), "--reserve-bytes", str(reserve_bytes), "--secret-file", str(secret_file),
                "--issuer-key-file", str(public_key), "--tls", "tcp"]  # fmt: skip
        self.proc = subprocess.Popen(
            argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, preexec_fn=cores.holder_preexec()
        )
        assert self.proc.stdout is not None
        self.port = int(json.loads(self.proc.stdout.readline())["port"])

    def cpu_s(self) -> float:
        """CPU seconds the holder process used so far (user + system)."""
        fields = Path(f"/proc/{self.proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def close(self) -> None:
        self.proc.kill()
        self.proc.wait(timeout=10)


class _Bench:
    def __init__(
        self,
        workdir: Path,
        holder_reserve_bytes: int,
        restore_nice: int,
        hold_lines: bool,
        staging_bytes: int,
        cores: _Cores,
    ) -> None:
        self.workdir = workdir
        self.hold_lines = hold_lines
        self.staging_bytes = staging_bytes
        self.cores = cores
        self.restore_nice = restore_nice
        self.secret_file = workdir / "secret"
        write_secret_file(self.secret_file)
        self.issuer_key_file = workdir / "issuer.key"
        write_issuer_key_file(self.issuer_key_file)
        from lumen_core.auth import CapabilityIssuer

        self.issuer = CapabilityIssuer(read_issuer_key_file(self.issuer_key_file))
        public = workdir / "issuer.pub"
        write_issuer_public_key_file(public, self.issuer.public_key)
        self.holder = _Holder(self.secret_file, public, 8 << 30, holder_reserve_bytes, cores)
        self._sockets = 0

    def durable_tokens(self, request_id: str, record_bytes: int) -> int:
        """The holder's durable length of ``request_id``'s checkpoint (0 when it holds none)."""
        from lumen_core.auth import Rights, read_secret_file
        from lumen_core.stream import request_key
        from lumen_core.transport import Client, Rejected

        key = request_key(request_id)
        capability = self.issuer.issue(key, 0, 0, holder_id=0, rights=Rights.READ)
        with Client("127.0.0.1", self.holder.port, read_secret_file(self.secret_file), tls="tcp") as client:
            try:
                read = client.read(key, 0, 0, 0, 1, record_bytes, capability)
            except Rejected:
                return 0
        return int(read.durable_tokens)

    def engine(self, model: Path, *, connector: bool, keep: bool = False, **overrides: Any) -> Any:
        """A fresh in-process engine; with ``connector`` it streams every request to the holder
        (``keep``: finished requests keep their checkpoints, as under a gateway)."""
        from vllm import LLM

        kwargs: dict[str, Any] = {
            "model": str(model),
            "skip_tokenizer_init": True,
            "dtype": "float32",
            "enforce_eager": True,
            "max_model_len": 4096,
            "seed": 0,
            **overrides,
        }
        if connector:
            extra: dict[str, Any] = {
                "secret_file": str(self.secret_file),
                "issuer_key_file": str(self.issuer_key_file),
                "holders": [f"127.0.0.1:{self.holder.port}"],
                "tls": "tcp",
                "restore_nice": self.restore_nice,
                "hold_lines": self.hold_lines,
                "staging_bytes": self.staging_bytes,
            }
            if self.cores.host is not None:
                extra["cpus"] = self.cores.host
            if keep:
                self._sockets += 1
                extra["control_socket"] = str(self.workdir / f"control{self._sockets}.sock")
            kwargs["kv_transfer_config"] = {
                "kv_connector": "LumenConnector",
                "kv_connector_module_path": "lumen_core.integrations.vllm",
                "kv_role": "kv_both",
                "kv_load_failure_policy": "recompute",
                "kv_connector_extra_config": extra,
            }
        return LLM(**kwargs)

    def close(self) -> None:
        self.holder.close()


def _sampling(max_tokens: int, request_id: str | None = None, **lumen: Any) -> Any:
    from vllm import SamplingParams

    extra = (
        None if request_id is None else {"kv_transfer_params": {"lumen": {"request_id": request_id, **lumen}}}
    )
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, extra_args=extra)


def _prompt(i: int, n: int) -> list[int]:
    return [(31 * i + 7 * j) % (VOCAB - 8) + 5 for j in range(n)]


def _drop(llm: Any) -> None:
    """Shut the engine down, its connector with it: vLLM keeps one connector per process,
    which the next engine would reuse, and its engine core froze itself out of the collector."""
    llm.llm_engine.engine_core.shutdown()
    del llm
    gc.collect()


def _decode_steps(llm: Any, num_requests: int, prompt_tokens: int, max_tokens: int, *, tag: str,
                  durable: bool, spread: int = 1) -> tuple[list[float], dict[str, float]]:  # fmt: skip
    """Step times (s) while all ``num_requests`` decode; the share of computed tokens durable
    two steps after they were computed, the share durable two steps after their K line was
    whole (the save path holds a token until then: ``KVLayout.line_tokens``), the most tokens
    a request's durable length trailed what it had computed two steps before (nan without
    ``durable``), and with ``durable`` the streamer's ``_STREAMER_COUNTERS`` of the round."""
    engine = llm.llm_engine
    prompt_lengths = {f"{tag}-{i}": prompt_tokens + i % spread for i in range(num_requests)}
    for i, (rid, length) in enumerate(prompt_lengths.items()):
        engine.add_request(rid, {"prompt_token_ids": _prompt(i, length)}, _sampling(max_tokens, rid))
    worker = None
    if durable:
        from vllm.distributed.kv_transfer import get_kv_transfer_group

        worker = get_kv_transfer_group().worker
    started: set[str] = set()
    produced: dict[str, int] = {}
    times: list[float] = []
    computed_log: list[dict[str, int]] = []
    durable_log: list[dict[str, int]] = []
    finished = 0
    while engine.has_unfinished_requests():
        t0 = time.perf_counter()
        outputs = engine.step()
        elapsed = time.perf_counter() - t0
        decoding = len(started) == num_requests and finished == 0
        for out in outputs:
            produced[out.request_id] = len(out.outputs[0].token_ids)
            started.add(out.request_id)
            finished += out.finished
        if decoding:
            times.append(elapsed)
        if worker is not None:
            # The KV of every token but the last sampled one is computed.
            computed_log.append({r: prompt_lengths[r] + n - 1 for r, n in produced.items()})
            durable_log.append(worker.durable_tokens())
    durability = {
        "durable_within_2_steps": float("nan"),
        "durable_within_2_steps_decoded": float("nan"),
        "durable_within_2_steps_of_line": float("nan"),
        "durable_lag_max_tokens": float("nan"),
    }
    if worker is not None:
        good, total = [0, 0], [0, 0]  # [prefill, decoded] tokens
        lag_max = 0
        for k, computed in enumerate(computed_log):
            before = computed_log[k - 1] if k else {}
            later = durable_log[min(k + 2, len(durable_log) - 1)]
            for r, end in computed.items():
                start = before.get(r, 0)
                kind = int(r in before)
                total[kind] += end - start
                good[kind] += max(0, min(end, later.get(r, 0)) - start)
                if r in later:  # still streaming two steps on (a finished request is forgotten)
                    lag_max = max(lag_max, end - later[r])
        line = worker.core.layout.line_tokens if worker.core.hold_lines else 1
        durability = {
            "durable_within_2_steps": sum(good) / sum(total),
            "durable_within_2_steps_decoded": good[1] / total[1],
            "durable_within_2_steps_of_line": _durable_after_line(computed_log, durable_log, line),
            "durable_lag_max_tokens": float(lag_max),
        }
        counters = worker.core.streamer_counters()
        for name in _STREAMER_COUNTERS:
            durability[name] = float(counters.get(name, 0))
        # The offline engine takes no step after its last outputs, in which the connector
        # would learn they finished and release their checkpoints: release them here, or the
        # next rounds' find the holder full (it evicts, and replicas are lost).
        for r in prompt_lengths:
            worker.core.finish(r)
    return times, durability


# The streamer's counts of a round that say it fell behind (none when it kept up).
_STREAMER_COUNTERS = ("holder_failures", "replicas_lost", "tokens_dropped", "tokens_deferred")


def _durable_after_line(
    computed_log: list[dict[str, int]], durable_log: list[dict[str, int]], line: int
) -> float:
    """Of the tokens computed, the share durable two steps after the step that computed the
    last token of their K line (or the request's last step, when its line never filled).
    Tokens judged at a step after their request finished (it is forgotten there) are left out."""
    good = total = 0
    for r in computed_log[-1]:
        steps = [k for k, computed in enumerate(computed_log) if r in computed]
        done = 0
        for k in steps:
            end = computed_log[k][r]
            for p in range(done, end):
                whole = (p // line + 1) * line
                filled = next((j for j in steps if j >= k and computed_log[j][r] >= whole), steps[-1])
                judged = filled + 2
                if judged < len(durable_log) and r in durable_log[judged]:
                    total += 1
                    good += durable_log[judged][r] > p
            done = max(done, end)
    return good / total if total else float("nan")


def stream_stress(
    bench: _Bench, model: Path, requests: list[int], reps: int, spread: int
) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    for n in requests:
        times: dict[str, list[float]] = {"plain": [], "connector": []}
        # CPU seconds per decoded step of this process (engine, streamer) and of the holder.
        cpu: dict[str, list[tuple[float, float]]] = {"plain": [], "connector": []}
        durability: dict[str, list[float]] = {}
        for rep in range(reps):
            # Request ids unique to their round: a released checkpoint's key stays fenced on
            # the holder (an open at its epoch is refused as stale).
            for turn, kind in enumerate(("plain", "connector", "connector", "plain")):
                llm = bench.engine(model, connector=kind == "connector")
                before = (time.process_time(), bench.holder.cpu_s())
                tag = f"{kind}{n}.{rep}.{turn}"
                steps, measured = _decode_steps(
                    llm, n, 32, 96, tag=tag, durable=kind == "connector", spread=spread
                )
                cpu[kind].append(
                    ((time.process_time() - before[0]) / 96, (bench.holder.cpu_s() - before[1]) / 96)
                )
                _drop(llm)
                times[kind] += steps
                if kind == "connector":
                    for name, value in measured.items():
                        durability.setdefault(name, []).append(value)
                _progress(f"stream_stress {n} requests, {kind}: step p50 {1e3 * np.median(steps):.1f} ms")
        plain, conn = np.array(times["plain"]), np.array(times["connector"])
        rows += [
            {"metric": "itl_p50_ratio", "value": float(np.median(conn) / np.median(plain)), "requests": n},
            {
                "metric": "itl_p99_ratio",
                "value": float(np.percentile(conn, 99) / np.percentile(plain, 99)),
                "requests": n,
            },
            # The mean carries what the p50 may not: steps in which many requests' lines end.
            {"metric": "itl_mean_ratio", "value": float(np.mean(conn) / np.mean(plain)), "requests": n},
            {"metric": "step_ms_p50", "value": float(1e3 * np.median(plain)), "requests": n},
        ]
        # The worst round of each, with every round's value beside it.
        for name, values in durability.items():
            worst = (
                max(values) if name == "durable_lag_max_tokens" or name in _STREAMER_COUNTERS else min(values)
            )
            rows.append({"metric": name, "value": worst, "rounds": values, "requests": n})
        for kind, samples in cpu.items():
            for who, at in (("engine", 0), ("holder", 1)):
                value = 1e3 * float(np.median([c[at] for c in samples]))
                rows.append({"metric": f"{who}_cpu_ms_per_step_{kind}", "value": value, "requests": n})
    return [{**row, "prompt_spread": spread} for row in rows]


def _first_token_s(llm: Any, request_id: str, prompt: list[int], sampling: Any) -> float:
    engine = llm.llm_engine
    start = time.perf_counter()
    engine.add_request(request_id, {"prompt_token_ids": prompt}, sampling)
    first = float("nan")
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.request_id == request_id and out.outputs[0].token_ids and math.isnan(first):
                first = time.perf_counter() - start
    return first


def prefill_costly(bench: _Bench, model: Path, reps: int) -> list[dict[str, Any]]:
    # The checkpoints: RESTORED requests of LONG_PROMPT tokens and 8 outputs, kept on the holder.
    llm = bench.engine(model, connector=True, keep=True)
    prompts = {f"long{i}": _prompt(100 + i, LONG_PROMPT) for i in range(RESTORED)}
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts.values()],
                           [_sampling(8, r) for r in prompts])  # fmt: skip
    resumed = {r: p + list(o.outputs[0].token_ids) for (r, p), o in zip(prompts.items(), outputs)}
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    worker = get_kv_transfer_group().worker
    # The offline LLM takes no step after its outputs are done, in which the worker would learn
    # they finished and hand over the tails it holds back to whole cache lines: here, then.
    worker.core.flush()
    record_bytes = worker.layout.record_bytes
    deadline = time.monotonic() + 60
    while (
        min(durable := {r: bench.durable_tokens(r, record_bytes) for r in prompts}.values()) < LONG_PROMPT + 7
    ):
        if time.monotonic() > deadline:
            raise RuntimeError(f"the checkpoints did not become durable: {durable}")
        time.sleep(0.05)
    _drop(llm)
    _progress("prefill_costly: checkpoints made")

    # TTFT, restored vs recomputed, alternating in one engine without prefix caching.
    llm = bench.engine(model, connector=True, keep=True, enable_prefix_caching=False)
    restore_s, recompute_s = [], []
    epoch = 0
    for rep in range(reps):
        epoch += 1
        recompute_s.append(_first_token_s(llm, f"recompute{rep}", resumed["long0"], _sampling(1)))
        restore_s.append(
            _first_token_s(
                llm, f"restore{rep}", resumed["long0"], _sampling(1, "long0", epoch=epoch, restore={})
            )
        )
        _progress(f"prefill_costly TTFT: recompute {recompute_s[-1]:.3f} s, restore {restore_s[-1]:.3f} s")
    rows: list[dict[str, Any]] = [
        {
            "metric": "replay_ttft_restore_vs_recompute",
            "value": float(np.median(restore_s) / np.median(recompute_s)),
            "restore_s": restore_s,
            "recompute_s": recompute_s,
            "prompt_tokens": LONG_PROMPT + 7,
        },
    ]

    # Decode steps of RUNNING requests with and without RESTORED restores into the same engine.
    ratios = []
    for rep in range(reps):
        epoch += 1
        restoring = _steps_around_restores(llm, resumed, epoch, f"restoring{rep}", None)
        alone = _steps_around_restores(llm, None, epoch, f"alone{rep}", len(restoring))
        ratios.append(float(np.percentile(restoring, 99) / np.percentile(alone, 99)))
        _progress(f"prefill_costly ITL p99 during restores: {ratios[-1]:.2f}x over {len(alone)} steps")
    _drop(llm)
    rows.append(
        {
            "metric": "itl_p99_during_restores_ratio",
            "value": float(np.median(ratios)),
            "ratios": ratios,
            "running": RUNNING,
            "restored": RESTORED,
        }
    )
    return rows


def _steps_around_restores(llm: Any, resumed: dict[str, list[int]] | None, epoch: int, tag: str,
                           num_steps: int | None) -> list[float]:  # fmt: skip
    """Step times of RUNNING decoding requests from when they all decode: until each of the
    ``resumed`` requests, restored at ``epoch``, has its token, or ``num_steps`` steps."""
    engine = llm.llm_engine
    running = [f"{tag}-{i}" for i in range(RUNNING)]
    for i, rid in enumerate(running):
        engine.add_request(rid, {"prompt_token_ids": _prompt(i, 64)}, _sampling(1000))
    started: set[str] = set()
    while len(started & set(running)) < RUNNING:
        started |= {o.request_id for o in engine.step() if o.outputs[0].token_ids}
    waiting: set[str] = set()
    for r, prompt in (resumed or {}).items():
        rid = f"{tag}-{r}"
        engine.add_request(rid, {"prompt_token_ids": prompt}, _sampling(1, r, epoch=epoch, restore={}))
        waiting.add(rid)
    times: list[float] = []
    while (len(times) < num_steps) if num_steps is not None else waiting:
        t0 = time.perf_counter()
        outputs = engine.step()
        times.append(time.perf_counter() - t0)
        waiting -= {o.request_id for o in outputs if o.outputs[0].token_ids}
        if len(times) > 2000:
            raise RuntimeError(f"restores did not finish in 2000 steps: {sorted(waiting)}")
    engine.abort_request(running)
    while engine.has_unfinished_requests():
        engine.step()
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", default=None, metavar="PATH")
    parser.add_argument(
        "--requests", default="32,64", help="stream_stress: concurrent requests, comma-separated"
    )
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument(
        "--prompt-spread",
        type=int,
        default=1,
        help="stream_stress: request i's prompt has 32 + i %% N tokens (1: all 32, their lines end together)",
    )
    parser.add_argument("--only", choices=sorted(GEOMETRIES), default=None)
    parser.add_argument(
        "--holder-reserve-bytes",
        type=int,
        default=HOLDER_RESERVE_BYTES,
        help="the holder's memory mapped at its start (`lumen holder --reserve-bytes`; 0: none)",
    )
    parser.add_argument(
        "--restore-nice",
        type=int,
        default=0,
        choices=range(20),
        metavar="0-19",
        help="the connector's `restore_nice` (19: restores take the cores' idle time)",
    )
    parser.add_argument(
        "--split-cores",
        action="store_true",
        help="the forward on the first CPU (one OpenMP thread); connector threads and holder on the rest",
    )
    parser.add_argument(
        "--no-hold-lines",
        action="store_true",
        help="the connector's `hold_lines` off: every token saved in its step, not held to a whole K line",
    )
    parser.add_argument(
        "--staging-mib",
        type=int,
        default=64,
        help="the connector's `staging_bytes` in MiB: the most a step hands over to the streamer",
    )
    args = parser.parse_args()
    cores = _Cores(args.split_cores)
    if args.prompt_spread < 1:
        parser.error(f"--prompt-spread must be >= 1, got {args.prompt_spread}")
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as scratch:
        workdir = Path(scratch)
        bench = _Bench(
            workdir,
            args.holder_reserve_bytes,
            args.restore_nice,
            not args.no_hold_lines,
            args.staging_mib << 20,
            cores,
        )
        try:
            if args.only in (None, "stream_stress"):
                model = _build(workdir / "stream_stress", "stream_stress")
                requests = [int(n) for n in args.requests.split(",")]
                rows += [
                    {"geometry": "stream_stress", **r}
                    for r in stream_stress(bench, model, requests, args.reps, args.prompt_spread)
                ]
            if args.only in (None, "prefill_costly"):
                model = _build(workdir / "prefill_costly", "prefill_costly")
                rows += [{"geometry": "prefill_costly", **r} for r in prefill_costly(bench, model, args.reps)]
        finally:
            bench.close()
    for row in rows:
        print(f"{row['geometry']:15} {row['metric']:34} {row['value']:.3f}")
    if args.json:
        Path(args.json).write_text(json.dumps({"rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
