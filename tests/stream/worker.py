"""A serving worker stand-in for the fault tests: a CPU KV cache whose tokens are written step
by step (a prefill chunk, then one token per request per step) and streamed with a
CheckpointStreamer to one holder. The KV and token ids are deterministic functions of
(request, position), so a test can check what a holder kept after this process is killed.

    python worker.py --port P [P ...] --secret-file F --issuer-key-file K [--requests 8]
                     [--max-tokens 480] [--step-ms 5]
Each request is streamed to every holder port given (replicas, each holder id 0), with
capabilities the issuer key K signs.
Prints one JSON line per step: {"step": k, "tokens": tokens per request}.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import numpy as np
import torch

from lumen_core.auth import CapabilityIssuer, read_issuer_key_file, read_secret_file
from lumen_core.layouts import KVLayout
from lumen_core.ops import scatter_tokens
from lumen_core.stream import CheckpointStreamer
from lumen_core.testing import make_paged_cache, slots_for_blocks

MODEL = "worker-model"
BLOCK_SIZE = 16
PREFILL = 16


def make_layout(num_blocks: int, seed: int = 0) -> KVLayout:
    return make_paged_cache(
        "vllm_flash",
        num_layers=2,
        num_blocks=num_blocks,
        block_size=BLOCK_SIZE,
        num_kv_heads=2,
        head_dim=16,
        dtype=torch.bfloat16,
        seed=seed,
    )


def request_id(index: int) -> int:
    return 1000 + index


def records_for(rid: int, n: int, record_bytes: int) -> torch.Tensor:
    """The KV records of positions [0, n) of request rid."""
    rng = np.random.default_rng(rid)
    return torch.from_numpy(rng.integers(0, 256, size=(n, record_bytes), dtype=np.uint8))


def tokens_for(rid: int, n: int) -> np.ndarray:
    return ((np.arange(n, dtype=np.uint64) * 2654435761 + rid) % 32000).astype(np.uint32)


def slots_for(index: int, n: int, blocks_per_request: int) -> torch.Tensor:
    first = index * blocks_per_request
    return slots_for_blocks(range(first, first + blocks_per_request), block_size=BLOCK_SIZE, num_tokens=n)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, nargs="+", required=True)
    parser.add_argument("--secret-file", required=True)
    parser.add_argument("--issuer-key-file", required=True)
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=480)
    parser.add_argument("--step-ms", type=float, default=5.0)
    args = parser.parse_args()
    secret = read_secret_file(args.secret_file)
    issuer = CapabilityIssuer(read_issuer_key_file(args.issuer_key_file))
    blocks_per_request = -(-args.max_tokens // BLOCK_SIZE)
    layout = make_layout(args.requests * blocks_per_request)
    streamer = CheckpointStreamer(layout, secret, model_fingerprint=MODEL, tls="tcp")
    rids = [request_id(i) for i in range(args.requests)]
    all_records = [records_for(r, args.max_tokens, layout.record_bytes) for r in rids]
    all_tokens = [tokens_for(r, args.max_tokens) for r in rids]
    all_slots = [slots_for(i, args.max_tokens, blocks_per_request) for i in range(args.requests)]
    for rid in rids:
        holders = [("127.0.0.1", port) for port in args.port]
        streamer.add_request(rid, holders, [issuer.issue(rid, 0, 0, holder_id=0) for _ in holders])
    done = 0
    step = 0
    while done < args.max_tokens:
        new = PREFILL if done == 0 else 1
        ids, positions, slots, tokens = [], [], [], []
        for i, rid in enumerate(rids):
            span = slice(done, done + new)
            scatter_tokens(layout, all_slots[i][span], all_records[i][span])
            ids += [rid] * new
            positions += list(range(done, done + new))
            slots.append(all_slots[i][span])
            tokens.append(all_tokens[i][span])
        streamer.save_step(ids, positions, torch.cat(slots), np.concatenate(tokens))
        done += new
        step += 1
        print(json.dumps({"step": step, "tokens": done}), flush=True)
        time.sleep(args.step_ms / 1000)
    streamer.flush(timeout_s=10.0)
    print(json.dumps({"done": True, "stats": streamer.stats().counters}), flush=True)
    streamer.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
