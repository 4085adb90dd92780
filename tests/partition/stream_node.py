"""A checkpoint writer and reader in its own network namespace (by path, never imported).

    python stream_node.py --holder ADDRESS:PORT --secret-file F --issuer-key-file K
                          --num-tokens N

Streams request 1's KV records (``N`` tokens of seeded random bytes, in steps of 16) to the
holder with a ``CheckpointStreamer`` over tcp, waits until every token is durable, then reads
the checkpoint back with ``remote_restore`` on a fresh connection into a second cache and
prints one JSON line: ``durable`` (tokens the holder acknowledged), ``status`` and
``restored_tokens`` of the restore, ``equal`` (the restored records are bit-identical to those
streamed), ``transports`` (UCX's ``[transport, device]`` lanes of the reading connection).
"""

from __future__ import annotations

import argparse
import json

import numpy as np
import torch

from lumen_core.auth import CapabilityIssuer, read_issuer_key_file, read_secret_file
from lumen_core.layouts import KVLayout
from lumen_core.ops import gather_tokens, scatter_tokens
from lumen_core.stream import CheckpointStreamer, remote_restore
from lumen_core.testing import make_paged_cache
from lumen_core.transport import Client

MODEL = "partition-model"
REQUEST_ID = 1
STEP_TOKENS = 16


def _cache(seed: int) -> KVLayout:
    return make_paged_cache(
        "vllm_flash",
        num_layers=2,
        num_blocks=64,
        block_size=16,
        num_kv_heads=2,
        head_dim=16,
        dtype=torch.bfloat16,
        seed=seed,
    )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--holder", required=True)
    parser.add_argument("--secret-file", required=True)
    parser.add_argument("--issuer-key-file", required=True)
    parser.add_argument("--num-tokens", type=int, required=True)
    args = parser.parse_args()
    address, port = args.holder.rsplit(":", 1)
    secret = read_secret_file(args.secret_file)
    issuer = CapabilityIssuer(read_issuer_key_file(args.issuer_key_file))
    n = args.num_tokens
    source = _cache(seed=1)
    slots = torch.arange(n, dtype=torch.int64)
    token_ids = (np.arange(n, dtype=np.uint32) * 31 + 7) % 5000
    generator = torch.Generator().manual_seed(2)
    streamer = CheckpointStreamer(
        source, secret, model_fingerprint=MODEL, tls="tcp", ack_timeout_s=10.0, connect_timeout_s=10.0
    )
    try:
        streamer.add_request(
            REQUEST_ID, [(address, int(port))], [issuer.issue(REQUEST_ID, 0, 0, holder_id=0)]
        )
        for start in range(0, n, STEP_TOKENS):
            end = min(n, start + STEP_TOKENS)
            records = torch.randint(
                0, 256, (end - start, source.record_bytes), dtype=torch.uint8, generator=generator
            )
            scatter_tokens(source, slots[start:end], records)
            streamer.save_step(
                [REQUEST_ID] * (end - start), list(range(start, end)), slots[start:end], token_ids[start:end]
            )
        streamer.wait_for_save(REQUEST_ID)
        flushed = streamer.flush(timeout_s=30.0)
        durable = streamer.stats().durable.get(REQUEST_ID, 0)
    finally:
        streamer.close()
    target = _cache(seed=3)
    with Client(address, int(port), secret, tls="tcp", connect_timeout_s=10.0) as client:
        result = remote_restore(
            client,
            REQUEST_ID,
            target,
            slots,
            token_ids=token_ids,
            model_fingerprint=MODEL,
            capability=issuer.issue(REQUEST_ID, 0, 0, holder_id=0),
        )
        transports = client.transports()
    equal = torch.equal(gather_tokens(target, slots), gather_tokens(source, slots))
    print(
        json.dumps(
            {
                "flushed": flushed,
                "durable": durable,
                "status": result.status.name,
                "restored_tokens": result.restored_tokens,
                "equal": equal,
                "transports": transports,
            }
        ),
        flush=True,
    )


if __name__ == "__main__":
    main()
