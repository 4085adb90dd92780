"""``Agent``: what ``lumen agent`` runs beside one vLLM server (LumenConnector loaded).

To the gateway it is a worker: it registers the server (worker id, holder address),
heartbeats with the server's load (running and waiting requests from vLLM's ``/metrics``),
and applies the gateway's directives. It serves the node's ``HolderStore`` on the transport
(other servers' requests checkpoint into it; HOLD reserves room, RELEASE drops). RUN and
RESUME become streaming requests to the server's OpenAI endpoint (``upstream``), whose tokens
it reports by position (a request the server refuses, with the server's error: it ends at its
client); CANCEL closes that stream (vLLM aborts the request). Drained (FLUSH), it has the
connector make every saved token durable and keep its checkpoints (control ``flush``, then
``abandon``), closes every relay and says ``flushed``: the gateway moves each request, restored
from its holders, and STOP ends the agent (EXIT_OK) and its server. It starts the
server (its CPU binding ``VLLM_CPU_OMP_THREADS_BIND`` and KV space ``VLLM_CPU_KVCACHE_SPACE``,
the connector's ``kv_transfer_config`` with the control socket) or attaches to a running one,
and reports the server's exit to the gateway at once (``ReportExit``): the gateway fails the
worker and moves its requests without waiting for the lease.

Fenced (the lease lost, a token report refused for its epoch), it stops serving that epoch
without exiting (issue 23): the connector is told to keep its checkpoints (control
``abandon``), every relay is closed (vLLM aborts those requests: the gateway moves them),
queued reports are dropped; the holder and the server stay up, and every heartbeat period for
``holder_linger_s`` it registers again with the checkpoints its store holds, so that the
healed gateway restores parked requests from them. Registered again it serves as the new
epoch (``relinked``); past the linger it ends EXIT_FENCED.

Threads: the heartbeat loop's (directives arrive there), one asyncio loop for the upstream
streams, one reporter (token reports, batched), the supervisor (waits on the server), while
fenced the linger's (registers again), and once drained the flush's.
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import math
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from collections import deque
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import httpx

from lumen_core.auth import WorkerIdentity
from lumen_core.gateway.client import FencedError, GatewayClient, RequestTokens
from lumen_core.gateway.directives import (
    AssistDraft,
    AssistStop,
    AssistVerify,
    Cancel,
    Directive,
    Flush,
    Hold,
    Release,
    Renew,
    Resume,
    Run,
    Stop,
    Stream,
)
from lumen_core.gateway.errors import GatewayError, StaleEpochError
from lumen_core.gateway.heartbeat import HeartbeatLoop
from lumen_core.gateway.reports import RunningReport, WorkerReport
from lumen_core.integrations.vllm import control
from lumen_core.stream import HolderStore
from lumen_core.worker.exit_watch import ExitWatch
from lumen_core.worker.exits import EXIT_FENCED, EXIT_OK, EXIT_SERVER_EXITED
from lumen_core.worker.held import held_reports
from lumen_core.worker.upstream import UpstreamError, completion_body, open_session, renew_args, stream_tokens

__all__ = [
    "Agent",
    "AgentConfig",
    "ResumeTiming",
    "record_bytes_of",
    "server_load",
    "start_dying_with_parent",
]

logger = logging.getLogger(__name__)

_DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}
_HEALTH_POLL_S = 0.5
_METRICS_TIMEOUT_S = 1.0
_ATTACHED_MISSES = 3  # an attached server that fails this many health checks in a row exited
_REPORT_RETRY_S = 0.1  # a token report the gateway did not get is sent again this often
_MAX_UNSENT_REPORTS = 4096  # kept while the gateway cannot be reached; older ones dropped past it
_DRAIN_FLUSH_S = 5.0  # a drain's control `flush` waits this long for every saved token durable
_MAX_RESUME_TIMINGS = 1024  # the latest RESUMEs' timings kept for the stats
_EXIT_POLL_S = 0.01  # how often the supervisor looks for a server the kernel is ending


def record_bytes_of(model_dir: str | os.PathLike[str], dtype: str) -> int:
    """Bytes of one token's KV record of the model in ``model_dir`` (its ``config.json``) at
    ``dtype``: layers x 2 (K, V) x KV heads x head size x item size, as the connector's
    records. Raises ValueError for an unknown dtype or a config without those fields."""
    if dtype not in _DTYPE_BYTES:
        raise ValueError(f"`dtype` must be one of {sorted(_DTYPE_BYTES)}, got {dtype!r}")
    config = json.loads((Path(model_dir) / "config.json").read_text())
    try:
        num_layers = int(config["num_hidden_layers"])
        num_heads = int(config["num_attention_heads"])
        num_kv_heads = int(config.get("num_key_value_heads", num_heads))
        head_dim = int(config.get("head_dim") or config["hidden_size"] // num_heads)
    except (KeyError, TypeError) as exc:
        raise ValueError(
            f"`config.json` of {model_dir} must name the attention shape, missing {exc}"
        ) from None
    return num_layers * 2 * num_kv_heads * head_dim * _DTYPE_BYTES[dtype]


@dataclass(frozen=True)
class AgentConfig:
    """worker_id: this server's id in the cluster. gateway: ``host:port`` of its gRPC.
    secret_file: the cluster secret (0600). model: the model directory the server serves
    (its ``config.json`` sizes HOLD reservations), at ``dtype``. server_url: attach to a
    server already running there (None: start one on ``port``, 0 = a free one, with
    ``server_args`` added to its command line). cpu_bind: the started server's
    ``VLLM_CPU_OMP_THREADS_BIND`` (None: core ``worker_id`` mod the CPUs, so servers on one
    host do not all bind to the same core). kv_space_gib: its ``VLLM_CPU_KVCACHE_SPACE``.
    control_socket: the connector's control channel (started server: created there; default
    ``workdir/control-<id>.sock``). budget_bytes: the holder's budget for other servers'
    checkpoints, reserve_bytes how much of it is mapped at start (``HolderStore``);
    holder_host its listen address; tls the UCX transports of the holder and
    the connector. start_timeout_s: bound on the server's start. holder_linger_s: how long a
    fenced agent keeps its holder up, registering again (0: it exits at once).
    encrypt_payloads: the started server's connector encrypts its records to and from holders
    (AES-256-GCM; the connector's ``encrypt``). identity_key_file: the server's worker identity
    (an Ed25519 private key, 0600; docs/security.md), which its connector's ``identity_key_file``
    names too: the agent registers with it and hands each credential to the connector. A
    started server: default ``workdir/identity-<id>.key``, created if missing. Attached: None
    registers without an identity (the gateway's capabilities for it are then unbound)."""

    worker_id: int
    gateway: str
    secret_file: str
    model: str
    workdir: str
    dtype: str = "float32"
    server_url: str | None = None
    port: int = 0
    server_args: tuple[str, ...] = ()
    cpu_bind: str | None = None
    kv_space_gib: float = 1.0
    control_socket: str | None = None
    budget_bytes: int = 1 << 30
    reserve_bytes: int = 0
    holder_host: str = "127.0.0.1"
    tls: str = ""
    start_timeout_s: float = 600.0
    holder_linger_s: float = 60.0
    encrypt_payloads: bool = False
    identity_key_file: str | None = None

    def __post_init__(self) -> None:
        if isinstance(self.worker_id, bool) or not isinstance(self.worker_id, int) or self.worker_id < 0:
            raise ValueError(f"`worker_id` must be an int >= 0, got {self.worker_id!r}")
        if not (Path(self.model) / "config.json").is_file():
            raise ValueError(f"`model` must be a model directory with a config.json, got {self.model!r}")
        if not Path(self.workdir).is_dir():
            raise ValueError(f"`workdir` must be an existing directory, got {self.workdir!r}")
        if self.dtype not in _DTYPE_BYTES:
            raise ValueError(f"`dtype` must be one of {sorted(_DTYPE_BYTES)}, got {self.dtype!r}")
        if not 0 <= self.port <= 65535:
            raise ValueError(f"`port` must be in [0, 65535], got {self.port}")
        if not 0 < self.kv_space_gib < math.inf:
            raise ValueError(f"`kv_space_gib` must be a number > 0, got {self.kv_space_gib}")
        if self.budget_bytes < 0:
            raise ValueError(f"`budget_bytes` must be >= 0, got {self.budget_bytes}")
        if not 0 <= self.reserve_bytes <= self.budget_bytes:
            raise ValueError(f"`reserve_bytes` must be in [0, budget_bytes], got {self.reserve_bytes}")
        if not 0 <= self.holder_linger_s < math.inf:
            raise ValueError(f"`holder_linger_s` must be a finite number >= 0, got {self.holder_linger_s}")
        if self.server_url is not None and self.server_args:
            raise ValueError("`server_args` must be empty when attaching to a running server (`server_url`)")

    @property
    def socket_path(self) -> str:
        return self.control_socket or str(Path(self.workdir) / f"control-{self.worker_id}.sock")

    @property
    def identity_path(self) -> str | None:
        if self.identity_key_file is not None or self.server_url is not None:
            return self.identity_key_file
        return str(Path(self.workdir) / f"identity-{self.worker_id}.key")


class _ServerIdentity(WorkerIdentity):
    """The vLLM server's identity, whose key its connector holds too: each credential a
    registration takes goes on to the connector (control ``credential``) before any directive
    of that registration applies (``GatewayClient.register`` accepts it first), so the requests
    relayed after it open connections that prove it."""

    def __init__(self, private_key: bytes, *, control_socket: str) -> None:
        super().__init__(private_key)
        self._control_socket = control_socket

    def accept(self, credential: bytes, issuer_public_key: bytes, worker_id: int) -> None:
        super().accept(credential, issuer_public_key, worker_id)
        control.ask(
            self._control_socket,
            "credential",
            credential=credential.hex(),
            issuer_public_key=issuer_public_key.hex(),
            worker_id=worker_id,
        )


def _server_identity(config: AgentConfig) -> _ServerIdentity | None:
    path = config.identity_path
    if path is None:
        return None
    if config.server_url is None and not Path(path).exists():
        return _ServerIdentity.create_key_file(path, control_socket=config.socket_path)
    return _ServerIdentity.from_key_file(path, control_socket=config.socket_path)


def server_load(metrics_text: str) -> tuple[int, int]:
    """(running, waiting) from vLLM's Prometheus text (summed over its label sets)."""
    counts = {"vllm:num_requests_running": 0.0, "vllm:num_requests_waiting": 0.0}
    for line in metrics_text.splitlines():
        name = line.partition("{")[0].partition(" ")[0]
        if name in counts:
            counts[name] += float(line.rsplit(" ", 1)[1])
    return int(counts["vllm:num_requests_running"]), int(counts["vllm:num_requests_waiting"])


@dataclass
class _Counters:
    served: int = 0
    resumed: int = 0
    restoring: int = 0
    cancelled: int = 0
    upstream_errors: int = 0
    upstream_refused: int = 0  # of those, 4xx refusals reported to the gateway (the request ends)
    upstream_failed: int = 0  # of those, other answered errors reported as failed (it is moved)
    streams_ignored: int = 0
    renewed: int = 0
    renews_ignored: int = 0
    abandoned: int = 0  # relays closed when fenced (the gateway moves those requests)
    drained: int = 0  # relays closed when drained (the gateway moves those requests)
    relinked: int = 0  # registrations after a fencing
    tokens: int = 0
    token_reports: int = 0  # ReportTokens calls answered (tokens / token_reports: the batching)
    errors: deque[str] = field(default_factory=lambda: deque(maxlen=8))  # the latest upstream errors


@dataclass(frozen=True)
class ResumeTiming:
    """One RESUME this agent served, on the host's monotonic clock (``time.monotonic``: one
    clock for every process of a host, so a demo can line it up with the gateway's and its
    clients' times): when the directive reached the agent, and when the server's first token
    of it (output ``position``) came back. ``restoring``: the body named a restore source."""

    request_id: int
    epoch: int
    position: int
    restoring: bool
    received_s: float
    first_token_s: float


@dataclass
class _Relayed:
    """A request the agent relays: what a restarted gateway needs to adopt it."""

    epoch: int
    prompt: tuple[int, ...]
    max_new_tokens: int
    outputs: list[int]  # the tokens its client had at the RUN/RESUME, then those relayed since


class Agent:
    """One node's agent (module doc). ``start`` (server up, registered), then ``wait``
    returns an exit status (EXIT_SERVER_EXITED, EXIT_FENCED past the linger, or EXIT_OK
    after ``stop``); ``close`` ends everything it started (the server it started: SIGTERM,
    then SIGKILL)."""

    def __init__(self, config: AgentConfig) -> None:
        from lumen_core.auth import read_secret_file

        self.config = config
        self.secret = read_secret_file(config.secret_file)
        self.record_bytes = record_bytes_of(config.model, config.dtype)
        self.store = HolderStore(config.budget_bytes, reserve_bytes=config.reserve_bytes)
        self.holder = self.store.serve(
            self.secret, address=config.holder_host, port=0, holder_id=config.worker_id, tls=config.tls
        )
        self.holder_address = f"{config.holder_host}:{self.holder.port}"
        self.identity = _server_identity(config)
        self.client = GatewayClient(
            config.gateway, self.secret, on_issuer_key=self.holder.trust_issuer, identity=self.identity
        )
        self.server_url = config.server_url
        self.proc: subprocess.Popen[bytes] | None = None
        self.counters = _Counters()
        self.heartbeats: HeartbeatLoop | None = None
        self._done = threading.Event()
        self._status = EXIT_OK
        self._reason = ""
        self._exit_reported = False
        self._exit_lock = threading.Lock()  # the first ending
        self._report_lock = threading.Lock()  # the one exit report, held while it is out
        self._store_lock = threading.Lock()
        self._fence_lock = threading.Lock()  # one linger at a time
        self._linger_thread: threading.Thread | None = None  # while fenced
        self._refused: set[int] = set()
        self._evicted: set[int] = set()
        self._load = (0, 0)
        self._draining = threading.Event()  # told to FLUSH
        self._flushed = threading.Event()  # drained: every relay closed, checkpoints kept
        self._http_sync = httpx.Client(timeout=_METRICS_TIMEOUT_S)
        self._loop = asyncio.new_event_loop()
        self._http: aiohttp.ClientSession | None = None  # made on the loop's thread
        self._tasks: dict[int, tuple[int, asyncio.Task[None]]] = {}  # request id -> (epoch, task)
        self._relayed: dict[int, _Relayed] = {}  # of the tasks; read by the heartbeat thread
        self._reports: queue.Queue[RequestTokens | None] = queue.Queue()
        self._resumes: deque[ResumeTiming] = deque(maxlen=_MAX_RESUME_TIMINGS)  # on the loop only
        self._server_exited_s: float | None = None  # when the supervisor saw it (host's monotonic)
        self._threads: list[threading.Thread] = []

    # ---- the server ----------------------------------------------------------------------
    def _transfer_config(self) -> dict[str, Any]:
        """LumenConnector with no static holders (each request names its own, with the
        gateway's capabilities) and the control socket."""
        return {
            "kv_connector": "LumenConnector",
            "kv_connector_module_path": "lumen_core.integrations.vllm",
            "kv_role": "kv_both",
            "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": {
                "secret_file": self.config.secret_file,
                "holders": [],
                "tls": self.config.tls,
                "control_socket": self.config.socket_path,
                "encrypt": self.config.encrypt_payloads,
                **({} if self.identity is None else {"identity_key_file": self.config.identity_path}),
            },
        }

    def _start_server(self) -> None:
        config = self.config
        port = config.port or _free_port()
        # The API server's module: vllm-cpu's `vllm` command exits at start (docs/vllm.md).
        argv = [
            sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", config.model,
            "--host", "127.0.0.1", "--port", str(port), "--dtype", config.dtype,
            "--kv-transfer-config", json.dumps(self._transfer_config()),
            "--disable-access-log-for-endpoints", "/health,/metrics",  # the agent polls them
            *config.server_args,
        ]  # fmt: skip
        bind = (
            config.cpu_bind if config.cpu_bind is not None else str(config.worker_id % (os.cpu_count() or 1))
        )
        env = {
            **os.environ,
            "VLLM_CPU_OMP_THREADS_BIND": bind,
            "VLLM_CPU_KVCACHE_SPACE": f"{config.kv_space_gib:g}",
        }
        with open(Path(config.workdir) / f"vllm-{config.worker_id}.log", "ab") as log:
            self.proc = start_dying_with_parent(argv, env=env, stdout=log)
        self.server_url = f"http://127.0.0.1:{port}"

    def _healthy(self) -> bool:
        try:
            return self._http_sync.get(f"{self.server_url}/health").status_code == 200
        except httpx.HTTPError:
            return False

    def _wait_healthy(self) -> None:
        deadline = time.monotonic() + self.config.start_timeout_s
        while not self._healthy():
            if self.proc is not None and self.proc.poll() is not None:
                raise RuntimeError(
                    f"the vLLM server exited with {self.proc.returncode} before it was healthy"
                )
            if time.monotonic() > deadline:
                raise RuntimeError(f"the vLLM server at {self.server_url} was not healthy after "
                                   f"{self.config.start_timeout_s} s")  # fmt: skip
            time.sleep(_HEALTH_POLL_S)

    def _supervise(self) -> None:
        """Waits for the server's exit (started: the process; attached: its health) and
        reports it to the gateway at once."""
        if self.proc is not None:
            reason = self._wait_for_exit(self.proc)
            self._server_exited_s = time.monotonic()
        else:
            misses = 0
            while misses < _ATTACHED_MISSES and not self._done.wait(_HEALTH_POLL_S):
                misses = 0 if self._healthy() else misses + 1
            if misses < _ATTACHED_MISSES:
                return  # the agent stopped, the server did not fail
            reason = f"the vLLM server at {self.server_url} failed {_ATTACHED_MISSES} health checks"
        # The status first: once the exit is reported the gateway fences this epoch, and a
        # token report or heartbeat refused then must not make it read "fenced".
        self._finish(EXIT_SERVER_EXITED, reason)
        self._report_exit(reason)

    @staticmethod
    def _wait_for_exit(proc: subprocess.Popen[bytes]) -> str:
        """Returns once the server exited, or once the kernel has begun to end it (it is
        reaped only after its memory is torn down: exit_watch)."""
        with ExitWatch(proc.pid) as watch:
            while True:
                code = proc.poll()
                if code is not None:
                    return f"the vLLM server exited with {code}"
                if watch.exiting():
                    return "the vLLM server is exiting (killed or ended; not yet reaped)"
                time.sleep(_EXIT_POLL_S)

    def _report_exit(self, reason: str) -> None:
        """Tell the gateway this incarnation is gone: once, from whichever thread is first.
        A second caller waits until the first report is answered: ``close`` (woken by the
        supervisor's ``_finish``, just before its report) must not close the client under
        it, or the report is cancelled and the gateway learns of the exit only when the
        lease expires, ``lease_s`` later."""
        with self._report_lock:
            if self._exit_reported or self.client.epoch == 0:
                return
            self._exit_reported = True
            try:
                self.client.report_exit(self.config.worker_id, self.client.epoch, reason)
            except GatewayError as exc:  # the lease then decides
                logger.warning("lumen agent: could not report the exit (%s): %s", reason, exc)

    def _finish(self, status: int, reason: str) -> None:
        """The first ending wins (the server's exit, a fence, or a stop)."""
        with self._exit_lock:
            if not self._done.is_set():
                self._status, self._reason = status, reason
                self._done.set()

    # ---- the gateway ---------------------------------------------------------------------
    def report(self) -> WorkerReport:
        """The heartbeat's report: the server's load (its last /metrics; kept when it does
        not answer in time), what the holder keeps, refusals and evictions not acknowledged."""
        try:
            self._load = server_load(self._http_sync.get(f"{self.server_url}/metrics").text)
        except (httpx.HTTPError, ValueError, IndexError):
            pass
        checkpoints = self.store.checkpoints()
        held = held_reports(checkpoints)
        with self._store_lock:
            refused, evicted = tuple(sorted(self._refused)), tuple(sorted(self._evicted))
        return WorkerReport(
            num_running=self._load[0],
            num_waiting=self._load[1],
            held_bytes=sum(c.durable_tokens * (c.record_bytes + 8) for c in checkpoints),
            held=held,
            refused_request_ids=refused,
            evicted_request_ids=evicted,
            flushed=self._flushed.is_set(),
        )

    def running(self) -> tuple[RunningReport, ...]:
        """What the agent relays, for a restarted gateway to adopt (its registration after
        ``reregister``): each request's epoch, prompt and outputs so far, so its relay goes on
        and its client can watch it again. Read on the heartbeat thread: snapshots."""
        return tuple(
            RunningReport(request_id, r.epoch, r.prompt, tuple(r.outputs), r.max_new_tokens, 0)
            for request_id, r in list(self._relayed.items())
        )

    def _reported(self, report: WorkerReport) -> None:
        with self._store_lock:
            self._refused.difference_update(report.refused_request_ids)
            self._evicted.difference_update(report.evicted_request_ids)

    def _on_directives(self, directives: tuple[Directive, ...]) -> None:
        """On the heartbeat loop's threads (one at a time): holder directives here, request
        directives handed to the upstream loop."""
        for directive in directives:
            match directive:
                case Hold():
                    self._reserve(directive)
                case Release():
                    self.store.expire(directive.request_id)
                case Run() | Resume():
                    self._loop.call_soon_threadsafe(self._serve, directive, time.monotonic())
                case Cancel():
                    self._loop.call_soon_threadsafe(self._cancel, directive.request_id)
                case Stream():
                    # vLLM gives a running request no new holders: its checkpoint stays where
                    # it streams (a later restore from a new holder finds nothing and
                    # re-prefills; docs/front_door.md).
                    self.counters.streams_ignored += 1
                case Renew():
                    # Off the heartbeat thread: a stalled engine answers the channel late.
                    self._loop.call_soon_threadsafe(self._renew, directive)
                case Flush():
                    if not self._draining.is_set():  # once: a redelivered FLUSH changes nothing
                        self._draining.set()
                        # Off the heartbeat thread: the flush waits for the engine's steps.
                        thread = threading.Thread(target=self._flush, name="lumen-agent-flush", daemon=True)
                        thread.start()
                        self._threads.append(thread)
                case Stop():
                    self._finish(EXIT_OK, directive.reason or "drained")
                case AssistDraft() | AssistVerify() | AssistStop():
                    pass  # vLLM takes no outside drafts: no mechanism 3 here

    def _flush(self) -> None:
        """FLUSH (drained; runs once): every token the server saved made durable on its
        holders (control ``flush``), its checkpoints kept (``abandon``, answered once a step
        took it, so the aborts that follow release nothing), every relay closed, and the next
        heartbeat, sent now, says ``flushed``: the gateway moves each request, restored from
        its holders (tokens decoded after the flush are recomputed there). Without the
        channel the requests are still moved, their checkpoints released by the aborts:
        re-prefilled."""
        for command, args in (("flush", {"wait_s": _DRAIN_FLUSH_S}), ("abandon", {})):
            try:
                reply = control.ask(self.config.socket_path, command, timeout_s=_DRAIN_FLUSH_S + 5.0, **args)
            except (control.ControlError, OSError) as exc:
                logger.warning("lumen agent: drained, control %s failed: %s", command, exc)
                continue
            if not reply.get("flushed", reply.get("applied", True)):
                logger.warning("lumen agent: drained, control %s did not complete: %s", command, reply)
        closed = asyncio.run_coroutine_threadsafe(self._cancel_all(), self._loop).result()
        self.counters.drained += closed
        self._flushed.set()
        if self.heartbeats is not None:
            self.heartbeats.beat_now()

    def _renew(self, directive: Renew) -> None:
        """RENEW (on the loop): the fresh capabilities go to the connector (control ``renew``)
        on an executor thread, which hands them to the request's replicas at its next step."""
        ask = functools.partial(control.ask, self.config.socket_path, "renew", **renew_args(directive))
        self._loop.run_in_executor(None, ask).add_done_callback(
            functools.partial(self._renewed, directive.request_id)
        )

    def _renewed(self, request_id: int, reply: asyncio.Future[Any]) -> None:
        """A renew's answer (on the loop): one the connector does not run at that epoch, or
        could not take, counts as ignored."""
        if reply.cancelled():
            return
        if (error := reply.exception()) is not None:
            self.counters.renews_ignored += 1
            logger.warning("lumen agent: renew of request %d: %s", request_id, error)
        elif reply.result()["known"]:
            self.counters.renewed += 1
        else:
            self.counters.renews_ignored += 1

    def _reserve(self, directive: Hold) -> None:
        """HOLD: charge ``reserved_bytes`` of the store per shard, as tokens of this model's
        record size (plus 8 bytes of token id and crc each), as a reference worker does."""
        if directive.reserved_bytes == 0:
            return
        request_id = directive.request_id
        num_tokens = -(-directive.reserved_bytes // (self.record_bytes + 8))
        with self._store_lock:
            before = {c.request_id for c in self.store.checkpoints()}
            shards = max(1, len(directive.grant.capabilities))
            refused = not all(
                self.store.reserve(request_id, num_tokens, self.record_bytes, shard=s) for s in range(shards)
            )
            if refused:
                self.store.expire(request_id)
                self._refused.add(request_id)
            self._evicted |= before - {c.request_id for c in self.store.checkpoints()} - {request_id}

    def _register(self) -> None:
        """Register (a new epoch, with the checkpoints the store holds) and heartbeat."""
        self.client.register(
            self.config.worker_id,
            budget_bytes=self.config.budget_bytes,
            holder_address=self.holder_address,
            held=held_reports(self.store.checkpoints()),
            on_directives=self._on_directives,
        )
        self.heartbeats = HeartbeatLoop(
            self.client,
            self.report,
            self._on_directives,
            self._on_fenced,
            on_reported=self._reported,
            running=self.running,
        ).start()

    def _on_fenced(self, reason: str) -> None:
        self._fence(reason, self.client.epoch)

    def _fence(self, reason: str, epoch: int) -> None:
        """Worker epoch ``epoch`` is fenced: linger (module doc) on a thread of its own, or
        end EXIT_FENCED without a linger. A fencing of an epoch already left (a report
        refused after the agent registered again) or while lingering changes nothing."""
        with self._fence_lock:
            if self._linger_thread is not None or epoch != self.client.epoch or self._done.is_set():
                return
            if self.config.holder_linger_s <= 0:
                self._finish(EXIT_FENCED, reason)
                return
            self._linger_thread = threading.Thread(
                target=self._linger, args=(reason,), name="lumen-agent-linger", daemon=True
            )
            self._linger_thread.start()

    def _linger(self, reason: str) -> None:
        """Stop serving the fenced epoch, keep the holder and the server up, and register
        again every heartbeat period until ``holder_linger_s`` has passed: registered, the
        agent serves as the new epoch; else it ends EXIT_FENCED."""
        deadline_s = time.monotonic() + self.config.holder_linger_s
        logger.warning("lumen agent: fenced (%s): the holder stays up for %g s, registering again",
                       reason, self.config.holder_linger_s)  # fmt: skip
        self._abandon(reason)
        period_s = max(0.05, self.client.heartbeat_s)
        while not self._done.is_set():
            try:
                self._register()
            except GatewayError:  # unreachable, or refused: again until the linger ends
                if time.monotonic() + period_s >= deadline_s or self._done.wait(period_s):
                    break
                continue
            self.counters.relinked += 1
            with self._fence_lock:
                self._linger_thread = None
            return
        self._finish(EXIT_FENCED, reason)

    def _abandon(self, reason: str) -> None:
        """Stop serving the fenced epoch: no token report goes out, heartbeats stop, the
        connector is told to keep its requests' checkpoints (first: an abort it has not
        been told of releases them on their holders), every relay is closed, and reports
        still queued are dropped. The holder serves on."""
        self.client.fence(reason)
        if self.heartbeats is not None:
            self.heartbeats.stop()
        try:
            control.ask(self.config.socket_path, "abandon")
        except (control.ControlError, OSError) as exc:
            logger.warning("lumen agent: the connector was not told to keep its checkpoints (%s): "
                           "the requests it aborts now release theirs", exc)  # fmt: skip
        self.counters.abandoned += asyncio.run_coroutine_threadsafe(self._cancel_all(), self._loop).result()
        while True:
            try:
                item = self._reports.get_nowait()
            except queue.Empty:
                break
            if item is None:  # closing: the reporter's end stays queued
                self._reports.put(None)
                break

    # ---- requests (on the upstream loop) -------------------------------------------------
    def _serve(self, directive: Run | Resume, received_s: float) -> None:
        self._cancel(directive.request_id)
        outputs = list(directive.output_token_ids) if isinstance(directive, Resume) else []
        self._relayed[directive.request_id] = _Relayed(
            directive.epoch, directive.prompt_token_ids, directive.max_new_tokens, outputs
        )
        task = self._loop.create_task(self._relay(directive, received_s))
        self._tasks[directive.request_id] = (directive.epoch, task)

    async def _cancel_all(self) -> int:
        """Close every relay (fenced or drained: the gateway moves them all); how many."""
        request_ids = list(self._tasks)
        for request_id in request_ids:
            self._cancel(request_id)
        return len(request_ids)

    def _cancel(self, request_id: int, epoch: int | None = None) -> None:
        """Close the request's stream (vLLM aborts it); with ``epoch``, only if it serves that
        epoch (a refused report of an older one does not end a newer stream)."""
        entry = self._tasks.get(request_id)
        if entry is not None and epoch in (None, entry[0]):
            del self._tasks[request_id]
            self._relayed.pop(request_id, None)
            entry[1].cancel()
            self.counters.cancelled += 1

    async def _relay(self, directive: Run | Resume, received_s: float) -> None:
        request_id, epoch = directive.request_id, directive.epoch
        relayed = self._relayed[request_id]
        self.counters.served += 1
        try:
            body, position = completion_body(directive, self.config.model)
        except ValueError:  # nothing left to generate: it ends where it is
            sent = len(directive.output_token_ids) if isinstance(directive, Resume) else 0
            self._reports.put(RequestTokens(request_id, epoch, sent, (), True))
            self._forget(request_id, epoch)
            return
        restoring = "restore" in body["kv_transfer_params"]["lumen"]
        if isinstance(directive, Resume):
            self.counters.resumed += 1
            self.counters.restoring += restoring
        timed = not isinstance(directive, Resume)  # a RESUME's first token is timed
        assert self._http is not None
        try:
            async for piece in stream_tokens(self._http, f"{self.server_url}/v1/completions", body, position):
                if not timed and piece.token_ids:
                    timed = True
                    self._resumes.append(ResumeTiming(request_id, epoch, piece.start_position, restoring,
                                                      received_s, time.monotonic()))  # fmt: skip
                self.counters.tokens += len(piece.token_ids)
                self._reports.put(RequestTokens(request_id, epoch, piece.start_position, piece.token_ids,
                                                piece.finished))  # fmt: skip
                relayed.outputs.extend(piece.token_ids)
                position = piece.start_position + len(piece.token_ids)
        except (UpstreamError, aiohttp.ClientError) as exc:
            self.counters.upstream_errors += 1
            self.counters.errors.append(f"{request_id}: {exc}"[:300])
            logger.warning("lumen agent: request %d: %s", request_id, exc)
            if isinstance(exc, UpstreamError) and exc.status is not None:
                # The server answered with an error. A 4xx: it will not serve the request (a
                # prompt past its max_model_len, say), which ends at its client with the
                # server's message. Any other (a 5xx, vLLM's mid-stream internal error): it
                # failed the request while alive, so the gateway moves it to another worker
                # (nothing else would: the supervisor sees a live server). A server that died
                # or broke the connection (aiohttp errors, a stream cut off) is left to the
                # supervisor: its exit report fails this worker and the gateway resumes the
                # request on another, from the tokens its client has.
                if exc.refused:
                    self.counters.upstream_refused += 1
                else:
                    self.counters.upstream_failed += 1
                self._reports.put(
                    RequestTokens(request_id, epoch, position, (), error=str(exc), failed=exc.failed)
                )
        finally:
            self._forget(request_id, epoch)

    def _forget(self, request_id: int, epoch: int) -> None:
        """A relay ended: forget it unless a newer one of the request took its place."""
        if self._tasks.get(request_id, (None,))[0] == epoch:
            del self._tasks[request_id]
            self._relayed.pop(request_id, None)

    def _run_loop(self) -> None:
        asyncio.set_event_loop(self._loop)
        self._http = self._loop.run_until_complete(open_session())
        try:
            self._loop.run_forever()
        finally:  # stopped by close(): end the relays still out, then the loop's resources
            pending = asyncio.all_tasks(self._loop)
            for task in pending:
                task.cancel()
            self._loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
            self._loop.run_until_complete(self._http.close())
            self._loop.close()

    def _report_loop(self) -> None:
        """Token reports in arrival order, batched: whatever queued while a call was out
        goes in the next one. A batch the gateway did not get (unreachable, or restarting: the
        restarted gateway adopts each relay with the outputs it had at the registration, and
        the next report must not leave a gap after them) goes again first, every
        _REPORT_RETRY_S until it does or the lease is lost."""
        unsent: list[RequestTokens] = []
        while True:
            retry = False
            try:
                first = self._reports.get(timeout=_REPORT_RETRY_S if unsent else None)
            except queue.Empty:  # nothing new: send again what did not go out
                first, retry = None, True
            if first is None and not retry:
                return
            batch = unsent + ([] if first is None else [first])
            while True:
                try:
                    item = self._reports.get_nowait()
                except queue.Empty:
                    break
                if item is None:
                    self._reports.put(None)
                    break
                batch.append(item)
            epoch = self.client.epoch
            try:
                acks = self.client.report_tokens_batch(batch)
                self.counters.token_reports += 1
            except (FencedError, StaleEpochError) as exc:
                unsent = []
                self._fence(str(exc), epoch)
                continue
            except GatewayError as exc:  # unreachable: again until it goes or the lease decides
                logger.warning("lumen agent: token report failed: %s", exc)
                unsent = batch[-_MAX_UNSENT_REPORTS:]
                continue
            unsent = []
            for ack, sent in zip(acks, batch):
                if ack.code != 0:  # moved on (a newer epoch elsewhere): stop serving it here
                    self._loop.call_soon_threadsafe(self._cancel, ack.request_id, sent.epoch)

    # ---- lifecycle -----------------------------------------------------------------------
    def start(self) -> Agent:
        """Start (or attach to) the server, wait until it is healthy, register, heartbeat.
        Raises RuntimeError when the server does not come up, GatewayError when the gateway
        refuses the registration."""
        if self.server_url is None:
            self._start_server()
        self._wait_healthy()
        for target, name in ((self._run_loop, "loop"), (self._report_loop, "reports")):
            thread = threading.Thread(target=target, name=f"lumen-agent-{name}", daemon=True)
            thread.start()
            self._threads.append(thread)
        self._register()
        supervisor = threading.Thread(target=self._supervise, name="lumen-agent-supervisor", daemon=True)
        supervisor.start()
        return self

    def connector_stats(self, timeout_s: float = 2.0) -> dict[str, Any]:
        """The connector's ``stats`` over the control channel (ControlError, OSError)."""
        return control.ask(self.config.socket_path, "stats", timeout_s=timeout_s)

    def stats(self) -> dict[str, Any]:
        c = self.counters
        return {
            "worker_id": self.config.worker_id,
            "served": c.served,
            "resumed": c.resumed,
            "restoring": c.restoring,
            "cancelled": c.cancelled,
            "tokens": c.tokens,
            "token_reports": c.token_reports,
            "upstream_errors": c.upstream_errors,
            "upstream_refused": c.upstream_refused,
            "upstream_failed": c.upstream_failed,
            "streams_ignored": c.streams_ignored,
            "renewed": c.renewed,
            "renews_ignored": c.renews_ignored,
            "abandoned": c.abandoned,
            "drained": c.drained,
            "relinked": c.relinked,
            # Connections to this node's holder that proved a worker identity (other servers').
            "identified_connections": self.holder.stats()["identified"],
            "errors": list(c.errors),
            "resumes": [asdict(t) for t in list(self._resumes)],
            "server_exited_s": self._server_exited_s,
        }

    def wait(self, timeout_s: float | None = None) -> int | None:
        """The exit status once the agent is done (None if not within ``timeout_s``)."""
        return self._status if self._done.wait(timeout_s) else None

    @property
    def reason(self) -> str:
        return self._reason

    def stop(self) -> None:
        self._finish(EXIT_OK, "stopped")

    def close(self) -> None:
        """End the server it started, tell the gateway it is gone, stop every thread."""
        self._finish(EXIT_OK, "stopped")
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=15)
        with self._fence_lock:
            linger = self._linger_thread
        if linger is not None:  # done: it registers no more (a call out at most)
            linger.join()
        if self._status != EXIT_FENCED:
            self._report_exit(self._reason or "the agent stopped")
        if self.heartbeats is not None:
            self.heartbeats.stop()
        self._reports.put(None)
        if self._loop.is_running():
            self._loop.call_soon_threadsafe(self._loop.stop)
        for thread in self._threads:
            thread.join(timeout=5.0)
        if not self._loop.is_running() and not self._loop.is_closed():  # its thread never ran
            self._loop.close()
        self._http_sync.close()
        self.holder.close()
        self.client.close()


# The started server's first program: it asks for SIGKILL when the agent's thread that
# started it dies (PR_SET_PDEATHSIG = 1), leaves if the agent is already gone, then becomes
# the server (same process). Set there, not in a preexec_fn: a preexec_fn makes subprocess
# fork instead of vfork, a fork runs gRPC's fork handlers, and the poller thread they start
# in the child crashes it (SIGSEGV) before its exec now and then (grpc/grpc#43055; 3 to 5
# of 40 starts from a process with a gRPC channel, here).
_EXEC_DYING_WITH_PARENT = """\
import ctypes, os, signal, sys
ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)
if os.getppid() != int(sys.argv[1]):
    sys.exit("lumen agent: the agent that started this server is gone")
os.execv(sys.argv[2], sys.argv[2:])
"""


def start_dying_with_parent(
    argv: list[str], *, env: dict[str, str] | None = None, stdout: Any = None
) -> subprocess.Popen[bytes]:
    """Start ``argv`` (``argv[0]`` a path) in a session and process group of its own (the
    agent ends the server's whole tree; a test can kill it) that is SIGKILLed when its
    parent dies: no server runs unsupervised. The parent is the calling thread (call it from
    one that lives as long as the agent: ``lumen agent`` starts from its main thread).
    ``stdout`` takes stderr too. Raises OSError when it cannot start."""
    return subprocess.Popen(
        [sys.executable, "-c", _EXEC_DYING_WITH_PARENT, str(os.getpid()), *argv],
        env=env,
        stdout=stdout,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
