"""``LocalCluster``: a gateway (in this process) and worker processes on loopback.

What the demo and the end-to-end tests drive: it writes a random cluster secret (0600) and
the model files into ``workdir``, starts the gateway, spawns ``lumen worker`` processes
(each in its own process group), SIGKILLs and restarts them (reporting the exit to the
gateway as a supervisor would), and streams requests through the gateway's OpenAI front door
with the official ``openai`` client (the ``demo`` extra), recording every token's arrival time.
``close`` reaps every process it started (SIGTERM, then SIGKILL after a grace period).
"""

from __future__ import annotations

import json
import os
import secrets
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from lumen_core._validate import check_int
from lumen_core.auth import DEFAULT_CAPABILITY_TTL_S, read_secret_file, write_secret_file
from lumen_core.engine import ModelConfig, build_draft_pair, save_model
from lumen_core.gateway.client import GatewayClient
from lumen_core.gateway.config import GatewayConfig
from lumen_core.gateway.server import GatewayServer
from lumen_core.policy.load import LoadConfig
from lumen_core.policy.routing import RouterConfig

if TYPE_CHECKING:
    from lumen_core.gateway import lumen_pb2 as pb
    from lumen_core.gateway.http.text import Tokenizer

TINY_MODEL = ModelConfig()
DRAFT_NUM_LAYERS = 1
# One token's K and V in the tiny model's float64 cache: the record size L(w) counts.
TINY_RECORD_BYTES = 2 * TINY_MODEL.num_layers * TINY_MODEL.num_kv_heads * TINY_MODEL.head_dim * 8
HEARTBEAT_S = 0.25  # real seconds: worker reports, directives and the lease ride on it
HOLDER_BUDGET_BYTES = 1 << 30  # each worker's holder room for others' checkpoints
MODEL_NAME = "tiny"  # what the cluster's front door serves
MAX_CLIENT_STREAMS = 1024  # streams the front door admits at once (the faithful run's ~120 and its queue)
LATE_LAYER_SCALE = 0.15  # how far the target's late layers move it from the draft (acceptance)


def write_models(directory: Path, *, seed: int) -> tuple[Path, Path]:
    """The tiny float64 target and its truncated draft, saved as ``target.pt``, ``draft.pt``."""
    target, draft = build_draft_pair(
        TINY_MODEL,
        seed=seed,
        draft_num_layers=DRAFT_NUM_LAYERS,
        late_layer_scale=LATE_LAYER_SCALE,
        dtype="float64",
    )
    paths = (directory / "target.pt", directory / "draft.pt")
    save_model(target, paths[0])
    save_model(draft, paths[1])
    return paths


def _front_door(gateway: GatewayServer, key: str, tokenizer: Tokenizer | None) -> tuple[Any, Any]:
    """The gateway's OpenAI front door (started; ``key`` its client key) and the openai client
    of the cluster's streams: no retries (a retried completion would be a second request) and
    a connection for every stream the front door admits."""
    try:
        import httpx
        import openai

        from lumen_core.gateway.http.config import FrontDoorConfig
        from lumen_core.gateway.http.front_door import FrontDoor
    except ImportError as exc:
        raise ImportError(
            f"the live cluster's clients need the front door and the openai client ({exc}): "
            "pip install 'lumen_core[demo]'"
        ) from exc
    config = FrontDoorConfig(
        MODEL_NAME,
        vocab_size=TINY_MODEL.vocab_size,
        max_model_len=TINY_MODEL.max_position_embeddings,
        max_concurrent_requests=MAX_CLIENT_STREAMS,
    )
    door = FrontDoor(gateway, config, frozenset([key]), tokenizer=tokenizer).start()
    limits = httpx.Limits(max_connections=MAX_CLIENT_STREAMS, max_keepalive_connections=MAX_CLIENT_STREAMS)
    client = openai.OpenAI(
        base_url=door.url, api_key=key, max_retries=0, http_client=httpx.Client(limits=limits, timeout=60.0)
    )
    return door, client


@dataclass
class RequestResult:
    """One client request as the client saw it (times on the driver's monotonic clock)."""

    index: int
    arrival_s: float
    request_id: int = -1
    token_ids: list[int] = field(default_factory=list)
    token_times_s: list[float] = field(default_factory=list)
    finished: bool = False
    error: str = ""


