"""Transport bandwidth between two network namespaces over one veth link (issue 23), against
`ucx_perftest -t tag_bw` over the same link in the same run: the stand-in for two hosts.

A test network (tests/partition/netns.py: a bridge namespace, one namespace per side, addresses
from 198.18.0.0/24) carries both. Ours: a holder's transport Server in the "server" namespace,
bound to its link address, and a Client in the "client" namespace running the start-up
self-test (`Client.self_test`: appends of `--size-mib` driven by the client's C++ loop,
`--window` in flight). UCX_TLS=tcp on both sides (the IPC namespace is shared: shm or CMA
would bypass the link). When ours cannot connect, its row carries the error instead of a
figure. Needs root.

    python bench/netns_bw.py [--json PATH] [--size-mib 8] [--total-mib 512] [--window 8]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "partition"))

import netns
from transport_bw import perftest_gb_per_s

_SERVE = """
import json, sys
from lumen_core.auth import read_secret_file
from lumen_core.stream import HolderStore
store = HolderStore()
server = store.serve(read_secret_file(sys.argv[2]), address=sys.argv[1], port=0,
                     issuer_public_key=bytes.fromhex(sys.argv[3]))
print(json.dumps({"port": server.port}), flush=True)
sys.stdin.read()
"""
_MEASURE = """
import json, sys
from lumen_core.auth import read_secret_file
from lumen_core.transport import Client
from lumen_core.transport.client import SELF_TEST_REQUEST_ID
host, port, secret_file, capability, size, count, window = sys.argv[1:8]
try:
    with Client(host, int(port), read_secret_file(secret_file), connect_timeout_s=10.0) as client:
        result = client.self_test(bytes.fromhex(capability), shard=0, message_bytes=int(size),
                                  count=int(count), window=int(window), expected_gb_per_s=0.0)
    transports = sorted(f"{t}/{d}" for t, d in result.transports)
    print(json.dumps({"gb_per_s": result.gb_per_s, "transports": transports}))
except Exception as exc:
    print(json.dumps({"error": f"{type(exc).__name__}: {exc}"}))
"""


def ours(network: netns.Network, size: int, count: int, window: int) -> dict[str, object]:
    """The self-test across the link: ``{"gb_per_s", "transports"}`` or ``{"error"}``."""
    from lumen_core.auth import CapabilityIssuer, write_secret_file
    from lumen_core.transport.client import SELF_TEST_REQUEST_ID

    issuer = CapabilityIssuer.generate()
    env = dict(os.environ, UCX_TLS="tcp")
    with tempfile.TemporaryDirectory() as tmp:
        secret_file = Path(tmp) / "secret"
        write_secret_file(secret_file)
        host = network.node("server").address
        server = subprocess.Popen(
            network.argv(
                "server", [sys.executable, "-c", _SERVE, host, str(secret_file), issuer.public_key.hex()]
            ),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=env,
        )
        try:
            assert server.stdout is not None
            port = json.loads(server.stdout.readline())["port"]
            capability = issuer.issue(SELF_TEST_REQUEST_ID, 0, 0, holder_id=0).hex()
            argv = [sys.executable, "-c", _MEASURE, host, str(port), str(secret_file), capability]
            done = subprocess.run(
                network.argv("client", [*argv, str(size), str(count), str(window)]),
                capture_output=True,
                text=True,
                env=env,
                timeout=300,
                check=True,
            )
        finally:
            server.communicate(input="", timeout=30)
    return json.loads(done.stdout.splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path, help="write result rows here")
    parser.add_argument("--size-mib", type=int, default=8)
    parser.add_argument("--total-mib", type=int, default=512, help="bytes moved per case")
    parser.add_argument("--window", type=int, default=8, help="appends in flight (ours)")
    args = parser.parse_args()
    why = netns.unavailable()
    if why is not None:
        sys.exit(f"netns_bw: {why}")
    netns.delete_stale_namespaces()
    size = args.size_mib << 20
    iterations = max(args.total_mib // args.size_mib, 16)
    network = netns.Network(["server", "client"])
    try:
        link = {
            "host": network.node("server").address,
            "server_prefix": tuple(network.argv("server", [])),
            "client_prefix": tuple(network.argv("client", [])),
        }
        baseline = {e: perftest_gb_per_s("tcp", size, iterations, e, **link) for e in (False, True)}  # type: ignore[arg-type]
        measured = ours(network, size, iterations, args.window)
    finally:
        network.close()
    rows = []
    for peer_errors, metric in ((False, "veth_vs_ucx_perftest"), (True, "veth_vs_ucx_perftest_peer_errors")):
        row: dict[str, object] = {"case": f"tcp/{args.size_mib}MiB/veth", "metric": metric}
        if "error" in measured:
            row.update(value=None, ratio=None, error=measured["error"])
        else:
            value = float(measured["gb_per_s"])  # type: ignore[arg-type]
            row.update(value=round(value, 3), ratio=round(value / baseline[peer_errors], 3))
            row["transports"] = measured["transports"]
        row["baseline_gb_per_s"] = round(baseline[peer_errors], 3)
        rows.append(row)
        print(json.dumps(row), flush=True)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()
