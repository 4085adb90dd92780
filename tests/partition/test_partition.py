"""The partition harness itself (default suite): namespaces with addresses only on their links,
UCX over TCP between them, each fault primitive's effect on a real TCP stream, the invariants'
ability to fail, and one short schedule on a live cluster."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import netns
import pytest
from net_cluster import PROCESS_ENV
from schedules import Fault, Outcome, Schedule, draw, run_schedule, violations

pytestmark = [pytest.mark.ucx, pytest.mark.timeout(120)]

TWO = ["a", "b"]
_SINK = """
import socket, sys
listener = socket.create_server((sys.argv[1], 7000))
print("ready", flush=True)
while True:
    conn, _ = listener.accept()
    received = 0
    while data := conn.recv(1 << 20):
        received += len(data)
    conn.sendall(str(received).encode())
    conn.close()
"""
_PUSH = """
import socket, sys, time
start = time.monotonic()
try:
    conn = socket.create_connection((sys.argv[1], 7000), timeout=float(sys.argv[3]))
    conn.sendall(b"x" * int(sys.argv[2]))
    conn.shutdown(socket.SHUT_WR)
    print(int(conn.recv(64)), time.monotonic() - start)
except OSError as exc:
    print(-1, type(exc).__name__)
"""


def _sink(network: netns.Network) -> subprocess.Popen[str]:
    sink = subprocess.Popen(
        network.argv("b", [sys.executable, "-c", _SINK, network.node("b").address]),
        stdout=subprocess.PIPE,
        text=True,
    )
    assert sink.stdout is not None and sink.stdout.readline().strip() == "ready"
    return sink


def _push(network: netns.Network, num_bytes: int, timeout_s: float = 3.0) -> tuple[int, float]:
    """Bytes the sink in b received from a over one TCP connection (-1: it failed), and the
    seconds it took."""
    argv = [sys.executable, "-c", _PUSH, network.node("b").address, str(num_bytes), str(timeout_s)]
    out = subprocess.run(
        network.argv("a", argv), capture_output=True, text=True, timeout=60, check=True
    ).stdout.split()
    return int(out[0]), float(out[1]) if out[0] != "-1" else 0.0


@pytest.mark.parametrize("network", [TWO], indirect=True)
def test_partition_harness_links_only_and_cleans_up(network: netns.Network) -> None:
    for name, node in network.nodes.items():
        assert network.addresses(name) == sorted(["127.0.0.1", node.address])
        assert node.address.startswith("198.18.")
        assert network.routes(name) == [f"198.18.0.0/24 dev eth0 proto kernel scope link src {node.address}"]
    names = [n.netns for n in network.nodes.values()] + [network.bridge_netns]
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True).stdout
    assert all(name in listed for name in names)
    network.close()
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True).stdout
    assert not any(name in listed for name in names)


def test_partition_stale_namespaces_of_a_dead_run_are_deleted() -> None:
    why = netns.unavailable()
    if why is not None:
        pytest.skip(why)
    dead = subprocess.Popen(["true"])
    dead.wait()  # a pid no process has now
    name = f"{netns.RUN_PREFIX}{dead.pid}xdead00-br"
    subprocess.run(["ip", "netns", "add", name], check=True)
    assert name in netns.delete_stale_namespaces()
    assert (
        name not in subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True).stdout
    )


@pytest.mark.parametrize("network", [TWO], indirect=True)
def test_partition_ucx_crosses_namespaces_over_tcp_only(network: netns.Network, tmp_path: Path) -> None:
    """A holder's transport server in a, a client in b: UCX connects (the client reaches UCX's
    listener itself, so UCX wires its data lanes to the client's own address) and reports TCP
    on eth0 only."""
    env = dict(os.environ, **PROCESS_ENV)
    serve = (
        "import json, sys, time\n"
        "from lumen_core.stream import HolderStore\n"
        "server = HolderStore(1 << 26).serve(b's' * 32, address=sys.argv[1], port=0)\n"
        "print(json.dumps({'port': server.port}), flush=True)\n"
        "sys.stdin.read()\n"
    )
    connect = (
        "import json, sys\n"
        "from lumen_core.transport import Client\n"
        "with Client(sys.argv[1], int(sys.argv[2]), b's' * 32, connect_timeout_s=10.0) as client:\n"
        "    print(json.dumps(client.transports()))\n"
    )
    server = subprocess.Popen(
        network.argv("a", [sys.executable, "-c", serve, network.node("a").address]),
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        assert server.stdout is not None
        port = json.loads(server.stdout.readline())["port"]
        done = subprocess.run(
            network.argv("b", [sys.executable, "-c", connect, network.node("a").address, str(port)]),
            capture_output=True,
            text=True,
            env=env,
            timeout=60,
            check=False,
        )
    finally:
        server.kill()
        server.communicate(timeout=10)
    assert done.returncode == 0, done.stderr[-2000:]
    transports = {tuple(t) for t in json.loads(done.stdout)}
    assert transports and all(t == "tcp" for t, _ in transports), transports
    assert ("tcp", "eth0") in transports or ("tcp", "") in transports, transports


@pytest.mark.parametrize("network", [TWO], indirect=True)
def test_partition_checkpoint_streams_across_namespaces_and_restores(
    network: netns.Network, secret_file: Path, issuer_key_file: Path, issuer_public_key_file: Path
) -> None:
    """A `lumen holder` in a, a writer in b (tests/partition/stream_node.py): the checkpoint
    streamed over tcp is durable on the holder, and read back from it bit-exact."""
    env = dict(os.environ, **PROCESS_ENV)
    address = network.node("a").address
    serve = [
        sys.executable, "-m", "lumen_core.cli", "holder", "--address", address, "--port", "0",
        "--budget-bytes", str(1 << 26), "--secret-file", str(secret_file),
        "--issuer-key-file", str(issuer_public_key_file), "--tls", "tcp",
    ]  # fmt: skip
    holder = subprocess.Popen(
        network.argv("a", serve),
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        assert holder.stdout is not None and holder.stdin is not None
        port = json.loads(holder.stdout.readline())["port"]
        num_tokens = 200
        stream = [
            sys.executable, str(Path(__file__).resolve().parent / "stream_node.py"),
            "--holder", f"{address}:{port}", "--secret-file", str(secret_file),
            "--issuer-key-file", str(issuer_key_file), "--num-tokens", str(num_tokens),
        ]  # fmt: skip
        done = subprocess.run(
            network.argv("b", stream),
            capture_output=True,
            text=True,
            env=env,
            timeout=90,
            check=False,
        )
        assert done.returncode == 0, done.stderr[-2000:]
        result = json.loads(done.stdout)
        holder.stdin.write("stats\n")
        holder.stdin.flush()
        stats = json.loads(holder.stdout.readline())
    finally:
        holder.kill()
        holder.communicate(timeout=10)
    assert result["flushed"] and result["durable"] == num_tokens, result
    assert (result["status"], result["restored_tokens"], result["equal"]) == ("COMPLETE", num_tokens, True)
    assert {tuple(t) for t in result["transports"]} <= {("tcp", "eth0"), ("tcp", "")}, result
    server = stats["server"]
    assert server["tokens_committed"] == num_tokens and server["reads"] >= 1, server
    assert server["handshakes_ok"] >= 2 and server["handshake_timeouts"] == 0, server


@pytest.mark.parametrize("network", [TWO], indirect=True)
def test_partition_fault_primitives_act_on_tcp_and_heal(network: netns.Network) -> None:
    sink = _sink(network)
    try:
        assert _push(network, 8 << 20)[0] == 8 << 20
        network.cut("a", "b")
        assert _push(network, 1000, 1.0)[0] == -1
        assert network.heal() > 0
        network.cut("b", "a", one_way=True)  # a's SYN arrives, b's answer is dropped
        assert _push(network, 1000, 1.0)[0] == -1
        assert network.heal() > 0
        network.link_down("b")
        assert _push(network, 1000, 1.0)[0] == -1
        network.heal()
        network.rate("a", 20)
        received, seconds = _push(network, 5 << 20, 10.0)  # 42 Mbit: >= 2.1 s at 20 Mbit/s
        assert received == 5 << 20 and seconds > 1.5, seconds
        assert network.limited()[0] >= 5 << 20 and network.limited()[1] > 0
        network.heal()
        network.loss(5)
        assert _push(network, 8 << 20, 10.0)[0] == 8 << 20  # TCP retransmits what was lost
        assert network.heal() > 0
        assert _push(network, 1000)[0] == 1000
        assert dict(network.faults) == {"cut": 1, "cut_one_way": 1, "link_down": 1, "rate": 1, "loss": 1}
    finally:
        sink.kill()
        sink.wait(timeout=10)
        assert sink.stdout is not None
        sink.stdout.close()


def test_partition_bad_arguments_are_refused() -> None:
    with pytest.raises(ValueError, match="kind must be one of"):
        Fault("delay", 0.5, 1.0, "w0")
    with pytest.raises(ValueError, match="start_lease and length_lease must be >= 0"):
        Fault("loss", -1.0, 1.0)
    with pytest.raises(ValueError, match="node_names must be distinct and non-empty"):
        netns.Network(["a", "a"])
    with pytest.raises(ValueError, match="node_names must be lower-case alphanumeric"):
        netns.Network(["Gate-way"])


def test_partition_schedules_are_replayable_from_their_seed() -> None:
    kinds = [("cut_gateway", 2.0, 1.0), ("loss", 1.0, 1.5)]
    assert draw("x", 7, kinds) == draw("x", 7, kinds)
    assert draw("x", 7, kinds) != draw("x", 8, kinds)
    line = draw("x", 7, kinds).describe()
    assert line.startswith("schedule x seed 7 (LUMEN, lease 3.0 s") and "x lease" in line


def test_partition_each_invariant_can_fail() -> None:
    """The checker on a doctored outcome: a lost request, a repeated and a missing token, a
    different output, an accepted stale report, faults with no trace in the stats."""
    schedule = Schedule(
        "doctored",
        0,
        (
            Fault("cut_gateway", 0.5, 2.0, "w1"),
            Fault("rate", 0.5, 1.0, "w0"),
            Fault("sigkill", 1.0, 0.0, "w2"),
        ),
    )
    good = {
        "request_id": 1,
        "chunks": [[0, 2], [2, 1]],
        "token_ids": [5, 6, 7],
        "finished": True,
        "error": "",
    }
    records = [
        dict(good),
        dict(good, finished=False, error="Timeout"),  # lost
        dict(good, chunks=[[0, 2], [1, 2]]),  # a repeat
        dict(good, chunks=[[0, 1], [2, 1]]),  # a gap
        dict(good, token_ids=[5, 6, 8]),  # another output
    ]
    gateway = {"stale_accepted": [{"request_id": 3, "start_position": 9}], "failures": []}
    final = [
        {"worker_id": 0, "epoch": 1, "state": "serving"},
        {"worker_id": 1, "epoch": 1, "state": "failed"},
    ]
    evidence = [
        {"applied_s": 1.5, "dropped_packets": 0},
        {"applied_s": 1.5, "overlimits": 0},
        {"applied_s": 3.0},
    ]
    outcome = Outcome(schedule, records, [[5, 6, 7]] * 5, gateway, [], evidence, final_workers=final)
    found = violations(outcome)
    assert found == [
        "request 1 lost: Timeout",
        "request 2: tokens 1..1 repeated",
        "request 3: tokens 1..1 missing",
        "request 4: output differs from the failure-free run",
        "1 token reports of a fenced or outdated epoch accepted: [{'request_id': 3, 'start_position': 9}]",
        "cut_gateway w1 at 1.50 s for 6.00 s (2.00 x lease): no packet dropped",
        "cut_gateway w1 at 1.50 s for 6.00 s (2.00 x lease): the gateway never failed worker 1",
        "rate 100 Mbit/s w0 at 1.50 s for 3.00 s (1.00 x lease): no traffic passed the rate limit",
        "sigkill w2 at 3.00 s for 0.00 s (0.00 x lease): the gateway never failed worker 2",
        "worker 1 not serving again after the schedule (failed)",
    ]
    assert violations(Outcome(schedule, records[:1], [[5, 6, 7]], {}, [], evidence))[0].startswith(
        "the gateway reported nothing"
    )


@pytest.mark.timeout(90)
def test_partition_worker_cut_from_gateway_shorter_than_lease(network: netns.Network, tmp_path: Path) -> None:
    started = time.monotonic()
    schedule = draw(
        "worker_cut_from_gateway_shorter_than_lease",
        101,
        [("cut_gateway", 0.25, 0.6)],  # see test_partition_slow.SHORT
        # Cut while it reports tokens every step: an idle worker's heartbeats alone can miss a
        # 0.75 s window on a loaded machine (CI: "no packet dropped").
        while_serving=True,
        num_requests=6,
        output_tokens=160,
    )
    outcome = run_schedule(tmp_path, network, schedule)
    assert violations(outcome) == []
    assert outcome.faults_by_class == {"cut_gateway": 1} and network.faults == {"cut": 1}
    assert time.monotonic() - started < 60
