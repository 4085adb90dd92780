"""A worker process of a live cluster (docs/streaming.md, docs/policies.md).

``Worker`` = the reference engine + a ``StreamingConnector`` (checkpoint streaming to the
holders the gateway grants each request, restore on RESUME) + an embedded ``HolderStore``
served on the transport (this worker holds other workers' checkpoints; HOLD reserves room in
it) + a ``GatewayClient`` with its ``HeartbeatLoop`` (registration, lease, directives,
fencing).

Threads: the heartbeat thread only queues directives; the main thread (``run``) applies
them between engine steps, steps the engine and reports each step's tokens in one call. A
worker whose lease is lost (fenced reply, gateway unreachable for a lease, a token report
refused for its epoch) stops serving: its requests are dropped without releasing their
checkpoints (the gateway moves them), and for ``holder_linger_s`` it keeps its holder up and
tries to register again every heartbeat period, reporting the checkpoints it holds, so that
the healed gateway restores from them (issue 23). Registered again, it serves as the new
epoch; past the linger ``run`` returns ``EXIT_FENCED``.

A worker started as ``recovering`` (restarted after a failure) loads the draft's weights
in the foreground and the full model at the same time in the background, then tells the
gateway ``ModelLoaded`` and serves. ``modelled_*_load_s`` are the load times of a 32B model
and its draft from NVMe (modelled, not measured): each model is ready that long after the
loads began, or when its real load ends if later. Unpaced they begin at ``start``; paced,
at the process's own start (``process_start_s``): the emulated restart's process start is
part of the modelled engine start, as the simulator counts both loads from detection.

Paced (``WorkerConfig.pace``, issue 21): ``_step`` holds each engine step and its token
reports to the modelled duration of what it ran (``lumen_core.pacing``), and checkpoint
streaming goes through ``PacedStreamingConnector`` (no faster than the modelled link); those
two hooks are the only pacing code here.
"""

from __future__ import annotations

import math
import os
import queue
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

from lumen_core.auth import WorkerIdentity
from lumen_core.connector import RestoreSource, StreamGrant
from lumen_core.connector import model_fingerprint as file_fingerprint
from lumen_core.engine import (
    CacheConfig,
    Engine,
    SamplingParams,
    SchedulerConfig,
    load_model,
    model_fingerprint,
)
from lumen_core.engine.connector import SavedTokens
from lumen_core.engine.model import Llama
from lumen_core.gateway.client import FencedError, GatewayClient, RequestTokens
from lumen_core.gateway.directives import (
    AssistDraft,
    AssistStop,
    AssistVerify,
    Cancel,
    Directive,
    Flush,
    Hold,
    HolderGrant,
    Release,
    Renew,
    Resume,
    Run,
    Stop,
    Stream,
)
from lumen_core.gateway.errors import GatewayError, StaleEpochError
from lumen_core.gateway.heartbeat import HeartbeatLoop
from lumen_core.gateway.protocol import parse_address
from lumen_core.gateway.reports import LostReplica, RunningReport, StreamedReplica, WorkerReport
from lumen_core.integrations.reference import StreamingConnector
from lumen_core.pacing import PacedSaves, Pacer, modelled_step_s, parse_pace
from lumen_core.policy.events import RecoveryAction, WorkerState
from lumen_core.stream import HolderStore, RestoreResult
from lumen_core.worker import MODELLED_DRAFT_LOAD_S, MODELLED_FULL_LOAD_S
from lumen_core.worker.assist import Assistant, AssistedRequests
from lumen_core.worker.engine_ids import engine_key, request_id_of
from lumen_core.worker.exit_watch import stat_fields
from lumen_core.worker.exits import EXIT_FENCED, EXIT_OK
from lumen_core.worker.held import held_reports
from lumen_core.worker.paced_streaming import PacedStreamingConnector

# Token reports kept while the gateway cannot be reached (one per step: well over a lease's
# worth at the reference engine's step rates); older ones are dropped past it.
MAX_UNSENT_REPORTS = 4096
# A starting worker tries a gateway it cannot reach (not started yet, or its first connect
# timed out on a loaded machine) again for this long; a refusal ends the start at once.
START_REGISTER_S = 30.0
_UNREACHABLE = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)


def process_start_s() -> float:
    """When this process started, on the ``time.monotonic()`` clock: its start time in
    ``/proc/self/stat`` (clock ticks since boot, field 22) against ``CLOCK_BOOTTIME``; now
    where there is no ``/proc``."""
    now_s = time.monotonic()
    try:
        with open("/proc/self/stat", "rb") as stat:
            ticks = int(stat_fields(stat.read())[22 - 3])
    except OSError:
        return now_s
    age_s = time.clock_gettime(time.CLOCK_BOOTTIME) - ticks / os.sysconf("SC_CLK_TCK")
    return now_s - max(0.0, age_s)


