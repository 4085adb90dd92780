"""A vLLM server (CPU) reached through the gateway's front door against the same server reached
directly (issue 20): TTFT and output tokens per second, one run, rounds alternating.

One ``lumen agent`` starts one ``vllm serve`` (the tiny Llama of ``vllm_demo``) behind a
gateway under S&R, so no checkpoint streams: what differs between the two paths is the
gateway (front door, admission, the RUN directive pushed to the agent, the agent's upstream
request and token reports, the relay back). A client process (httpx, asyncio; the same code
for both paths) sends ``--streams`` concurrent greedy streaming completions of
``--prompt-tokens`` token ids and ``--max-tokens`` outputs (EOS ignored), to the server's
own ``/v1/completions`` or to the front door's, in rounds direct, gateway, gateway, direct
(``--rounds`` such groups). TTFT: first token's arrival minus the request's send, per stream;
throughput: a round's output tokens over its wall time (first send to last token). Rows
``metric`` / ``value`` per path (``direct``, ``gateway``) and the differences the issue's
targets name: ``ttft_p50_delta_ms`` (gateway minus direct, p50 of each), ``throughput_ratio``
(gateway over direct, the rounds' sums). Where the time goes: each path's mean CPU seconds
per round of the server (``vllm serve`` and its engine process), the agent, the gateway
(this process) and the client (``cpu_s_server`` ...), and the agent's tokens per token
report (``tokens_per_report``: its batching of ReportTokens calls). Needs the ``vllm`` extra
(``make vllm-env``).

    python bench/front_door_vllm.py --streams 64 --json front_door_vllm.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import numpy as np

from lumen_core.auth import write_secret_file
from lumen_core.worker.exit_watch import stat_fields
from lumen_core.worker.vllm_demo import MODEL_NAME, VOCAB, VllmCluster, write_tiny_llama

_TICKS_PER_S = os.sysconf("SC_CLK_TCK")


def _cpu_s(pid: int, *, group: bool = False) -> float:
    """CPU seconds (user + system, every thread) of process ``pid``, or with ``group`` of
    every live process in the process group it leads."""
    total = 0
    for stat_path in Path("/proc").glob("[0-9]*/stat") if group else [Path(f"/proc/{pid}/stat")]:
        try:
            fields = stat_fields(stat_path.read_bytes())
        except OSError:  # ended meanwhile
            continue
        if not group or int(fields[2]) == pid:  # field 5: the process group
            total += int(fields[11]) + int(fields[12])  # fields 14 and 15: utime, stime
    return total / _TICKS_PER_S


def _prompt(i: int, length: int) -> list[int]:
    return [(7 * i + 3 * j) % (VOCAB - 8) + 5 for j in range(length)]


async def _round(
    url: str, key: str, model: str, num_streams: int, prompt_tokens: int, max_tokens: int
) -> dict:
    """One round: every stream's TTFT (s) and token count, and the round's wall time (s)."""
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    limits = httpx.Limits(max_connections=num_streams)
    async with httpx.AsyncClient(timeout=600.0, limits=limits) as http:

        async def one(i: int) -> tuple[float, int]:
            body = {
                "model": model, "prompt": _prompt(i, prompt_tokens), "max_tokens": max_tokens,
                "temperature": 0.0, "stream": True,
            }  # fmt: skip
            if not key:  # the server: as the agent asks (the front door gives ids, runs max_tokens)
                body.update(return_token_ids=True, ignore_eos=True)
            sent = time.monotonic()
            first = float("nan")
            count = 0
            async with http.stream("POST", f"{url}/completions", json=body, headers=headers) as response:
                if response.status_code != 200:
                    raise RuntimeError(f"{url}: {response.status_code} {(await response.aread())[:300]!r}")
                async for line in response.aiter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    event = json.loads(line.removeprefix("data: "))
                    if "error" in event:
                        raise RuntimeError(f"{url}: {event['error']}")
                    got = sum(len(c.get("token_ids") or ()) for c in event["choices"])
                    if got and count == 0:
                        first = time.monotonic() - sent
                    count += got
            return first, count

        started = time.monotonic()
        cpu = time.process_time()
        results = await asyncio.gather(*(one(i) for i in range(num_streams)))
        wall = time.monotonic() - started
    return {
        "ttft_s": [r[0] for r in results], "tokens": [r[1] for r in results], "wall_s": wall,
        "cpu_s_client": time.process_time() - cpu,
    }  # fmt: skip


def measure(num_streams: int, prompt_tokens: int, max_tokens: int, rounds: int, workdir: Path) -> list[dict]:
    secret_file = workdir / "cluster.secret"
    write_secret_file(secret_file)
    model = write_tiny_llama(workdir / "model")
    (workdir / "cluster").mkdir()
    cluster = VllmCluster("S&R", model, workdir / "cluster", secret_file, num_servers=1)
    # The server names the model by its path (as the agent's requests do); the front door by
    # its own model name.
    paths = {"direct": (cluster.registered[0]["server_url"].rstrip("/") + "/v1", "", str(model)),
             "gateway": (cluster.door.url, cluster.api_key, MODEL_NAME)}  # fmt: skip
    runs: dict[str, list[dict]] = {"direct": [], "gateway": []}
    processes = {
        "server": lambda: _cpu_s(cluster.registered[0]["server_pid"], group=True),
        "agent": lambda: _cpu_s(cluster.agents[0].pid),
        "gateway": lambda: _cpu_s(os.getpid()),
    }
    try:
        order = ["direct", "gateway", "gateway", "direct"] * rounds
        for i, path in enumerate(["direct", *order]):  # a first, discarded round warms the server
            url, key, name = paths[path]
            argv = [sys.executable, __file__, "--client", url, "--key", key, "--model-name", name,
                    "--streams", str(num_streams),
                    "--prompt-tokens", str(prompt_tokens), "--max-tokens", str(max_tokens)]  # fmt: skip
            before = {name: cpu() for name, cpu in processes.items()}
            done = subprocess.run(argv, capture_output=True, text=True, timeout=900)
            if done.returncode != 0:
                raise RuntimeError(f"the {path} client failed: {done.stderr[-2000:]}")
            result = json.loads(done.stdout)
            result.update({f"cpu_s_{name}": cpu() - before[name] for name, cpu in processes.items()})
            expected = num_streams * max_tokens
            if sum(result["tokens"]) != expected:
                raise RuntimeError(f"{path}: {sum(result['tokens'])} tokens, expected {expected}")
            if i > 0:
                runs[path].append(result)
            print(f"round {i} {path:7}: {result['wall_s']:.2f} s", file=sys.stderr, flush=True)
    finally:
        cluster.close()
    agent = cluster.stopped.get(0, {})
    rows: list[dict] = []
    if agent.get("token_reports"):  # the agent served the gateway rounds only
        rows.append(
            {
                "path": "gateway",
                "metric": "tokens_per_report",
                "value": agent["tokens"] / agent["token_reports"],
            }
        )
    summary = {}
    for path, results in runs.items():
        ttft_ms = np.array([t for r in results for t in r["ttft_s"]]) * 1e3
        tokens_per_s = sum(sum(r["tokens"]) for r in results) / sum(r["wall_s"] for r in results)
        summary[path] = (float(np.percentile(ttft_ms, 50)), tokens_per_s)
        rows += [
            {"path": path, "metric": "ttft_p50_ms", "value": summary[path][0]},
            {"path": path, "metric": "ttft_p99_ms", "value": float(np.percentile(ttft_ms, 99))},
            {"path": path, "metric": "tokens_per_s", "value": tokens_per_s},
            {"path": path, "metric": "wall_s", "value": float(np.mean([r["wall_s"] for r in results]))},
        ]
        for name in ("server", "agent", "gateway", "client"):
            value = float(np.mean([r[f"cpu_s_{name}"] for r in results]))
            rows.append({"path": path, "metric": f"cpu_s_{name}", "value": value})
    rows += [
        {"metric": "ttft_p50_delta_ms", "value": summary["gateway"][0] - summary["direct"][0]},
        {"metric": "throughput_ratio", "value": summary["gateway"][1] / summary["direct"][1]},
        {"metric": "streams", "value": num_streams},
        {"metric": "prompt_tokens", "value": prompt_tokens},
        {"metric": "max_tokens", "value": max_tokens},
        {"metric": "rounds_per_path", "value": 2 * rounds},
    ]
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--streams", type=int, default=64)
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=1, help="groups of direct, gateway, gateway, direct")
    parser.add_argument("--json", default=None, metavar="PATH")
    parser.add_argument("--client", default=None, help=argparse.SUPPRESS)  # the client process
    parser.add_argument("--key", default="", help=argparse.SUPPRESS)
    parser.add_argument("--model-name", default=MODEL_NAME, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.client is not None:
        result = asyncio.run(
            _round(args.client, args.key, args.model_name, args.streams, args.prompt_tokens, args.max_tokens)
        )
        print(json.dumps(result))
        return
    with tempfile.TemporaryDirectory(prefix="lumen-bench-vllm-") as scratch:
        rows = measure(args.streams, args.prompt_tokens, args.max_tokens, args.rounds, Path(scratch))
    for row in rows:
        print(f"{row.get('path', ''):8} {row['metric']:18} {row['value']:.3f}")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()
