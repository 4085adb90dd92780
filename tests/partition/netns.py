"""A test network of network namespaces: one per process, all linked through a bridge
namespace in the middle, where every fault is injected (as a switch would drop, not the
hosts).

Topology: namespace ``<run>-br`` holds bridge ``br0``; each node ``name`` gets namespace
``<run>-<name>`` with ``eth0`` (address ``198.18.0.<10 + i>/24``, from 198.18.0.0/15, the range
reserved for network benchmarks; no other address but loopback, no route anywhere else),
whose veth peer ``p<i>`` is a port of ``br0``. Nothing is created in the caller's namespace,
so a crashed run leaves only namespaces named for its own run id (``lumenpt<pid>x<hex>``),
which the next run deletes once their pid is gone.

Faults (each counted per class in ``faults``, every one undone by ``heal``):
- ``cut(a, b)``: nftables drop rules in the bridge (``bridge`` family, ``forward`` hook) for
  IPv4 from a to b, and b to a unless ``one_way``; ``isolate(a)``: a from every other node.
- ``loss(percent)``: ``numgen random mod 100 < percent`` drop of every forwarded packet.
- ``rate(node, mbit)``: a token bucket (``tbf``) on both directions of the node's link.
- ``link_down(node)``: the node's bridge port down (a pulled cable).
There is no ``netem`` in this kernel, so no delay fault. ``dropped_packets`` (the drop rules'
counters) and ``limited`` (bytes through, packets held back by the rate limits) are what make
each fault visible.

Needs root, ``ip`` and ``tc`` (iproute2) and ``nft`` (Debian package ``nftables``);
``unavailable()`` says why not.
"""

from __future__ import annotations

import os
import re
import secrets
import shutil
import subprocess
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

SUBNET_PREFIX = "198.18.0."
PREFIX_LEN = 24
FIRST_HOST = 10
RUN_PREFIX = "lumenpt"
_RUN_NAME = re.compile(rf"^({RUN_PREFIX}(\d+)x[0-9a-f]+)-")
NFT_TABLE = "lumen_faults"


def _run(argv: Sequence[str], *, check: bool = True, input_text: str | None = None) -> str:
    done = subprocess.run(
        list(argv), capture_output=True, text=True, input=input_text, timeout=30, check=False
    )
    if check and done.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} failed ({done.returncode}): {done.stderr.strip()}")
    return done.stdout


def unavailable() -> str | None:
    """Why this machine cannot build a test network (None: it can): not root, a missing tool,
    or ``ip netns add`` refused."""
    if os.geteuid() != 0:
        return "partition tests need root (network namespaces, nftables, tc)"
    for tool in ("ip", "nft", "tc"):
        if shutil.which(tool) is None:
            return f"partition tests need `{tool}` on PATH (iproute2, nftables)"
    probe = f"{RUN_PREFIX}{os.getpid()}xprobe-probe"
    done = subprocess.run(
        ["ip", "netns", "add", probe], capture_output=True, text=True, timeout=30, check=False
    )
    if done.returncode != 0:
        return f"`ip netns add` failed: {done.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True, timeout=30, check=False)
    return None


def delete_stale_namespaces() -> list[str]:
    """Delete namespaces of earlier runs whose process is gone; the names deleted."""
    deleted = []
    for line in _run(["ip", "netns", "list"]).splitlines():
        name = line.split()[0] if line.split() else ""
        match = _RUN_NAME.match(name)
        if match is None:
            continue
        try:
            os.kill(int(match.group(2)), 0)
            continue  # that run is alive
        except ProcessLookupError:
            pass
        except PermissionError:
            continue
        _run(["ip", "netns", "del", name], check=False)
        deleted.append(name)
    return deleted


@dataclass(frozen=True)
class Node:
    name: str
    netns: str
    address: str
    port: str  # its veth end in the bridge namespace