@dataclass(frozen=True)
class WorkerConfig:
    """worker_id: the cluster's id of this worker. gateway: ``host:port``. model_path: a file
    written by ``engine.save_model`` or a transformers Llama directory (``config.json`` and
    safetensors: its fingerprint is then ``connector.model_fingerprint``'s, as vLLM's is).
    draft_path: a file written by ``engine.save_model``. state: "serving", or "recovering"
    for a restart after a failure. budget_bytes: host memory offered to other workers'
    checkpoints, reserve_bytes how much of it is mapped at start (``HolderStore``).
    holder_host: where the embedded holder listens. pace: a cost-model setup
    ("MODEL/GPUxTP", ``pacing.parse_pace``) every engine step and restore is paced to, each
    lasting ``time_scale`` times its modelled duration (None: unpaced). pushed_directives:
    open the gateway's directive stream (False: heartbeat replies alone deliver them).
    ack_timeout_s, give_up_after_s: the checkpoint streamer's (``CheckpointStreamer``); a
    replica lost for good is reported to the gateway, which places it again.
    holder_linger_s: how long a fenced worker keeps its holder up, registering again (0:
    it exits at once). encrypt_payloads: its connections to holders carry their records in
    AES-256-GCM (the holder follows each connection's choice)."""

    worker_id: int
    gateway: str
    model_path: str
    draft_path: str | None = None
    state: str = WorkerState.SERVING
    budget_bytes: int = 1 << 30
    reserve_bytes: int = 0
    holder_host: str = "127.0.0.1"
    pushed_directives: bool = True
    num_blocks: int = 1024
    block_size: int = 16
    max_num_seqs: int = 64
    modelled_full_load_s: float = MODELLED_FULL_LOAD_S
    modelled_draft_load_s: float = MODELLED_DRAFT_LOAD_S
    idle_wait_s: float = 0.02
    pace: str | None = None  # "MODEL/GPUxTP": engine steps paced to that setup (lumen_core.pacing)
    time_scale: float = 1.0  # paced durations stretched by this factor
    ack_timeout_s: float = 2.0  # the streamer's: a holder silent this long has failed
    give_up_after_s: float = 30.0  # the streamer's: a holder failing this long lost its replicas
    holder_linger_s: float = 60.0  # fenced: the holder stays up this long, registering again
    encrypt_payloads: bool = False  # records to and from holders in AES-256-GCM

    def __post_init__(self) -> None:
        if isinstance(self.worker_id, bool) or not isinstance(self.worker_id, int) or self.worker_id < 0:
            raise ValueError(f"worker_id must be an int >= 0, got {self.worker_id!r}")
        if self.state not in (WorkerState.SERVING, WorkerState.RECOVERING):
            raise ValueError(f"state must be 'serving' or 'recovering', got {self.state!r}")
        model = Path(self.model_path)
        if not (model.is_file() or (model / "config.json").is_file()):
            raise ValueError(
                "model_path must be a file written by save_model or a transformers Llama directory, "
                f"got {self.model_path!r}"
            )
        if self.draft_path is not None and not Path(self.draft_path).is_file():
            raise ValueError(f"draft_path must be a file written by save_model, got {self.draft_path!r}")
        for name in ("modelled_full_load_s", "modelled_draft_load_s"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or not value >= 0 or math.isinf(value):
                raise ValueError(f"{name} must be a finite number >= 0, got {value!r}")
        if not isinstance(self.holder_linger_s, (int, float)) or not 0 <= self.holder_linger_s < math.inf:
            raise ValueError(f"holder_linger_s must be a finite number >= 0, got {self.holder_linger_s!r}")
        if not isinstance(self.budget_bytes, int) or self.budget_bytes < 0:
            raise ValueError(f"budget_bytes must be an int >= 0, got {self.budget_bytes!r}")
        if not isinstance(self.reserve_bytes, int) or not 0 <= self.reserve_bytes <= self.budget_bytes:
            raise ValueError(f"reserve_bytes must be an int in [0, budget_bytes], got {self.reserve_bytes!r}")
        for name in ("time_scale", "ack_timeout_s", "give_up_after_s"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf:
                raise ValueError(f"{name} must be a finite number > 0, got {value!r}")
        if self.pace is not None:
            parse_pace(self.pace)  # raises ValueError naming the presets


@dataclass
class _Served:
    """A request this worker serves: the gateway's epoch and how many outputs it has."""

    epoch: int
    num_outputs: int


class Worker:
    """One worker process's state (see module doc). ``run`` serves until ``stop`` or fencing."""

    def __init__(self, config: WorkerConfig, secret: bytes) -> None:
        self.config = config
        self.secret = secret
        self.store = HolderStore(config.budget_bytes, reserve_bytes=config.reserve_bytes)
        # Capabilities name this holder by the worker's id; the gateway's issuer key arrives
        # with each registration (until then every capability is refused).
        self.server = self.store.serve(secret, address=config.holder_host, port=0, holder_id=config.worker_id)
        self.holder_address = f"{config.holder_host}:{self.server.port}"
        # Drawn once per process; each registration brings its credential, which this
        # worker's connections to holders prove (capabilities for its requests name it).
        self.identity = WorkerIdentity()
        self.client = GatewayClient(
            config.gateway, secret, on_issuer_key=self.server.trust_issuer, identity=self.identity
        )
        self.engine: Engine | None = None
        self.connector: StreamingConnector | None = None
        self.model: Llama | None = None
        self.draft: Llama | None = None
        self.state = config.state
        self.served: dict[int, _Served] = {}
        self.directives: queue.Queue[Directive] = queue.Queue()
        self.fenced = threading.Event()
        self.stopping = threading.Event()
        self.fence_reason = ""
        self.heartbeats: HeartbeatLoop | None = None
        self.loaded = threading.Event()
        self.load_error: BaseException | None = None
        self.counters = {"resumed": 0, "cancelled": 0, "renewed": 0, "renews_ignored": 0, "relinked": 0}
        self.flushed = threading.Event()  # drained (FLUSH): no more steps; reported in heartbeats
        self.drained = False  # told to STOP: its exit is reported (the gateway retires it at once)
        self._resumed_tokens: dict[str, int] = {}  # context (prompt + outputs) of each resume here
        self.remote_sources: set[str] = set()  # requests resumed from another worker's holder
        self.assistant: Assistant | None = None  # drafting for a survivor (while recovering)
        self.assisted: AssistedRequests | None = None  # verifying an assistant's drafts
        self.assist_counts = {"steps": 0, "proposed": 0, "accepted": 0}
        # HOLDs refused and checkpoints evicted that the gateway has not been told of yet
        # (found on the main thread, reported from the heartbeat thread until acknowledged).
        self._dropped_lock = threading.Lock()
        self._refused: set[int] = set()
        self._evicted: set[int] = set()
        # The worker id of every holder address a grant named: the streamer knows holders by
        # address, the gateway by worker id (lost replicas are reported by id).
        self._holder_ids: dict[tuple[str, int], int] = {}
        # Paced steps (issue 21): None unless --pace; restores already paced, by identity.
        self.pacer = None if config.pace is None else Pacer(parse_pace(config.pace), config.time_scale)
        self._paced_restores: dict[str, RestoreResult] = {}
        self._unsent: list[RequestTokens] = []  # reports a call did not deliver (``_report``)
        self._pace_continues = False  # the last paced step left work: the next one follows it

    # ---- models --------------------------------------------------------------------------
    def _load_full(self, ready_at_s: float | None = None) -> None:
        """Loads the full model; ``ready_at_s`` (``time.monotonic()``): not ready before."""
        try:
            model = load_model(self.config.model_path)
            remaining_s = 0.0 if ready_at_s is None else ready_at_s - time.monotonic()
            if remaining_s > 0 and self.stopping.wait(remaining_s):
                return
            self.model = model
            self.loaded.set()
        except BaseException as exc:  # noqa: BLE001 - reported by run()
            self.load_error = exc
            self.loaded.set()

    def _build_engine(self) -> None:
        assert self.model is not None
        options: dict[str, Any] = {
            "store": self.store,
            "identity": self.identity,
            "encrypt": self.config.encrypt_payloads,
            "key_for": request_id_of,
            # The gateway releases a finished request's checkpoints once its last report
            # arrives: a worker cut off from it keeps them for the failover that moves it.
            "release_finished": False,
            "streamer_options": {
                "ack_timeout_s": self.config.ack_timeout_s,
                "give_up_after_s": self.config.give_up_after_s,
            },
        }
        if Path(self.config.model_path).is_dir():  # named from its files, as vLLM names them
            fingerprint = file_fingerprint(self.config.model_path, dtype=str(self.model.dtype))
        else:
            fingerprint = model_fingerprint(self.model)
        if self.pacer is None:
            self.connector = StreamingConnector(self.secret, fingerprint, **options)
        else:  # checkpoint streaming paced like the steps (issue 21)
            paced = PacedSaves(self.pacer.cost, self.config.time_scale)
            self.connector = PacedStreamingConnector(paced, self.secret, fingerprint, **options)
        self.engine = Engine(
            self.model,
            CacheConfig(num_blocks=self.config.num_blocks, block_size=self.config.block_size),
            SchedulerConfig(max_num_seqs=self.config.max_num_seqs),
            connector=self.connector,
        )

    # ---- gateway -------------------------------------------------------------------------
    def report(self) -> WorkerReport:
        """This heartbeat's report (refusals and evictions until the gateway has had them;
        the streamer's lost replicas until a STREAM directive re-places them, which the
        gateway acts on once)."""
        checkpoints = self.store.checkpoints()
        held = held_reports(checkpoints)
        held_bytes = sum(c.durable_tokens * (c.record_bytes + 8) for c in checkpoints)
        with self._dropped_lock:
            refused, evicted = tuple(sorted(self._refused)), tuple(sorted(self._evicted))
        engine = self.engine
        running = len(engine.scheduler.running) if engine is not None else 0
        waiting = len(engine.scheduler.waiting) if engine is not None else 0
        counts = self._assist_counts()
        streamer = self.connector.streamer if self.connector is not None else None
        lost = () if streamer is None else streamer.stats().lost
        return WorkerReport(
            num_running=running,
            num_waiting=waiting,
            held_bytes=held_bytes,
            held=held,
            refused_request_ids=refused,
            evicted_request_ids=evicted,
            assist_steps=counts["steps"],
            proposed_draft_tokens=counts["proposed"],
            accepted_draft_tokens=counts["accepted"],
            lost_replicas=tuple(
                LostReplica(request_id, self._holder_ids[holder])
                for request_id, holder in lost
                if holder in self._holder_ids
            ),
            flushed=self.flushed.is_set(),
            streamed=self._streamed() if self.flushed.is_set() and streamer is not None else (),
        )

    def running(self) -> tuple[RunningReport, ...]:
        """What this worker serves, for a restarted gateway to adopt: each request's gateway
        epoch, prompt and every output computed so far (at least what was reported: a report
        the old gateway missed is then in the new one's stream). Read on the heartbeat
        thread: snapshots of the engine's lists (a request that ends meanwhile is left out)."""
        engine = self.engine
        if engine is None:
            return ()
        out = []
        for request_id, served in list(self.served.items()):
            request = engine.requests.get(engine_key(request_id))
            if request is None:
                continue
            tokens = tuple(request.token_ids)
            prompt, outputs = tokens[: request.num_prompt_tokens], tokens[request.num_prompt_tokens :]
            out.append(RunningReport(request_id, served.epoch, prompt, outputs, request.params.max_tokens, 0))
        return tuple(out)

    def _streamed(self) -> tuple[StreamedReplica, ...]:
        """Durable tokens of each replica of each request served here (a flushed worker's
        report: the gateway moves its requests knowing their checkpoints)."""
        assert self.connector is not None and self.connector.streamer is not None
        replicas = self.connector.streamer.stats().replicas
        out = []
        for request_id, served in self.served.items():
            for replica in replicas.get(request_id, ()):
                holder_id = self._holder_ids.get(replica.holder)
                if holder_id is not None and replica.live:
                    out.append(StreamedReplica(request_id, served.epoch, holder_id, replica.durable_tokens))
        return tuple(out)

    def _reported(self, report: WorkerReport) -> None:
        """The gateway received ``report``: its refusals and evictions are not sent again."""
        with self._dropped_lock:
            self._refused.difference_update(report.refused_request_ids)
            self._evicted.difference_update(report.evicted_request_ids)

    def _assist_counts(self) -> dict[str, int]:
        assistant = self.assistant
        if assistant is None:
            return dict(self.assist_counts)
        return {
            "steps": self.assist_counts["steps"] + assistant.steps,
            "proposed": self.assist_counts["proposed"] + assistant.proposed,
            "accepted": self.assist_counts["accepted"] + assistant.accepted,
        }

    def _stop_assistant(self) -> None:
        if self.assistant is not None:
            self.assist_counts = self._assist_counts()
            self.assistant.stop()
            self.assistant = None

    def _on_fenced(self, reason: str) -> None:
        self.fence_reason = reason
        self.fenced.set()

    def start(self) -> None:
        """Load (the draft first when recovering), register (an unreachable gateway again for
        START_REGISTER_S), start heartbeating."""
        if self.state == WorkerState.RECOVERING:
            loads_from_s = process_start_s() if self.pacer is not None else time.monotonic()
            threading.Thread(
                target=self._load_full, args=(loads_from_s + self.config.modelled_full_load_s,), daemon=True
            ).start()
            if self.config.draft_path is not None:
                self.draft = load_model(self.config.draft_path)
                time.sleep(max(0.0, loads_from_s + self.config.modelled_draft_load_s - time.monotonic()))
        else:
            self._load_full()
            if self.load_error is not None:
                raise self.load_error
            self._build_engine()
        deadline_s = time.monotonic() + START_REGISTER_S
        while True:
            try:
                self._register()
                return
            except GatewayError as exc:
                if exc.code not in _UNREACHABLE or time.monotonic() >= deadline_s or self.stopping.wait(0.5):
                    raise

    def _register(self) -> None:
        """Register (a new epoch, with the checkpoints held here) and start heartbeating."""
        self.client.register(
            self.config.worker_id,
            state=self.state,
            budget_bytes=self.config.budget_bytes,
            holder_address=self.holder_address,
            held=held_reports(self.store.checkpoints()),
            on_directives=self._queue_directives,
        )
        self.heartbeats = HeartbeatLoop(
            self.client,
            self.report,
            self._queue_directives,
            self._on_fenced,
            on_reported=self._reported,
            pushed=self.config.pushed_directives,
            running=self.running,
        ).start()

    def _queue_directives(self, directives: tuple[Directive, ...]) -> None:
        for directive in directives:
            self.directives.put(directive)

    # ---- directives ----------------------------------------------------------------------
    def _apply(self, directive: Directive) -> None:
        if isinstance(directive, (AssistDraft, AssistVerify, AssistStop)):
            print(f"worker {self.config.worker_id}: {directive}", file=sys.stderr, flush=True)
        match directive:
            case Release():
                self.store.expire(directive.request_id)
            case Hold():
                self._reserve(directive)
            case Cancel():
                self._drop(directive.request_id)
                self.counters["cancelled"] += 1
            case Run() | Resume():
                self._admit(directive)
            case Stream():
                self._stream(directive)
            case Renew():
                self._renew(directive)
            case Flush():
                self._flush()
            case Stop():
                self.drained = True
                self.stopping.set()
            case AssistDraft():
                self._stop_assistant()
                if self.draft is not None and self.state == WorkerState.RECOVERING:
                    default_k = directive.num_draft_tokens
                    heartbeats = self.heartbeats
                    self.assistant = Assistant(
                        self.draft,
                        self.config.holder_host,
                        self.server.port,
                        lambda: (
                            (heartbeats.last_num_draft_tokens if heartbeats is not None else 0) or default_k
                        ),
                        secret=self.secret,
                        num_blocks=self.config.num_blocks,
                    ).start()
            case AssistVerify():
                if self.assisted is not None:
                    self.assisted.close()
                self.assisted = AssistedRequests(
                    parse_address(directive.assistant_address), directive.assistant_id, secret=self.secret
                )
            case AssistStop():
                if self.assisted is not None and self.assisted.peer_worker_id == directive.peer_worker_id:
                    self.assisted.close()
                    self.assisted = None
                else:
                    self._stop_assistant()

    def _flush(self) -> None:
        """FLUSH (drained): step no more (``run`` stops stepping), wait (at most the
        streamer's ack timeout) until every computed token is durable on a live replica, and
        have the next heartbeat, sent now, say so with each replica's durable length; the
        gateway then moves each request with all but its last token durable. (Runs on the
        main thread, the one that steps: no step happens meanwhile; ``flushed`` is set once
        done, so no heartbeat says it early.)"""
        streamer = self.connector.streamer if self.connector is not None else None
        if streamer is not None and self.engine is not None:
            deadline_s = time.monotonic() + self.config.ack_timeout_s
            while streamer.flush(timeout_s=max(0.01, deadline_s - time.monotonic())):
                stale = {engine_key(r) for r in streamer.stats().stale}
                if not stale or time.monotonic() > deadline_s:
                    break
                # Steps the streamer dropped (queue full, replica still connecting) are caught
                # up only when a request is saved again: hand it each one's last token.
                tails = []
                for key in stale & set(self.engine.requests):
                    request = self.engine.requests[key]
                    n = request.num_computed_tokens
                    if n:
                        slot = self.engine.block_manager.slot_ids(request, n - 1, n)
                        tails.append(SavedTokens(key, n - 1, tuple(slot), (request.token_ids[n - 1],)))
                self.connector.resend_last(tails)
                time.sleep(0.01)
            if streamer.stats().stale:
                print(
                    f"worker {self.config.worker_id}: flush left requests stale", file=sys.stderr, flush=True
                )
        self.flushed.set()
        if self.heartbeats is not None:
            self.heartbeats.beat_now()

    def _reserve(self, directive: Hold) -> None:
        """HOLD (placement): charge ``reserved_bytes`` of the embedded store for each shard of
        the request, as tokens of this worker's record size (plus 8 bytes of token id and crc
        each), evicting by the store's policy if needed. A refused reservation keeps no copy
        and is reported in heartbeats until the gateway has it, as are the checkpoints evicted
        to make room;
        the gateway then places the copy elsewhere or keeps none. A worker whose full model is
        not loaded cannot size the records and refuses. (Appends at the directive's epoch open,
        or re-epoch, the checkpoint; a HOLD that only bumps the epoch reserves nothing.)"""
        if directive.reserved_bytes == 0:
            return
        request_id = directive.request_id
        evicted: set[int] = set()
        if self.connector is None:
            refused = True
        else:
            record_bytes = self.connector.layout.record_bytes
            num_tokens = -(-directive.reserved_bytes // (record_bytes + 8))
            shards = max(1, len(directive.grant.capabilities))
            before = {c.request_id for c in self.store.checkpoints()}
            refused = not all(
                self.store.reserve(request_id, num_tokens, record_bytes, shard=shard)
                for shard in range(shards)
            )
            if refused:
                self.store.expire(request_id)  # the shards reserved before the refusal
            evicted = before - {c.request_id for c in self.store.checkpoints()} - {request_id}
        with self._dropped_lock:
            if refused:
                self._refused.add(request_id)
            self._evicted |= evicted

    def _grant(self, epoch: int, holders: tuple[HolderGrant, ...]) -> StreamGrant:
        """The connector's grant of a RUN, RESUME or STREAM (shard 0's capability on each
        holder: a worker streams one shard); remembers each holder's worker id."""
        addresses = tuple(parse_address(h.address) for h in holders)
        for address, holder in zip(addresses, holders):
            self._holder_ids[address] = holder.worker_id
        return StreamGrant(epoch, addresses, tuple(h.capabilities[0] for h in holders))

    def _drop(self, request_id: int) -> None:
        self.served.pop(request_id, None)
        if self.engine is not None and engine_key(request_id) in self.engine.requests:
            self.engine.abort(engine_key(request_id))

    def _admit(self, directive: Run | Resume) -> None:
        assert self.engine is not None and self.connector is not None
        request_id = directive.request_id
        key = engine_key(request_id)
        self._drop(request_id)
        outputs = list(directive.output_token_ids) if isinstance(directive, Resume) else []
        self.served[request_id] = _Served(directive.epoch, len(outputs))
        if len(outputs) >= directive.max_new_tokens:
            self._report([RequestTokens(request_id, directive.epoch, len(outputs), (), True)])
            self.served.pop(request_id)
            return
        try:  # queued only: its grant and restore source are read when it is first scheduled
            self.engine.add_request(
                key,
                list(directive.prompt_token_ids),
                SamplingParams(
                    max_tokens=directive.max_new_tokens,
                    temperature=directive.sampling.temperature,
                    seed=directive.sampling.seed,
                ),
                output_token_ids=outputs,
            )
        except ValueError as exc:
            # The engine refuses it (a token id past its vocabulary, more tokens than its cache
            # holds): the request ends at its client with why, rather than crash this worker.
            self.served.pop(request_id)
            self._report([RequestTokens(request_id, directive.epoch, len(outputs), (), error=str(exc))])
            return
        self.connector.grant(key, self._grant(directive.epoch, directive.holders))
        if isinstance(directive, Resume):
            self.counters["resumed"] += 1
            self._resumed_tokens[key] = len(directive.prompt_token_ids) + len(outputs)
            if (
                directive.action in (RecoveryAction.RESTORE, RecoveryAction.REMOTE_RESTORE)
                and directive.source is not None
            ):
                local = directive.source.worker_id == self.config.worker_id
                source = RestoreSource(
                    directive.epoch,
                    None if local else parse_address(directive.source.address),
                    directive.source.capabilities[0] if directive.source.capabilities else b"",
                )
                self.connector.set_restore_source(key, source)
                if not local:
                    self.remote_sources.add(key)

    def _stream(self, directive: Stream) -> None:
        """The holders of a request served here changed (the directive names all of them):
        stream its whole checkpoint to them (the streamer starts the request again from
        position 0 over its computed tokens)."""
        assert self.engine is not None and self.connector is not None
        key = engine_key(directive.request_id)
        request = self.engine.requests.get(key)
        if request is None:
            return
        self.connector.request_finished(key)
        self.connector.grant(key, self._grant(directive.epoch, directive.holders))
        n = request.num_computed_tokens
        if n:
            slots = self.engine.block_manager.slot_ids(request, 0, n)
            self.connector.save_kv([SavedTokens(key, 0, tuple(slots), tuple(request.token_ids[:n]))])

    def _renew(self, directive: Renew) -> None:
        """RENEW: the request's replicas re-open with the fresh capabilities before their next
        append. One not served here at that epoch (finished, moved, or its holders changed by
        a STREAM since) is ignored and counted (``renews_ignored``): the gateway's view was older."""
        assert self.connector is not None
        served = self.served.get(directive.request_id)
        renewed = (
            served is not None
            and served.epoch == directive.epoch
            and self.connector.renew(
                engine_key(directive.request_id), self._grant(directive.epoch, directive.holders)
            )
        )
        self.counters["renewed" if renewed else "renews_ignored"] += 1

    # ---- serving -------------------------------------------------------------------------
    def _report(self, reports: list[RequestTokens]) -> None:
        """Send ``reports`` after those a call did not deliver (the gateway unreachable or
        restarting: a restarted gateway adopts each request with the outputs computed when
        the worker registered again, and its next report must not leave a gap after them).
        At most MAX_UNSENT_REPORTS are kept; the lease bounds how long."""
        batch = self._unsent + reports
        if not batch:
            return
        try:
            acks = self.client.report_tokens_batch(batch)
        except (FencedError, StaleEpochError) as exc:
            self._unsent = []
            self._on_fenced(str(exc))
            return
        except GatewayError:
            self._unsent = batch[-MAX_UNSENT_REPORTS:]  # again with the next report
            return
        self._unsent = []
        for report, ack in zip(batch, acks, strict=False):  # one ack per report, in order
            # Refused: the request moved on (re-routed at a newer epoch). Dropped here only if
            # served at the refused report's epoch: it may have come back at a newer one.
            served = self.served.get(ack.request_id)
            if ack.code != 0 and (served is None or served.epoch == report.epoch):
                self._drop(ack.request_id)

    def _step(self) -> None:
        """One engine step and its token reports. Paced (``--pace``): the tokens are reported
        when the step's modelled time has passed; back-to-back steps keep one timeline, so
        the reports and directives between them sit inside the paced time (the cost model's
        per-iteration overhead covers them), not on top of it."""
        assert self.engine is not None
        if self.pacer is not None:
            self.pacer.begin(after_previous=self._pace_continues)
        engine = self.engine
        assisted = self.assisted
        if assisted is not None:
            for request_id, (position, drafts) in assisted.drafts().items():
                request = engine.requests.get(engine_key(request_id))
                if request is None or request.num_uncomputed_tokens != 1:
                    continue
                # Drafts made for an earlier position still serve if their head came true.
                offset = request.num_tokens - position
                if 0 <= offset < len(drafts) and request.token_ids[position:] == drafts[:offset]:
                    engine.set_drafts(engine_key(request_id), drafts[offset:])
        out = engine.step()
        if assisted is not None:
            for key in out.finished:
                assisted.finished(request_id_of(key))
            assisted.sync(
                {
                    request_id_of(r.request_id): list(r.token_ids)
                    for r in engine.scheduler.running
                    if r.request_id not in out.finished
                },
                {request_id_of(k): (n, out.num_accepted.get(k, 0)) for k, n in out.num_draft_tokens.items()},
            )
        reports = []
        for key, tokens in out.new_token_ids.items():
            request_id = request_id_of(key)
            served = self.served.get(request_id)
            if served is None:
                continue
            reports.append(
                RequestTokens(
                    request_id, served.epoch, served.num_outputs, tuple(tokens), key in out.finished
                )
            )
            served.num_outputs += len(tokens)
        for key in out.finished:
            self.served.pop(request_id_of(key), None)
        if self.pacer is not None:  # the tokens are out when the modelled step ends
            self.pacer.end(modelled_step_s(self.pacer.cost, out, self._new_restores()))
            self._pace_continues = engine.has_unfinished()
        self._report(reports)

    def _new_restores(self) -> list[tuple[int, bool]]:
        """(tokens, remote) of the restores the last step loaded (each paced once)."""
        assert self.connector is not None
        new = []
        for key, result in self.connector.restores.items():
            if self._paced_restores.get(key) is not result and result.restored_tokens > 0:
                new.append((result.restored_tokens, key in self.remote_sources))
            self._paced_restores[key] = result
        return new

    def stats(self) -> dict[str, int]:
        """Counters: requests resumed here, of which restored (a prefix came from a holder; of
        those, remote_restored pulled it from another worker's holder) and re-prefilled; tokens
        restored, and tokens of resumed contexts computed again here (``reprefilled_tokens``:
        context at the resume minus what was restored); requests cancelled; RENEWs applied and
        ignored (for a request no longer served here); registrations after a fencing (relinked);
        connections to this worker's holder that proved a worker's identity and that encrypt
        their records."""
        restores = self.connector.restores if self.connector is not None else {}
        restored = sum(1 for r in restores.values() if r.restored_tokens > 0)
        counters = self.connector.core.counters if self.connector is not None else {}
        holder = self.server.stats()
        reprefilled_tokens = sum(
            context - (restores[key].restored_tokens if key in restores else 0)
            for key, context in self._resumed_tokens.items()
        )
        return {
            "worker_id": self.config.worker_id,
            "resumed": self.counters["resumed"],
            "restored": restored,
            "remote_restored": sum(
                1 for k, r in restores.items() if r.restored_tokens > 0 and k in self.remote_sources
            ),
            "reprefilled": self.counters["resumed"] - restored,
            "restored_tokens": sum(r.restored_tokens for r in restores.values()),
            # Restores that stopped early, by why (``RestoreStatus``): "restore_missing", ...
            **{k: v for k, v in counters.items() if k.startswith("restore_")},
            "reprefilled_tokens": reprefilled_tokens,
            "cancelled": self.counters["cancelled"],
            "renewed": self.counters["renewed"],
            "renews_ignored": self.counters["renews_ignored"],
            "relinked": self.counters["relinked"],
            "assist_steps": self._assist_counts()["steps"],
            "proposed_drafts": self._assist_counts()["proposed"],
            "accepted_drafts": self._assist_counts()["accepted"],
            "paced_steps": self.pacer.num_steps if self.pacer is not None else 0,
            "paced_overruns": self.pacer.num_overruns if self.pacer is not None else 0,
            "identified_connections": holder["identified"],
            "encrypted_connections": holder["encrypted"],
        }

    def run(self) -> int:
        """Serve until ``stop`` (EXIT_OK) or until the lease is lost and no registration
        succeeds within ``holder_linger_s`` (EXIT_FENCED)."""
        self._serve()
        while self.fenced.is_set() and not self.drained and self._linger():
            self._serve()
        if self.drained and not self.fenced.is_set():
            try:  # so that a restarted worker may register at once, not a lease later
                self.client.report_exit(self.config.worker_id, self.client.epoch, "drained")
            except GatewayError:
                pass  # its lease runs out instead, with the same outcome
        return EXIT_FENCED if self.fenced.is_set() else EXIT_OK

    def _linger(self) -> bool:
        """Fenced: drop what was served here (the gateway moves it; outputs from here would be
        stale) without releasing its checkpoints, keep the holder up and register again every
        heartbeat period until ``holder_linger_s`` has passed. True: registered again."""
        deadline_s = time.monotonic() + self.config.holder_linger_s
        if self.config.holder_linger_s <= 0:
            return False
        self._abandon()
        period_s = max(0.05, self.client.heartbeat_s)
        while not self.stopping.is_set():
            try:
                self._register()
            except GatewayError:  # unreachable, or refused: again until the linger ends
                if time.monotonic() + period_s >= deadline_s or self.stopping.wait(period_s):
                    return False
                continue
            self.fenced.clear()
            self.counters["relinked"] += 1
            return True
        return False

    def _abandon(self) -> None:
        """Stop serving the fenced epoch: heartbeats, assisting, queued directives and every
        request. The connector stops streaming without releasing (the holders' copies are the
        gateway's to restore from), so the aborts that follow release nothing."""
        if self.heartbeats is not None:
            self.heartbeats.stop()
        self._stop_assistant()
        if self.assisted is not None:
            self.assisted.close()
            self.assisted = None
        while not self.directives.empty():
            self.directives.get_nowait()
        # The fenced epoch's undelivered reports: the gateway refuses them now (it moved those
        # requests on), and one may come back here at a newer epoch, which a refusal would drop.
        self._unsent = []
        self.served.clear()
        if self.engine is not None:
            assert self.connector is not None
            self.connector.core.abandon()
            for request_id in list(self.engine.requests):
                self.engine.abort(request_id)

    def _serve(self) -> None:
        while not self.stopping.is_set() and not self.fenced.is_set():
            if self.engine is None and self.loaded.is_set():
                if self.load_error is not None:
                    raise self.load_error
                self._build_engine()
                self._stop_assistant()
                self.state = WorkerState.SERVING
                self.client.model_loaded(budget_bytes=self.config.budget_bytes)
            try:
                busy = self.engine is not None and self.engine.has_unfinished() and not self.flushed.is_set()
                directive = self.directives.get(timeout=0 if busy else self.config.idle_wait_s)
            except queue.Empty:
                directive = None
            while directive is not None:
                if self.engine is not None or isinstance(directive, (Release, Hold, AssistDraft, AssistStop)):
                    self._apply(directive)
                try:
                    directive = self.directives.get_nowait()
                except queue.Empty:
                    directive = None
            stepping = self.engine is not None and self.engine.has_unfinished() and not self.flushed.is_set()
            if stepping and self.client.lease_valid():
                self._step()
            elif self._unsent and self.client.lease_valid():
                self._report([])  # idle: what did not go out goes now

    def stop(self) -> None:
        self.stopping.set()

    def close(self) -> None:
        self.stopping.set()
        if self.heartbeats is not None:
            self.heartbeats.stop()
        self._stop_assistant()
        if self.assisted is not None:
            self.assisted.close()
        if self.connector is not None:
            self.connector.close()
        self.server.close()
        self.client.close()
