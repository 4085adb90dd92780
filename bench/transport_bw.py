"""Transport-only bandwidth of lumen_core.transport against `ucx_perftest -t tag_bw`.

Both run between two processes on loopback at the same message size and UCX_TLS, in the same
run. Ours: a Server process (its HolderStore; crc check on receipt off for the transport-only case,
on for the "+verify" case) and a Client streaming prepared appends of [n, 32 KiB] records,
`--window` in flight, in rounds of appends to one checkpoint, driven by the client's C++ loop
(as the streamer drives it; open and release outside the timing). `python_driven_gb_per_s` is
the same from Python (`start_append` / `wait`, open and release timed). GB/s
counts message payload bytes (records + token ids + crcs) per second.

The receiver's working set decides much of the figure on this machine (32 MiB last-level
cache), so it is fixed and reported. ucx_perftest receives every message into one buffer that
stays cache-resident; the transport-only rows give ours a comparable working set: rounds of
`--round-mib` (16 MiB, and at least `--window` appends), whose chunks the holder reuses from
round to round. The "/cold" rows use rounds of `--cold-round-mib` (128 MiB) of fresh records,
which do not fit the cache: what a holder that keeps many checkpoints sees, bound by DRAM
writes on the receiving side.

    python bench/transport_bw.py [--json PATH] [--sizes-mib 1 8] [--tls tcp sm] [--repeats 3]
        [--round-mib 16] [--cold-round-mib 128]

`sm` means UCX_TLS=sm,tcp for ours (the client-server connection is established over tcp;
bulk data then moves over the shared-memory lanes UCX picks) and UCX_TLS=sm,self for
ucx_perftest (which exchanges addresses out of band). Rows: case, metric
(`bulk_vs_ucx_perftest`), value (our GB/s), ratio (ours / ucx_perftest), plus the baseline
and the transports UCX chose. Target ratio >= 0.8. A second metric,
`bulk_vs_ucx_perftest_peer_errors`, compares with `ucx_perftest -e` (endpoints with peer error
handling, as ours must have to report a dead peer, and ours' tcp segment size): with it UCX
gives up the zero-copy rendezvous over tcp for fragmented copy-in/copy-out, for perftest as
for us.

Every message after the handshake is sealed (a sequence number and an HMAC-SHA256 of its header
under the connection's session key; appends' records are not covered). A third metric,
`seal_share_of_append`, is measured in the same run: the time one seal plus one check take
(`measure_seal_ns`, both counted although sender and receiver do one each, on different
processes) as a share of the time one append of the case takes at the GB/s measured, i.e. how
much faster appends could at most be unsealed.

The "/encrypted" rows are the transport-only case over connections that encrypt their records
(`Client(encrypt=True)`: AES-256-GCM both ways, keyed by the handshake), and the metric
`encrypted_vs_plain` is their GB/s over the sealed plain case's, same run: what payload
encryption costs an append (`cipher_gb_per_s` beside it: one encryption plus one decryption
on one thread, `measure_cipher_bytes_per_s`).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

RECORD_BYTES = 32768
TCP_SEGMENT_SIZE = "256k"  # what csrc/transport/worker.cpp sets unless the environment does
TLS_OURS = {"tcp": "tcp", "sm": "sm,tcp"}
TLS_PERFTEST = {"tcp": "tcp", "sm": "sm,self"}


def _libucx_dir() -> Path:
    import libucx

    return Path(libucx.__file__).parent


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def perftest_gb_per_s(
    tls: str,
    size: int,
    iterations: int,
    peer_errors: bool,
    *,
    host: str = "127.0.0.1",
    server_prefix: tuple[str, ...] = (),
    client_prefix: tuple[str, ...] = (),
) -> float:
    """ucx_perftest tag_bw between two processes; bytes/s from its overall message rate.
    ``peer_errors``: endpoints with peer error handling (``-e``), as ours need to report a dead
    peer; UCX then picks the protocols it picks for ours (no zero-copy rendezvous over tcp).
    ``host``: the server's address; ``*_prefix``: argv prefixes of the server and client (e.g.
    ``ip netns exec NAME``, bench/netns_bw.py)."""
    root = _libucx_dir()
    env = dict(os.environ, UCX_TLS=tls, LD_LIBRARY_PATH=str(root / "lib"))
    flags = []
    if peer_errors:  # as our Worker configures UCX
        env["UCX_MM_ERROR_HANDLING"] = "y"
        env.setdefault("UCX_TCP_TX_SEG_SIZE", TCP_SEGMENT_SIZE)
        env.setdefault("UCX_TCP_RX_SEG_SIZE", TCP_SEGMENT_SIZE)
        flags = ["-e"]
    binary = str(root / "bin" / "ucx_perftest")
    port = _free_port()
    server = subprocess.Popen(
        [*server_prefix, binary, "-p", str(port), *flags],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        time.sleep(0.5)
        out = subprocess.run(
            [
                *client_prefix,
                binary,
                host,
                "-p",
                str(port),
                "-t",
                "tag_bw",
                "-s",
                str(size),
                "-n",
                str(iterations),
                "-w",
                str(max(iterations // 10, 4)),
                "-f",
                *flags,
            ],
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
            check=True,
        ).stdout
    finally:
        server.wait(timeout=30)
    # The final row: iterations, 50%ile, avg, overall overhead; avg, overall MB/s; avg,
    # overall msg/s. The overall message rate times the size is unambiguous bytes/s.
    rows = [line.split() for line in out.splitlines() if re.match(r"^\s*Final:|^\s*\d", line)]
    numbers = [float(x) for x in rows[-1] if re.match(r"^[\d.]+$", x)]
    return numbers[-1] * size / 1e9


def _serve(tls: str, secret_file: str, issuer_public_key: str, verify: bool) -> None:
    from lumen_core.auth import read_secret_file
    from lumen_core.stream import HolderStore
    from lumen_core.transport import Server

    with Server(
        read_secret_file(secret_file),
        store=HolderStore(),
        issuer_public_key=bytes.fromhex(issuer_public_key),
        tls=tls,
        verify_records=verify,
    ) as server:
        print(server.port, flush=True)
        sys.stdin.read()  # until the parent closes stdin


@contextlib.contextmanager
def served(tls: str, secret_file: str, issuer: Any, verify: bool = False) -> Iterator[int]:
    """A Server in its own process (``_serve``), trusting ``issuer``, for the duration; yields
    its port."""
    server = subprocess.Popen(
        [sys.executable, __file__, "--serve", tls, secret_file, issuer.public_key.hex()]
        + (["--verify"] if verify else []),
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        yield int(server.stdout.readline())
    finally:
        server.stdin.close()
        server.wait(timeout=30)


def prepared_append(size: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(token_ids, crcs, records) of one append of ``size`` bytes of random 32 KiB records."""
    import torch

    from lumen_core import ops

    num_tokens = size // RECORD_BYTES
    records = np.random.default_rng(size).integers(0, 256, (num_tokens, RECORD_BYTES), dtype=np.uint8)
    crcs = ops.checksum(torch.from_numpy(records)).numpy().astype(np.uint32)
    return np.arange(num_tokens, dtype=np.uint32), crcs, records