@dataclass
class WorkerProcess:
    """A ``lumen worker`` process and the JSON events of its stdout, read by a thread of its
    own (``follow``; also the partition tests' NetCluster's record)."""

    worker_id: int
    process: subprocess.Popen[str]
    stderr_path: Path
    events: list[dict[str, object]] = field(default_factory=list)
    registered: threading.Event = field(default_factory=threading.Event)
    reader: threading.Thread | None = None

    def follow(self) -> None:
        """Start reading the events; the pipe is closed once the process has ended."""
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        assert self.process.stdout is not None
        with self.process.stdout:
            for line in self.process.stdout:
                try:
                    event = json.loads(line)
                except json.JSONDecodeError:
                    continue
                self.events.append(event)
                if event.get("event") == "registered":
                    self.registered.set()

    def event(self, name: str) -> dict[str, object] | None:
        """The first event called ``name``, or None."""
        return next((e for e in self.events if e.get("event") == name), None)

    def stopped(self) -> dict[str, object] | None:
        """The ``stopped`` line of a process that has ended (None: it wrote none)."""
        if self.reader is not None:
            self.reader.join(timeout=10)  # the process has ended: its pipe ends
        return self.event("stopped")

    def wait_registered(self, timeout_s: float) -> None:
        """Until the worker has registered; RuntimeError (with its log's tail) if it exits or
        ``timeout_s`` passes first."""
        deadline = time.monotonic() + timeout_s
        while not self.registered.wait(0.1):
            if self.process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(
                    f"worker {self.worker_id} did not register (exit {self.process.poll()}): "
                    f"{self.stderr_path.read_text()[-2000:]}"
                )


