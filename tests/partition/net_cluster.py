"""A live cluster spread over a test ``Network``: the gateway, each worker (with its embedded
holder) and the client each in a namespace of their own, talking only over the bridge.

Node names: ``gateway``, ``w0`` ... ``w<n-1>``, ``client``. Every process gets
``UCX_TLS=tcp``: the namespaces share one IPC namespace, so UCX's shared-memory and CMA
transports would carry the checkpoints past every partition. This driver is also the
supervisor: ``kill`` reports a SIGKILLed worker's exit to the gateway (as
``LocalCluster.kill`` does), ``restart_exited`` restarts workers that exited (fenced, or
killed) as recovering ones.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from netns import Network

from lumen_core.auth import write_secret_file
from lumen_core.worker.cluster import TINY_RECORD_BYTES, WorkerProcess, write_models

HERE = Path(__file__).resolve().parent
GATEWAY_PORT = 50051  # the gateway namespace has nothing else listening
PROCESS_ENV = {"UCX_TLS": "tcp", "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}


def node_names(num_workers: int) -> list[str]:
    return ["gateway", *(f"w{i}" for i in range(num_workers)), "client"]


class NetCluster:
    """See module doc. ``unfenced``: the gateway and the workers run with fencing off (the
    tests' proof that an invariant can fail). ``close`` reaps every process it started and
    returns the gateway's ``stopped`` record."""

    def __init__(
        self,
        workdir: Path,
        network: Network,
        *,
        num_workers: int,
        lease_s: float,
        heartbeat_s: float = 0.25,
        policy: str = "LUMEN",
        seed: int = 0,
        unfenced: bool = False,
        ack_timeout_s: float = 1.0,
        give_up_after_s: float = 4.0,
        start_timeout_s: float = 90.0,
    ) -> None:
        self.workdir = Path(workdir)
        self.network = network
        self.num_workers = num_workers
        self.lease_s = lease_s
        self.unfenced = unfenced
        self.start_timeout_s = start_timeout_s
        self.streamer_args = [
            "--ack-timeout-s",
            str(ack_timeout_s),
            "--give-up-after-s",
            str(give_up_after_s),
        ]
        self.secret_path = self.workdir / "cluster.secret"
        write_secret_file(self.secret_path)
        self.model_path, self.draft_path = write_models(self.workdir, seed=seed)
        self.env = dict(os.environ, **PROCESS_ENV)
        self.gateway_address = f"{network.node('gateway').address}:{GATEWAY_PORT}"
        self.workers: dict[int, WorkerProcess] = {}
        self.exited: list[WorkerProcess] = []
        self._gateway_lock = threading.Lock()
        command = [
            sys.executable, str(HERE / "gateway_node.py"),
            "--host", network.node("gateway").address, "--port", str(GATEWAY_PORT),
            "--secret-file", str(self.secret_path), "--policy", policy,
            "--lease-s", str(lease_s), "--heartbeat-s", str(heartbeat_s),
            "--kv-bytes-per-token", str(TINY_RECORD_BYTES),
        ]  # fmt: skip
        if unfenced:
            command.append("--unfenced")
        self._gateway_log = open(self.workdir / "gateway.log", "w")  # noqa: SIM115 - closed in close()
        self.gateway = subprocess.Popen(
            network.argv("gateway", command),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._gateway_log,
            text=True,
            env=self.env,
            start_new_session=True,
        )
        self.stopped: dict[str, object] | None = None
        self.client: subprocess.Popen[str] | None = None
        listening = self._gateway_line()
        if listening.get("event") != "listening":
            raise RuntimeError(f"the gateway did not start: {listening}")

    # ---- the gateway ---------------------------------------------------------------------
    def _gateway_line(self) -> dict[str, object]:
        assert self.gateway.stdout is not None
        line = self.gateway.stdout.readline()
        if not line:
            log = (self.workdir / "gateway.log").read_text()[-3000:]
            raise RuntimeError(f"the gateway exited ({self.gateway.poll()}): {log}")
        return json.loads(line)

    def ask(self, command: str) -> dict[str, object]:
        """One command to the gateway node (``status``, ``exit W E``): its JSON reply."""
        with self._gateway_lock:
            assert self.gateway.stdin is not None
            self.gateway.stdin.write(command + "\n")
            self.gateway.stdin.flush()
            return self._gateway_line()

    # ---- workers -------------------------------------------------------------------------
    def spawn(self, worker_id: int, *, recovering: bool = False) -> WorkerProcess:
        node = f"w{worker_id}"
        program = [str(HERE / "unfenced_worker.py")] if self.unfenced else ["-m", "lumen_core.cli", "worker"]
        command = [
            sys.executable, *program,
            "--worker-id", str(worker_id), "--gateway", self.gateway_address,
            "--holder-host", self.network.node(node).address,
            "--secret-file", str(self.secret_path),
            "--model", str(self.model_path), "--draft", str(self.draft_path),
            "--modelled-full-load-s", "1.0", "--modelled-draft-load-s", "0.05",
            *self.streamer_args,
        ]  # fmt: skip
        if recovering:
            command.append("--recovering")
        log_path = self.workdir / f"{node}-{sum(w.worker_id == worker_id for w in self.exited)}.log"
        with open(log_path, "w") as log:
            process = subprocess.Popen(
                self.network.argv(node, command),
                stdout=subprocess.PIPE,
                stderr=log,
                text=True,
                env=self.env,
                start_new_session=True,
            )
        worker = WorkerProcess(worker_id, process, log_path)
        worker.follow()
        self.workers[worker_id] = worker
        return worker

    def wait_registered(self, worker: WorkerProcess) -> None:
        worker.wait_registered(self.start_timeout_s)

    def start(self) -> None:
        started = [self.spawn(w) for w in range(self.num_workers)]
        for worker in started:
            self.wait_registered(worker)

    def signal(self, node: str, signum: signal.Signals) -> None:
        """Send ``signum`` to the process group of node ``node`` (a worker, or ``client``;
        SIGSTOP / SIGCONT: a stall)."""
        if node == "client":
            assert self.client is not None
            os.killpg(self.client.pid, signum)
        else:
            os.killpg(self.workers[int(node[1:])].process.pid, signum)

    def kill(self, worker_id: int) -> None:
        """SIGKILL the worker, reap it and report its exit to the gateway (the supervisor)."""
        worker = self.workers.pop(worker_id)
        os.killpg(worker.process.pid, signal.SIGKILL)
        worker.process.wait(timeout=30)
        self.exited.append(worker)
        registered = worker.event("registered")
        if registered is not None:
            self.ask(f"exit {worker_id} {registered['epoch']}")

    def restart_exited(self) -> list[int]:
        """Restart (recovering) every worker whose process has ended; their ids."""
        restarted = []
        for worker_id, worker in list(self.workers.items()):
            if worker.process.poll() is not None:
                self.exited.append(self.workers.pop(worker_id))
        for worker_id in range(self.num_workers):
            if worker_id not in self.workers:
                self.wait_registered(self.spawn(worker_id, recovering=True))
                restarted.append(worker_id)
        return restarted

    def restore_failed(self, timeout_s: float) -> list[int]:
        """Wait until every worker the gateway has failed at its current epoch has exited
        (fenced itself) and restart it; the ids restarted. Stops at ``timeout_s``."""
        restarted: list[int] = []
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            restarted += self.restart_exited()
            failed = [w for w in self.ask("status")["workers"] if w["state"] == "failed"]  # type: ignore[attr-defined]
            if not failed:
                break
            time.sleep(0.2)
        return restarted

    # ---- the client ----------------------------------------------------------------------
    def start_client(self, arrivals: list[dict[str, object]], timeout_s: float) -> subprocess.Popen[str]:
        """The client node submitting ``arrivals`` (client_node.py's format), returned once its
        arrival clock has started; ``client_results`` reads what it received once it has exited."""
        (self.workdir / "arrivals.json").write_text(json.dumps(arrivals))
        command = [
            sys.executable, str(HERE / "client_node.py"), "--gateway", self.gateway_address,
            "--secret-file", str(self.secret_path), "--arrivals", str(self.workdir / "arrivals.json"),
            "--out", str(self.workdir / "client.json"), "--timeout-s", str(timeout_s),
        ]  # fmt: skip
        with open(self.workdir / "client.log", "w") as log:
            client = subprocess.Popen(
                self.network.argv("client", command),
                stdout=subprocess.PIPE,
                stderr=log,
                text=True,
                env=self.env,
                start_new_session=True,
            )
        self.client = client
        assert client.stdout is not None
        if client.stdout.readline().strip() != '{"event": "started"}':
            raise RuntimeError(
                f"the client did not start: {(self.workdir / 'client.log').read_text()[-2000:]}"
            )
        return client

    def client_results(self) -> list[dict[str, object]]:
        return json.loads((self.workdir / "client.json").read_text())

    # ---- teardown ------------------------------------------------------------------------
    def worker_stopped(self) -> list[dict[str, object]]:
        """The ``stopped`` line of every worker process that ended by itself or by SIGTERM."""
        return [stopped for w in self.exited if (stopped := w.stopped()) is not None]

    def close(self, grace_s: float = 10.0) -> dict[str, object]:
        """SIGTERM (then SIGKILL) every worker and the client, stop the gateway; its ``stopped``
        record. Every pipe to them is closed."""
        if self.client is not None:
            if self.client.poll() is None:
                os.killpg(self.client.pid, signal.SIGKILL)
            self.client.wait(timeout=30)
            assert self.client.stdout is not None
            self.client.stdout.close()
        for worker in self.workers.values():
            if worker.process.poll() is None:
                os.killpg(worker.process.pid, signal.SIGCONT)
                os.killpg(worker.process.pid, signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        for worker in list(self.workers.values()):
            try:
                worker.process.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                os.killpg(worker.process.pid, signal.SIGKILL)
                worker.process.wait(timeout=30)
            self.exited.append(worker)
        self.workers.clear()
        if self.stopped is None and self.gateway.poll() is None:
            try:
                assert self.gateway.stdin is not None
                self.gateway.stdin.write("stop\n")
                self.gateway.stdin.flush()
                self.stopped = self._gateway_line()
                self.gateway.wait(timeout=grace_s)
            except (OSError, RuntimeError, subprocess.TimeoutExpired, json.JSONDecodeError):
                os.killpg(self.gateway.pid, signal.SIGKILL)
                self.gateway.wait(timeout=30)
        for pipe in (self.gateway.stdin, self.gateway.stdout, self._gateway_log):
            if pipe is not None:
                pipe.close()
        return self.stopped or {}