def ours_gb_per_s(
    tls: str,
    size: int,
    iterations: int,
    window: int,
    per_round: int,
    verify: bool,
    secret: bytes,
    secret_file: str,
    issuer: Any,
    encrypt: bool = False,
) -> tuple[float, float, list[tuple[str, str]]]:
    """GB/s of appends driven by the client's C++ loop and from Python, and the transports."""
    from lumen_core.transport import Client
    from lumen_core.transport.client import SELF_TEST_REQUEST_ID

    with served(tls, secret_file, issuer, verify) as port:
        token_ids, crcs, records = prepared_append(size)
        num_tokens = len(token_ids)
        payload = num_tokens * (RECORD_BYTES + 8)  # records, token ids and crcs
        fingerprint = bytes(32)
        with Client("127.0.0.1", port, secret, tls=tls, encrypt=encrypt) as client:
            transports = client.transports()

            def run_round(request_id: int, count: int, check: bool) -> None:
                cap = issuer.issue(request_id, 0, 1, holder_id=0)
                client.open(request_id, 0, 1, RECORD_BYTES, fingerprint, fingerprint, cap)
                ops_in_flight = []
                for i in range(count):
                    ops_in_flight.append(
                        client.start_append(request_id, 0, 1, i * num_tokens, token_ids, crcs, records, cap)
                    )
                    if len(ops_in_flight) >= window:
                        client.wait(ops_in_flight.pop(0), timeout_s=60.0)
                for op in ops_in_flight:
                    client.wait(op, timeout_s=60.0)
                if check:  # correctness once, before timing
                    got = client.read(
                        request_id, 0, 1, (count - 1) * num_tokens, num_tokens, RECORD_BYTES, cap
                    )
                    assert np.array_equal(got.records, records), "round trip is not bit-exact"
                    assert np.array_equal(got.crcs, crcs)
                client.release(request_id, 0, 1, cap)

            run_round(1, per_round, check=True)  # warm-up (and the server's heap)
            # The streamer drives appends from C++ (the client's own loop, as in the start-up
            # self-test: a scratch checkpoint per round, opened and released outside the
            # timing), like ucx_perftest's C loop; Python-driven rounds add a GIL round trip
            # per append and an open and a release per round, reported beside it.
            counts = [min(per_round, iterations - done) for done in range(0, iterations, per_round)]
            native_s = 0.0
            for shard, count in enumerate(counts):  # a scratch checkpoint (shard) per round
                cap = issuer.issue(SELF_TEST_REQUEST_ID, shard, 0, holder_id=0)
                measured = client.self_test(
                    cap, shard=shard, message_bytes=size, count=count, window=window, expected_gb_per_s=0
                )
                native_s += count * payload / (measured.gb_per_s * 1e9)
            start = time.perf_counter()
            for request_id, count in enumerate(counts, start=2):
                run_round(request_id, count, check=False)
            python_s = time.perf_counter() - start
        return (iterations * payload / native_s / 1e9, iterations * payload / python_s / 1e9, transports)


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--serve":
        _serve(sys.argv[2], sys.argv[3], sys.argv[4], "--verify" in sys.argv)
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path, help="write result rows here")
    parser.add_argument("--sizes-mib", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--tls", nargs="+", default=["tcp", "sm"], choices=sorted(TLS_OURS))
    parser.add_argument("--total-mib", type=int, default=1024, help="bytes moved per case")
    # The streamer starts all appends of a step at once (one or more per request and holder).
    parser.add_argument("--window", type=int, default=8, help="appends in flight")
    parser.add_argument("--repeats", type=int, default=3, help="interleaved repeats (best of)")
    parser.add_argument(
        "--round-mib", type=int, default=16, help="receiver working set of the transport-only rows"
    )
    parser.add_argument(
        "--cold-round-mib",
        type=int,
        default=128,
        help="receiver working set of the /cold rows (0: no /cold rows)",
    )
    args = parser.parse_args()

    # (case suffix, receiver working set, crc check on receipt, records encrypted)
    variants = [
        ("", args.round_mib, False, False),
        ("/verify", args.round_mib, True, False),
        ("/encrypted", args.round_mib, False, True),
    ]
    if args.cold_round_mib:
        variants.append(("/cold", args.cold_round_mib, False, False))
    from lumen_core import _native
    from lumen_core.auth import CapabilityIssuer

    secret = os.urandom(32)
    issuer = CapabilityIssuer.generate()
    seal_ns = _native.require_ucx().measure_seal_ns(100_000)
    cipher_gb_per_s = _native.require_ucx().measure_cipher_bytes_per_s(1 << 20, 256) / 1e9
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        secret_file = os.path.join(tmp, "secret")
        Path(secret_file).write_bytes(secret)
        os.chmod(secret_file, 0o600)
        for tls in args.tls:
            for size_mib in args.sizes_mib:
                size = size_mib << 20
                iterations = max(args.total_mib // size_mib, 16)

                # Called only within this iteration, so the loop variables it reads are current.
                def per_round(round_mib: int) -> int:
                    return min(max(round_mib // size_mib, args.window), iterations)  # noqa: B023

                # Interleaved repeats, best of each: the machine is shared and noisy, and a
                # slow repeat says more about the neighbours than about either transport.
                baseline = {False: 0.0, True: 0.0}  # by peer error handling
                ours = {suffix: 0.0 for suffix, *_ in variants}
                from_python = {suffix: 0.0 for suffix, *_ in variants}
                transports: list[tuple[str, str]] = []
                for _ in range(args.repeats):
                    for peer_errors in (False, True):
                        baseline[peer_errors] = max(
                            baseline[peer_errors],
                            perftest_gb_per_s(TLS_PERFTEST[tls], size, iterations, peer_errors),
                        )
                    for suffix, round_mib, verify, encrypt in variants:
                        value, python_value, transports = ours_gb_per_s(
                            TLS_OURS[tls],
                            size,
                            iterations,
                            args.window,
                            per_round(round_mib),
                            verify,
                            secret,
                            secret_file,
                            issuer,
                            encrypt,
                        )
                        ours[suffix] = max(ours[suffix], value)
                        from_python[suffix] = max(from_python[suffix], python_value)
                for suffix, round_mib, *_ in variants:
                    for peer_errors, metric in (
                        (False, "bulk_vs_ucx_perftest"),
                        (True, "bulk_vs_ucx_perftest_peer_errors"),
                    ):
                        row = {
                            "case": f"{tls}/{size_mib}MiB{suffix}",
                            "metric": metric,
                            "value": round(ours[suffix], 3),
                            "ratio": round(ours[suffix] / baseline[peer_errors], 3),
                            "baseline_gb_per_s": round(baseline[peer_errors], 3),
                            "python_driven_gb_per_s": round(from_python[suffix], 3),
                            "receiver_working_set_mib": per_round(round_mib) * size_mib,
                            "transports": sorted({f"{t}/{d}" if d else t for t, d in transports}),
                        }
                        rows.append(row)
                        print(json.dumps(row), flush=True)
                append_ns = (size_mib << 20) / ours[""]  # GB/s is bytes per ns
                row = {
                    "case": f"{tls}/{size_mib}MiB",
                    "metric": "seal_share_of_append",
                    "value": round(seal_ns / append_ns, 5),
                    "seal_and_check_ns": round(seal_ns, 1),
                    "append_ns": round(append_ns, 1),
                    "sealed_gb_per_s": round(ours[""], 3),
                }
                rows.append(row)
                print(json.dumps(row), flush=True)
                row = {
                    "case": f"{tls}/{size_mib}MiB",
                    "metric": "encrypted_vs_plain",
                    "value": round(ours["/encrypted"] / ours[""], 3),
                    "encrypted_gb_per_s": round(ours["/encrypted"], 3),
                    "plain_gb_per_s": round(ours[""], 3),
                    "cipher_gb_per_s": round(cipher_gb_per_s, 3),
                }
                rows.append(row)
                print(json.dumps(row), flush=True)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1) + "\n")


# ---- pytest-benchmark (make bench): one durable 1 MiB append over tcp, checked first --------


def test_append_1mib_tcp(benchmark, tmp_path) -> None:  # type: ignore[no-untyped-def]
    import pytest

    pytest.importorskip("lumen_core._C_ucx", reason="the UCX transport is not built")
    from lumen_core.auth import CapabilityIssuer
    from lumen_core.transport import Client

    secret = os.urandom(32)
    issuer = CapabilityIssuer.generate()
    secret_file = tmp_path / "secret"
    secret_file.write_bytes(secret)
    secret_file.chmod(0o600)
    token_ids, crcs, records = prepared_append(1 << 20)
    num_tokens = len(token_ids)
    cap = issuer.issue(1, 0, 1, holder_id=0)
    with (
        served("tcp", str(secret_file), issuer) as port,
        Client("127.0.0.1", port, secret, tls="tcp") as client,
    ):
        client.open(1, 0, 1, RECORD_BYTES, bytes(32), bytes(32), cap)
        position = [0]

        def append() -> int:
            durable = client.append(1, 0, 1, position[0], token_ids, crcs, records, cap)
            position[0] += num_tokens
            return durable

        durable = benchmark.pedantic(append, rounds=64, iterations=1)
        back = client.read(1, 0, 1, position[0] - num_tokens, num_tokens, RECORD_BYTES, cap)
        client.release(1, 0, 1, cap)
    assert durable == position[0]
    assert np.array_equal(back.records, records) and np.array_equal(back.crcs, crcs)


if __name__ == "__main__":
    main()