class LocalCluster:
    """See module doc. ``kv_bytes_per_token`` (the tiny model's record size) makes L(w)'s
    held-token term count real checkpoint sizes. ``router_config`` goes to the gateway (e.g.
    ``remote_restore``) with ``capability_ttl_s``; ``ack_timeout_s`` and ``give_up_after_s`` to
    every worker's checkpoint streamer, ``holder_linger_s`` to every worker (None: the
    worker's defaults); ``encrypt_payloads`` makes every worker encrypt its records to and
    from holders; ``num_blocks``: every worker's KV cache pages (None: the worker's default).
    ``door`` is the gateway's OpenAI front door (``tokenizer``: its text tokenizer, None for
    token ids only), ``api_key`` its one client key, ``openai`` the client ``run_request``
    streams with."""

    def __init__(
        self,
        workdir: Path,
        *,
        policy: str,
        num_workers: int,
        seed: int = 0,
        lease_s: float = 10.0,
        heartbeat_s: float = HEARTBEAT_S,
        modelled_full_load_s: float | None = 2.0,
        modelled_draft_load_s: float | None = 0.05,
        pace: str | None = None,
        time_scale: float = 1.0,
        budget_bytes: int = HOLDER_BUDGET_BYTES,
        start_timeout_s: float = 60.0,
        router_config: RouterConfig = RouterConfig(),
        ack_timeout_s: float | None = None,
        give_up_after_s: float | None = None,
        capability_ttl_s: float = DEFAULT_CAPABILITY_TTL_S,
        holder_linger_s: float | None = None,
        encrypt_payloads: bool = False,
        num_blocks: int | None = None,
        tokenizer: Tokenizer | None = None,
    ) -> None:
        check_int("num_workers", num_workers, low=2)
        self.workdir = Path(workdir)
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.num_workers = num_workers
        self.modelled_full_load_s = modelled_full_load_s
        self.modelled_draft_load_s = modelled_draft_load_s
        self.pace = pace
        self.time_scale = time_scale
        self.budget_bytes = budget_bytes
        self.worker_args = [] if ack_timeout_s is None else ["--ack-timeout-s", str(ack_timeout_s)]
        if give_up_after_s is not None:
            self.worker_args += ["--give-up-after-s", str(give_up_after_s)]
        if holder_linger_s is not None:
            self.worker_args += ["--holder-linger-s", str(holder_linger_s)]
        if encrypt_payloads:
            self.worker_args.append("--encrypt-payloads")
        if num_blocks is not None:
            self.worker_args += ["--num-blocks", str(check_int("num_blocks", num_blocks, low=1))]
        self.start_timeout_s = start_timeout_s
        self.secret_path = self.workdir / "cluster.secret"
        if not self.secret_path.exists():
            write_secret_file(self.secret_path)
        self.secret = read_secret_file(self.secret_path)
        self.model_path = self.workdir / "target.pt"
        self.draft_path = self.workdir / "draft.pt"
        if not self.model_path.exists() or not self.draft_path.exists():
            write_models(self.workdir, seed=seed)
        self.gateway = GatewayServer(
            GatewayConfig(
                policy=policy,
                lease_s=lease_s,
                heartbeat_s=heartbeat_s,
                load_config=LoadConfig(kv_bytes_per_token=TINY_RECORD_BYTES),
                router_config=router_config,
                capability_ttl_s=capability_ttl_s,
            ),
            self.secret,
            port=0,
            max_streams=256,
        )
        self.gateway.start()
        self.client = GatewayClient(self.gateway.address, self.secret, timeout_s=10.0)
        # Clients come in as a user's would (issue 20): the official openai client through the
        # gateway's OpenAI front door, one connection per stream.
        try:
            self.api_key = secrets.token_urlsafe(32)
            self.door, self.openai = _front_door(self.gateway, self.api_key, tokenizer)
        except BaseException:
            self.client.close()
            self.gateway.stop()
            raise
        self.workers: dict[int, WorkerProcess] = {}
        self.exited: list[WorkerProcess] = []
        self.clock0 = time.monotonic()

    def now_s(self) -> float:
        return time.monotonic() - self.clock0

    # ---- processes -----------------------------------------------------------------------
    def spawn(self, worker_id: int, *, recovering: bool = False) -> WorkerProcess:
        command = [
            sys.executable, "-m", "lumen_core.cli", "worker",
            "--worker-id", str(worker_id),
            "--gateway", self.gateway.address,
            "--secret-file", str(self.secret_path),
            "--model", str(self.model_path),
            "--draft", str(self.draft_path),
            "--budget-bytes", str(self.budget_bytes),
            "--time-scale", str(self.time_scale),
        ]  # fmt: skip
        # None: the worker's default (the --pace setup's load times, else the 32B constants).
        if self.modelled_full_load_s is not None:
            command += ["--modelled-full-load-s", str(self.modelled_full_load_s)]
        if self.modelled_draft_load_s is not None:
            command += ["--modelled-draft-load-s", str(self.modelled_draft_load_s)]
        if self.pace is not None:
            command += ["--pace", self.pace]
        command += self.worker_args
        if recovering:
            command.append("--recovering")
        stderr_path = self.workdir / f"worker{worker_id}-{len(self.exited)}.log"
        env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
        with open(stderr_path, "w") as stderr:
            process = subprocess.Popen(
                command, stdout=subprocess.PIPE, stderr=stderr, text=True, env=env, start_new_session=True
            )
        worker = WorkerProcess(worker_id, process, stderr_path)
        worker.follow()
        self.workers[worker_id] = worker
        return worker

    def wait_registered(self, worker: WorkerProcess) -> None:
        worker.wait_registered(self.start_timeout_s)

    def start(self) -> None:
        started = [self.spawn(w) for w in range(self.num_workers)]
        for worker in started:
            self.wait_registered(worker)

    def worker_status(self, worker_id: int) -> pb.WorkerStatus:
        """The gateway's ``WorkerStatus`` of ``worker_id`` (epoch, state, load); KeyError if unknown."""
        for status in self.client.status().workers:
            if status.worker_id == worker_id:
                return status
        raise KeyError(worker_id)

    def epoch(self, worker_id: int) -> int:
        return int(self.worker_status(worker_id).epoch)

    def kill(self, worker_id: int) -> float:
        """SIGKILL the worker's process group, reap it, report the exit; the failure time."""
        worker = self.workers.pop(worker_id)
        epoch = self.epoch(worker_id)
        os.killpg(worker.process.pid, signal.SIGKILL)
        failure_s = self.now_s()
        worker.process.wait(timeout=30)
        self.exited.append(worker)
        # In the gateway's process: over gRPC, ReportExit takes the dead incarnation's call key.
        self.gateway.report_exit(worker_id, epoch, "SIGKILL by the demo")
        return failure_s

    def restart(self, worker_id: int) -> WorkerProcess:
        worker = self.spawn(worker_id, recovering=True)
        self.wait_registered(worker)
        return worker

    def worker_stats(self) -> list[dict[str, object]]:
        """The ``stopped`` line of every worker that ended cleanly."""
        return [stopped for w in self.exited if (stopped := w.stopped()) is not None]

    # ---- requests ------------------------------------------------------------------------
    def run_request(
        self, result: RequestResult, prompt: list[int], max_new_tokens: int, timeout_s: float
    ) -> None:
        """Stream one greedy completion of ``prompt`` (token ids) through the front door and
        record its tokens as they arrive (blocking; one thread per request). ``timeout_s``
        bounds each wait for the next event. A stream that breaks off (an error event, a
        dropped connection) leaves ``error`` set and ``finished`` False."""
        try:
            events = self.openai.completions.create(
                model=MODEL_NAME,
                prompt=prompt,
                max_tokens=max_new_tokens,
                temperature=0.0,
                stream=True,
                timeout=timeout_s,
            )
            for chunk in events:
                now = self.now_s()
                result.request_id = int(chunk.id.removeprefix("cmpl-"))
                for choice in chunk.choices:
                    token_ids = list(getattr(choice, "token_ids", None) or ())
                    result.token_ids.extend(token_ids)
                    result.token_times_s.extend([now] * len(token_ids))
                    if choice.finish_reason is not None:
                        result.finished = True
        except Exception as exc:  # noqa: BLE001 - recorded: the request counts as lost
            result.error = f"{type(exc).__name__}: {exc}"

    # ---- teardown ------------------------------------------------------------------------
    def close(self, grace_s: float = 10.0) -> None:
        for worker in self.workers.values():
            if worker.process.poll() is None:
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
        self.openai.close()
        self.door.stop()
        self.client.close()
        self.gateway.stop()

    def __enter__(self) -> LocalCluster:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
