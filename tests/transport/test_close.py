"""Closing a server while clients connect: UCX frees its listener while sockets it accepted
may still bring a connection request, and the request's callback read the freed listener (a
holder closed during reconnects crashed its process). The server now refuses new connections
and waits until no socket without a request is left before its listener goes."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

pytestmark = [pytest.mark.ucx, pytest.mark.timeout(120)]

# In a child process: a crash there fails the test instead of ending the suite.
CHURN = textwrap.dedent(
    """
    import os, random, threading, time
    from lumen_core.stream import HolderStore
    from lumen_core.transport import Client, TransportError

    secret = os.urandom(32)
    store = HolderStore()
    random.seed(0)
    slowest = 0.0
    for _ in range(ROUNDS):
        server = store.serve(secret, tls="tcp")
        port = server.port
        stop = threading.Event()

        def connect_again_and_again():
            while not stop.is_set():
                try:
                    with Client("127.0.0.1", port, secret, tls="tcp", connect_timeout_s=0.5):
                        pass
                except TransportError:
                    pass

        clients = [threading.Thread(target=connect_again_and_again) for _ in range(2)]
        for thread in clients:
            thread.start()
        time.sleep(random.uniform(0, 0.02))
        started = time.monotonic()
        server.close()
        slowest = max(slowest, time.monotonic() - started)
        stop.set()
        for thread in clients:
            thread.join()
    print("closed", ROUNDS, "slowest", slowest)
    """
)


def test_a_server_closed_while_clients_connect_closes_cleanly() -> None:
    rounds = 30  # before the fix the first or second round crashed
    child = subprocess.run(
        [sys.executable, "-c", CHURN.replace("ROUNDS", str(rounds))],
        capture_output=True,
        text=True,
        timeout=100,
    )
    assert child.returncode == 0, f"exit {child.returncode}: {child.stderr[-2000:]}"
    words = child.stdout.split()
    assert words[:2] == ["closed", str(rounds)], child.stdout
    assert float(words[3]) < 2.0  # the gate's wait is bounded (1 s) beside the usual close