class Network:
    """See module doc. ``Network(["gateway", "w0", ...])`` builds it; ``close`` deletes every
    namespace (idempotent). Raises ValueError for bad or repeated node names, RuntimeError when
    a command fails (after deleting what was built)."""

    def __init__(self, node_names: Sequence[str]) -> None:
        names = list(node_names)
        if not names or len(set(names)) != len(names):
            raise ValueError(f"node_names must be distinct and non-empty, got {names}")
        for name in names:
            if not re.fullmatch(r"[a-z][a-z0-9]{0,15}", name):
                raise ValueError(f"node_names must be lower-case alphanumeric (<= 16), got {name!r}")
        if len(names) > 200:
            raise ValueError(f"node_names must number at most 200, got {len(names)}")
        self.run_id = f"{RUN_PREFIX}{os.getpid()}x{secrets.token_hex(3)}"
        self.bridge_netns = f"{self.run_id}-br"
        self.nodes = {
            name: Node(name, f"{self.run_id}-{name}", f"{SUBNET_PREFIX}{FIRST_HOST + i}", f"p{i}")
            for i, name in enumerate(names)
        }
        self.faults: Counter[str] = Counter()  # faults injected, by class
        self._created: list[str] = []
        self._rated: set[str] = set()
        self._down: set[str] = set()
        try:
            self._build()
        except BaseException:
            self.close()
            raise

    def _build(self) -> None:
        br = self.bridge_netns
        self._add_netns(br)
        _run(["ip", "-n", br, "link", "add", "br0", "type", "bridge"])
        _run(["ip", "-n", br, "link", "set", "br0", "up"])
        for node in self.nodes.values():
            self._add_netns(node.netns)
            _run(["ip", "-n", br, "link", "add", node.port, "type", "veth",
                  "peer", "name", "eth0", "netns", node.netns])  # fmt: skip
            _run(["ip", "-n", br, "link", "set", node.port, "master", "br0", "up"])
            _run(["ip", "-n", node.netns, "addr", "add", f"{node.address}/{PREFIX_LEN}", "dev", "eth0"])
            _run(["ip", "-n", node.netns, "link", "set", "eth0", "up"])
            _run(["ip", "-n", node.netns, "link", "set", "lo", "up"])
        # One chain for every drop rule; `heal` flushes it. Counters make drops visible.
        _run(
            ["ip", "netns", "exec", br, "nft", "-f", "-"],
            input_text=f"table bridge {NFT_TABLE} "
            "{ chain forward { type filter hook forward priority 0; policy accept; }; }\n",
        )

    def _add_netns(self, name: str) -> None:
        _run(["ip", "netns", "add", name])
        self._created.append(name)

    # ---- processes -----------------------------------------------------------------------
    def argv(self, node: str, argv: Sequence[str]) -> list[str]:
        """``argv`` run inside ``node``'s namespace."""
        return ["ip", "netns", "exec", self.node(node).netns, *argv]

    def node(self, name: str) -> Node:
        if name not in self.nodes:
            raise KeyError(f"node must be one of {sorted(self.nodes)}, got {name!r}")
        return self.nodes[name]

    def addresses(self, node: str) -> list[str]:
        """Every IPv4 address in ``node``'s namespace (loopback and its link address)."""
        out = _run(["ip", "-n", self.node(node).netns, "-4", "-o", "addr", "show"])
        return sorted(line.split()[3].split("/")[0] for line in out.splitlines())

    def routes(self, node: str) -> list[str]:
        out = _run(["ip", "-n", self.node(node).netns, "-4", "route", "show"])
        return [line.strip() for line in out.splitlines() if line.strip()]

    # ---- faults --------------------------------------------------------------------------
    def _nft(self, rule: str) -> None:
        _run(["ip", "netns", "exec", self.bridge_netns,
              "nft", "add", "rule", "bridge", NFT_TABLE, "forward", *rule.split()])  # fmt: skip

    def _drop(self, a: str, b: str, *, one_way: bool) -> None:
        src, dst = self.node(a).address, self.node(b).address
        if src == dst:
            raise ValueError(f"a cut needs two nodes, got {a!r} twice")
        self._nft(f"ip saddr {src} ip daddr {dst} counter drop")
        if not one_way:
            self._nft(f"ip saddr {dst} ip daddr {src} counter drop")

    def cut(self, a: str, b: str, *, one_way: bool = False) -> None:
        """Drop IPv4 from ``a`` to ``b`` (and back unless ``one_way``) at the bridge."""
        self._drop(a, b, one_way=one_way)
        self.faults["cut_one_way" if one_way else "cut"] += 1

    def isolate(self, a: str, others: Sequence[str] | None = None) -> None:
        """``a`` cut (both ways) from each of ``others`` (default: every other node)."""
        for other in others if others is not None else [n for n in self.nodes if n != a]:
            self._drop(a, other, one_way=False)
        self.faults["isolate"] += 1

    def loss(self, percent: int) -> None:
        """Drop each forwarded IPv4 packet with probability ``percent`` / 100."""
        if not isinstance(percent, int) or not 0 < percent < 100:
            raise ValueError(f"percent must be an int in (0, 100), got {percent!r}")
        self._nft(f"meta protocol ip numgen random mod 100 < {percent} counter drop")
        self.faults["loss"] += 1

    def rate(self, node: str, mbit: int) -> None:
        """Limit ``node``'s link to ``mbit`` Mbit/s each way (tbf, 64 KiB burst: what one
        10 ms slot of 50 Mbit/s holds, so short bursts do not slip past the limit)."""
        if not isinstance(mbit, int) or mbit < 1:
            raise ValueError(f"mbit must be a positive int, got {mbit!r}")
        target = self.node(node)
        tbf = ["tbf", "rate", f"{mbit}mbit", "burst", "64kb", "latency", "100ms"]
        _run(["tc", "-n", self.bridge_netns, "qdisc", "replace", "dev", target.port, "root", *tbf])
        _run(["tc", "-n", target.netns, "qdisc", "replace", "dev", "eth0", "root", *tbf])
        self._rated.add(node)
        self.faults["rate"] += 1

    def link_down(self, node: str) -> None:
        _run(["ip", "-n", self.bridge_netns, "link", "set", self.node(node).port, "down"])
        self._down.add(node)
        self.faults["link_down"] += 1

    def dropped_packets(self) -> int:
        """Packets the drop rules dropped since the last ``heal`` (the faults' effect)."""
        out = _run(["ip", "netns", "exec", self.bridge_netns,
                    "nft", "list", "chain", "bridge", NFT_TABLE, "forward"])  # fmt: skip
        return sum(int(n) for n in re.findall(r"counter packets (\d+)", out))

    def limited(self) -> tuple[int, int]:
        """(bytes that passed the rate limits, packets they held back: tbf ``overlimits``) on
        the links rated now."""
        sent = held = 0
        for node in sorted(self._rated):
            target = self.node(node)
            for netns, dev in ((self.bridge_netns, target.port), (target.netns, "eth0")):
                out = _run(["tc", "-n", netns, "-s", "qdisc", "show", "dev", dev, "root"])
                sent += sum(int(n) for n in re.findall(r"Sent (\d+) bytes", out))
                held += sum(int(n) for n in re.findall(r"overlimits (\d+)", out))
        return sent, held

    def heal(self) -> int:
        """Undo every fault; the packets dropped since the last heal."""
        dropped = self.dropped_packets()
        _run(["ip", "netns", "exec", self.bridge_netns,
              "nft", "flush", "chain", "bridge", NFT_TABLE, "forward"])  # fmt: skip
        for node in sorted(self._rated):
            target = self.node(node)
            _run(["tc", "-n", self.bridge_netns, "qdisc", "del", "dev", target.port, "root"], check=False)
            _run(["tc", "-n", target.netns, "qdisc", "del", "dev", "eth0", "root"], check=False)
        self._rated.clear()
        for node in sorted(self._down):
            _run(["ip", "-n", self.bridge_netns, "link", "set", self.node(node).port, "up"])
        self._down.clear()
        return dropped

    def close(self) -> None:
        """Delete every namespace this network made (their links go with them)."""
        while self._created:
            _run(["ip", "netns", "del", self._created.pop()], check=False)
