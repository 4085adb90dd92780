"""gRPC service over the Coordinator, a lease reaper thread and a Prometheus endpoint.

Every RPC takes one lock around the Coordinator, so the decision path stays single-threaded.
Calls are authenticated before any handler runs (``lumen_core.auth``, docs/security.md): a
call without a valid ``lumen-call-v3`` value for this gateway instance is refused with
UNAUTHENTICATED; one signed by the wrong principal for its method (a worker's call key on the
client API, the cluster secret on a worker's call) or naming another worker incarnation than
its call key's is refused with PERMISSION_DENIED. Every reply message of a verified call is
sealed under the key it was signed with (``auth.seal_reply``). Registration issues each worker incarnation
its call key. Listens on 127.0.0.1 unless told otherwise; port 0 picks a free port.
"""

from __future__ import annotations

import hashlib
import hmac
import threading
import time
from collections.abc import Callable, Iterator
from concurrent import futures
from typing import Any, TypeVar

import grpc
from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from lumen_core._validate import check_int
from lumen_core.auth import (
    CALL_METADATA_KEY,
    CLUSTER_PRINCIPAL,
    INSTANCE_METADATA_KEY,
    CallRefused,
    CallVerifier,
    CapabilityIssuer,
    CredentialTable,
    check_secret,
    new_instance_id,
    parse_worker_principal,
    seal_reply,
    worker_principal,
    wrap_call_key,
)
from lumen_core.eventlog import EventLog
from lumen_core.gateway import lumen_pb2 as pb
from lumen_core.gateway import lumen_pb2_grpc as pb_grpc
from lumen_core.gateway.config import GatewayConfig
from lumen_core.gateway.coordinator import Coordinator, NoWorkerError
from lumen_core.gateway.errors import GatewayError, StaleEpochError
from lumen_core.gateway.protocol import (
    CLUSTER_SIGNED,
    UNSIGNED,
    WORKER_SIGNED,
    check_model_loaded,
    check_registration,
    check_report,
    delivery_to_pb,
    held_from_pb,
    report_from_pb,
    running_from_pb,
    state_from_pb,
)
from lumen_core.policy.events import WorkerState

_Reply = TypeVar("_Reply")
_STREAM_POLL_S = 0.25  # a waiting token stream re-checks its client and the server this often
_ERROR_CODES = {
    StaleEpochError: grpc.StatusCode.FAILED_PRECONDITION,
    NoWorkerError: grpc.StatusCode.UNAVAILABLE,
    IndexError: grpc.StatusCode.NOT_FOUND,
    TypeError: grpc.StatusCode.INVALID_ARGUMENT,
    ValueError: grpc.StatusCode.INVALID_ARGUMENT,
}


def _code_of(exc: Exception) -> grpc.StatusCode:
    """The status a Coordinator error (one of _ERROR_CODES' types) is reported with."""
    return next(code for cls, code in _ERROR_CODES.items() if isinstance(exc, cls))


def _details_of(exc: Exception) -> str:
    """The message a Coordinator error is reported with (a GatewayError's without the status
    name, which the client puts back)."""
    return exc.details if isinstance(exc, GatewayError) else str(exc)


class _Forbidden(Exception):
    """An authentic call its principal may not make (PERMISSION_DENIED)."""


class _AuthInterceptor(grpc.ServerInterceptor):
    """Verifies each call's signature over the raw request bytes, then who signed it: the
    handler is wrapped to take the bytes, so the MAC covers exactly what was sent. It also
    serializes the replies itself, each sealed under the key the call was signed with
    (``auth.seal_reply``), so the caller checks exactly what was sent back."""

    def __init__(self, server: GatewayServer) -> None:
        self._server = server

    def intercept_service(self, continuation: Any, details: grpc.HandlerCallDetails) -> Any:
        handler = continuation(details)
        name = details.method.rpartition("/")[2]
        if handler is None or name in UNSIGNED:
            return handler
        value = dict(details.invocation_metadata or ()).get(CALL_METADATA_KEY)
        assert not isinstance(value, bytes)  # grpc gives bytes only for keys ending in "-bin"
        behavior = handler.unary_stream if handler.response_streaming else handler.unary_unary
        deserialize = handler.request_deserializer
        serialize = handler.response_serializer
        server = self._server

        def checked(body: bytes, context: grpc.ServicerContext) -> Any:
            keys: list[bytes | None] = []  # the key the call verified under seals its replies

            def key_of(principal: str) -> bytes | None:
                keys.append(server.key_of(principal))
                return keys[-1]

            try:
                principal = server.verifier.verify(details.method, value, body, key_of)
                request = deserialize(body)
                server.authorize(name, principal, request)
            except CallRefused as exc:
                if exc.stale_instance:
                    context.set_trailing_metadata(((INSTANCE_METADATA_KEY, server.instance_id),))
                context.abort(grpc.StatusCode.UNAUTHENTICATED, exc.reason)
            except _Forbidden as exc:
                context.abort(grpc.StatusCode.PERMISSION_DENIED, str(exc))
            except Exception as exc:  # noqa: BLE001 - authentic but not a message of this method
                context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"malformed request: {exc}")
            key = keys[-1]
            assert key is not None and value is not None  # verified
            if not handler.response_streaming:
                return seal_reply(key, value, 0, serialize(behavior(request, context)))
            return (
                seal_reply(key, value, index, serialize(reply))
                for index, reply in enumerate(behavior(request, context))
            )

        make = (
            grpc.unary_stream_rpc_method_handler
            if handler.response_streaming
            else grpc.unary_unary_rpc_method_handler
        )
        return make(checked)  # replies leave as the bytes ``checked`` sealed


class _Servicer(pb_grpc.GatewayServicer):
    def __init__(self, server: GatewayServer) -> None:
        self._server = server

    def _now(self) -> float:
        return self._server.now_s()

    def _run(self, context: grpc.ServicerContext, fn: Callable[[Coordinator], _Reply]) -> _Reply:
        """Call ``fn(coordinator)`` under the lock; map the Coordinator's errors to statuses."""
        server = self._server
        try:
            with server.condition:
                result = fn(server.coordinator)
                server.condition.notify_all()
                return result
        except (StaleEpochError, NoWorkerError, IndexError, TypeError, ValueError) as exc:
            context.abort(_code_of(exc), _details_of(exc))

    def Hello(self, request: pb.HelloRequest, context: grpc.ServicerContext) -> pb.HelloReply:
        return pb.HelloReply(instance_id=self._server.instance_id)

    def Register(self, request: pb.RegisterRequest, context: grpc.ServicerContext) -> pb.RegisterReply:
        def register(c: Coordinator) -> pb.RegisterReply:
            check_registration(request)
            if (
                request.worker_id in c.worker_ids()
                and c.worker_state(request.worker_id) != WorkerState.FAILED
            ):
                # The cluster secret admits a registration, not a take-over: its current
                # incarnation's lease must expire, or its exit be reported, first.
                context.abort(
                    grpc.StatusCode.ALREADY_EXISTS,
                    f"worker {request.worker_id} epoch {c.worker_epoch(request.worker_id)} is live: a new "
                    "incarnation registers once its lease expires or its exit is reported",
                )
            registration = c.register(
                self._now(),
                request.worker_id,
                state=state_from_pb(request.state),
                budget_bytes=request.budget_bytes,
                domain=request.domain,
                holder_address=request.holder_address,
                num_shards=request.num_shards or 1,
                last_epoch=request.last_epoch,
                running=[running_from_pb(r) for r in request.running],
                held=[held_from_pb(h) for h in request.held],
                identity_key=request.identity_public_key,
            )
            salt, wrapped, exchange_key = self._server.issue_call_key(
                request.worker_id, registration.epoch, request.exchange_public_key
            )
            return pb.RegisterReply(
                wrapped_call_key=wrapped,
                call_key_salt=salt,
                exchange_public_key=exchange_key,
                epoch=registration.epoch,
                lease_s=c.config.lease_s,
                heartbeat_s=c.config.heartbeat_s,
                directives=[delivery_to_pb(d) for d in c.directives_after(request.worker_id, 0)],
                issuer_public_key=c.issuer_public_key,
                credential=registration.credential,
            )

        return self._run(context, register)

    def Heartbeat(self, request: pb.HeartbeatRequest, context: grpc.ServicerContext) -> pb.HeartbeatReply:
        def heartbeat(c: Coordinator) -> pb.HeartbeatReply:
            check_report(request.report)
            lease, deliveries, k = c.heartbeat(
                self._now(),
                request.worker_id,
                request.epoch,
                report_from_pb(request.report),
                state=state_from_pb(request.state),
                acked_sequence=request.acked_sequence,
            )
            return pb.HeartbeatReply(
                fenced=lease.fenced,
                reregister=lease.reregister,
                reason=lease.reason,
                lease_s=c.config.lease_s,
                directives=[delivery_to_pb(d) for d in deliveries],
                num_draft_tokens=k,
            )

        return self._run(context, heartbeat)

    def ReportTokens(self, request: pb.TokenReport, context: grpc.ServicerContext) -> pb.TokenAcks:
        def report(c: Coordinator) -> pb.TokenAcks:
            now_s = self._now()
            try:
                c.check_worker_epoch(request.worker_id, request.worker_epoch)
            except StaleEpochError:
                self._server.num_refused_token_reports += len(request.requests)
                raise
            acks = []
            for entry in request.requests:
                try:
                    ack = c.report_tokens(
                        now_s,
                        request.worker_id,
                        request.worker_epoch,
                        entry.request_id,
                        entry.epoch,
                        entry.start_position,
                        list(entry.token_ids),
                        finished=entry.finished,
                        error=entry.error,
                        failed=entry.failed,
                    )
                except (StaleEpochError, IndexError, TypeError, ValueError) as exc:
                    if isinstance(exc, StaleEpochError):  # not this worker's at this epoch
                        self._server.num_refused_token_reports += 1
                    code = _code_of(exc).value[0]
                    acks.append(pb.TokenAck(request_id=entry.request_id, code=code, details=_details_of(exc)))
                    continue
                acks.append(
                    pb.TokenAck(
                        request_id=entry.request_id,
                        num_new=ack.num_new,
                        num_conflicts=ack.num_conflicts,
                        next_position=ack.next_position,
                    )
                )
            return pb.TokenAcks(acks=acks)

        return self._run(context, report)

    def ReportExit(self, request: pb.ExitReport, context: grpc.ServicerContext) -> pb.ExitReply:
        def report(c: Coordinator) -> pb.ExitReply:
            outcome = c.process_exited(self._now(), request.worker_id, request.epoch, request.reason)
            return pb.ExitReply(failed=outcome is not None)

        return self._run(context, report)

    def ModelLoaded(
        self, request: pb.ModelLoadedRequest, context: grpc.ServicerContext
    ) -> pb.ModelLoadedReply:
        def loaded(c: Coordinator) -> pb.ModelLoadedReply:
            check_model_loaded(request)
            freed = c.model_loaded(
                self._now(), request.worker_id, request.epoch, request.budget_bytes, request.domain
            )
            return pb.ModelLoadedReply(freed_survivor_id=-1 if freed is None else freed)

        return self._run(context, loaded)

    def Directives(
        self, request: pb.DirectivesRequest, context: grpc.ServicerContext
    ) -> Iterator[pb.Directive]:
        """The pushed delivery (see lumen.proto). One stream per worker: a newer one of the same
        worker ends the older (a worker that reconnects leaves no thread behind)."""
        server = self._server
        worker_id, epoch = request.worker_id, request.epoch
        if not server.push_directives:
            context.abort(grpc.StatusCode.UNIMPLEMENTED, "pushed directives are off: heartbeats carry them")
        with server.condition:
            if server.num_directive_streams >= server.max_workers:
                context.abort(
                    grpc.StatusCode.RESOURCE_EXHAUSTED,
                    f"{server.num_directive_streams} directive streams open (max_workers)",
                )
            server.num_directive_streams += 1
            generation = server.directive_streams.get(worker_id, 0) + 1
            server.directive_streams[worker_id] = generation
            server.condition.notify_all()  # an older stream of this worker ends
        try:
            yield from self._push(worker_id, epoch, request.after_sequence, generation, context)
        finally:
            with server.condition:
                server.num_directive_streams -= 1

    def _push(
        self, worker_id: int, epoch: int, sequence: int, generation: int, context: grpc.ServicerContext
    ) -> Iterator[pb.Directive]:
        server = self._server
        while True:
            with server.condition:
                while True:
                    try:  # not through _run: its notify_all would wake every other stream
                        server.coordinator.check_worker_epoch(worker_id, epoch)
                    except (StaleEpochError, TypeError, ValueError) as exc:
                        context.abort(_code_of(exc), _details_of(exc))
                    deliveries = server.coordinator.directives_after(worker_id, sequence)
                    if (
                        deliveries
                        or server.stopping
                        or not context.is_active()
                        or server.directive_streams[worker_id] != generation
                    ):
                        break
                    server.condition.wait(_STREAM_POLL_S)
            if server.stopping:
                context.abort(grpc.StatusCode.UNAVAILABLE, "gateway is stopping")
            if not context.is_active() or server.directive_streams[worker_id] != generation:
                return
            for delivery in deliveries:
                yield delivery_to_pb(delivery)
            sequence = deliveries[-1].sequence

    def _open_stream(self, context: grpc.ServicerContext) -> None:
        """Streams hold a server thread each: past ``max_streams`` they are refused, so the
        threads kept for registrations, heartbeats and reports are never starved."""
        server = self._server
        with server.condition:
            if server.num_streams >= server.max_streams:
                context.abort(
                    grpc.StatusCode.RESOURCE_EXHAUSTED,
                    f"{server.num_streams} token streams open (max_streams)",
                )
            server.num_streams += 1

    def _close_stream(self) -> None:
        with self._server.condition:
            self._server.num_streams -= 1

    def Submit(self, request: pb.SubmitRequest, context: grpc.ServicerContext) -> Iterator[pb.TokenChunk]:
        self._open_stream(context)
        try:
            yield from self._submit(request, context)
        finally:
            self._close_stream()

    def Watch(self, request: pb.WatchRequest, context: grpc.ServicerContext) -> Iterator[pb.TokenChunk]:
        self._open_stream(context)
        try:
            self._run(context, lambda c: c.tokens(request.request_id))
            yield from self._stream(request.request_id, request.from_position, context)
        finally:
            self._close_stream()

    def _submit(self, request: pb.SubmitRequest, context: grpc.ServicerContext) -> Iterator[pb.TokenChunk]:
        admission = self._run(
            context,
            lambda c: c.admit(
                self._now(),
                list(request.prompt_token_ids),
                request.max_new_tokens,
                expected_output_tokens=request.expected_output_tokens,
            ),
        )
        yield pb.TokenChunk(request_id=admission.request_id)  # the client learns its request id at once
        yield from self._stream(admission.request_id, 0, context)

    def _stream(
        self, request_id: int, position: int, context: grpc.ServicerContext
    ) -> Iterator[pb.TokenChunk]:
        server = self._server
        while True:
            with server.condition:
                tokens, finished, lost = server.coordinator.tokens(request_id, position)
                while not (tokens or finished or server.stopping or not context.is_active()):
                    server.condition.wait(_STREAM_POLL_S)
                    tokens, finished, lost = server.coordinator.tokens(request_id, position)
            if server.stopping:
                context.abort(grpc.StatusCode.UNAVAILABLE, "gateway is stopping")
            if not context.is_active():
                return
            if lost:
                with server.condition:
                    reason = server.coordinator.lost_reason(request_id)
                    # A refusal is the request's own (a retry meets it again), not the cluster's.
                    refused = server.coordinator.refused(request_id)
                code = grpc.StatusCode.INVALID_ARGUMENT if refused else grpc.StatusCode.UNAVAILABLE
                context.abort(code, f"request {request_id} lost: {reason}")
            yield pb.TokenChunk(
                request_id=request_id, start_position=position, token_ids=list(tokens), finished=finished
            )
            position += len(tokens)
            if finished:
                return

    def Drain(self, request: pb.DrainRequest, context: grpc.ServicerContext) -> pb.DrainReply:
        def drain(c: Coordinator) -> pb.DrainReply:
            status = c.drain(self._now(), request.worker_id, request.deadline_s)
            return pb.DrainReply(
                worker_id=status.worker_id,
                state=status.state,
                num_requests=status.num_requests,
                num_moved=status.num_moved,
                num_reprefilled=status.num_reprefilled,
                started_s=status.started_s,
                finished_s=0.0 if status.state == "flushing" else status.finished_s,
            )

        return self._run(context, drain)

    def Status(self, request: pb.StatusRequest, context: grpc.ServicerContext) -> pb.StatusReply:
        def status(c: Coordinator) -> pb.StatusReply:
            metrics = c.metrics()
            workers = [
                pb.WorkerStatus(
                    worker_id=w,
                    epoch=c.worker_epoch(w),
                    state=metrics.worker_state[w],
                    load=metrics.worker_load.get(w, 0.0),
                    queue_depth=metrics.worker_queue_depth.get(w, 0),
                    held_bytes=metrics.worker_held_bytes[w],
                )
                for w in c.worker_ids()
            ]
            return pb.StatusReply(
                policy=c.config.policy,
                workers=workers,
                num_requests=c.num_requests,
                num_finished=c.num_finished,
                num_failures=metrics.num_failures,
            )

        return self._run(context, status)


class _Collector:
    """Prometheus collector: reads the Coordinator's gauges at scrape time."""

    def __init__(self, server: GatewayServer) -> None:
        self._server = server

    def collect(self) -> Iterator[Metric]:
        with self._server.condition:
            m = self._server.coordinator.metrics()
        yield GaugeMetricFamily(
            "lumen_checkpoint_coverage",
            "Running requests whose durable checkpoint covers all but 16 tokens",
            value=m.coverage,
        )
        yield GaugeMetricFamily(
            "lumen_holder_balance_ratio",
            "Max/min held checkpoint tokens over serving workers",
            value=m.holder_balance,
        )
        yield GaugeMetricFamily(
            "lumen_assist_acceptance_rate", "Accepted / proposed draft tokens", value=m.acceptance
        )
        yield GaugeMetricFamily(
            "lumen_last_failure_recovery_seconds",
            "Last failure: detection until every interrupted request emitted its next token",
            value=m.recovery_s,
        )
        yield GaugeMetricFamily(
            "lumen_last_failure_replay_ttft_seconds",
            "Last failure: mean replay TTFT of its interrupted requests",
            value=m.replay_ttft_s,
        )
        yield GaugeMetricFamily(
            "lumen_failures", "Failures handled since the gateway started", value=m.num_failures
        )
        yield GaugeMetricFamily(
            "lumen_parked_requests", "Requests parked now: no worker was left serving", value=m.num_parked
        )
        yield GaugeMetricFamily(
            "lumen_parked_requests_total",
            "Requests parked since the gateway started",
            value=m.num_parked_total,
        )
        server = self._server
        for name, doc, value in (
            ("lumen_refused_calls", "Calls refused as unauthenticated", server.num_refused_calls),
            (
                "lumen_forbidden_calls",
                "Authentic calls refused: wrong principal for the method or another worker's identity",
                server.num_forbidden_calls,
            ),
            (
                "lumen_refused_token_reports",
                "Request token reports refused: not the request's worker at its epoch, or a fenced worker",
                server.num_refused_token_reports,
            ),
        ):
            yield CounterMetricFamily(name, doc, value=value)
        for name, doc, values in (
            ("lumen_worker_load", "L(w) in queue-equivalents", m.worker_load),
            ("lumen_worker_queue_depth", "Running plus waiting requests", m.worker_queue_depth),
            (
                "lumen_worker_held_checkpoint_bytes",
                "Checkpoint bytes the worker holds for others",
                m.worker_held_bytes,
            ),
        ):
            family = GaugeMetricFamily(name, doc, labels=["worker"])
            for worker_id, worker_value in sorted(values.items()):
                family.add_metric([str(worker_id)], float(worker_value))
            yield family
        states = GaugeMetricFamily(
            "lumen_worker_state", "1 for the worker's current state", labels=["worker", "state"]
        )
        for worker_id, state in sorted(m.worker_state.items()):
            states.add_metric([str(worker_id), state], 1.0)
        yield states


class GatewayServer:
    """The gateway: gRPC service, lease reaper, optional Prometheus endpoint.

    ``metrics_port``: None = no endpoint, 0 = a free port. ``reap_interval_s``: how often
    leases are checked (default lease_s / 10). ``max_streams``: client token streams open at
    once (each holds a server thread; more are refused with RESOURCE_EXHAUSTED), and
    ``control_threads`` more threads serve everything else, so heartbeats never wait.
    ``max_workers``: pushed directive streams open at once (one per worker, each holding a
    thread of its own; more are refused and those workers get their directives in heartbeat
    replies). ``push_directives=False`` refuses every directive stream (UNIMPLEMENTED):
    heartbeat replies alone deliver, as before the pushed channel. Use as a context manager
    or call ``start`` and ``stop``; ``stop`` ends the streams and joins the server's threads,
    the reaper and the metrics thread. ``issuer`` signs the data-plane capabilities (default: a
    fresh key for this run, handed to each worker's holder at registration).
    """

    def __init__(
        self,
        config: GatewayConfig,
        secret: bytes,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        metrics_port: int | None = None,
        event_log: EventLog | None = None,
        reap_interval_s: float | None = None,
        max_streams: int = 64,
        max_workers: int = 64,
        control_threads: int = 16,
        first_request_id: int = 1,
        push_directives: bool = True,
        issuer: CapabilityIssuer | None = None,
    ) -> None:
        secret = check_secret(secret)
        if not isinstance(host, str):
            raise TypeError(f"host must be a str, got {type(host).__name__}")
        for name, value in (("port", port), ("metrics_port", 0 if metrics_port is None else metrics_port)):
            if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= 65535:
                raise ValueError(f"{name} must be an int in [0, 65535], got {value!r}")
        for name, value in (
            ("max_streams", max_streams),
            ("max_workers", max_workers),
            ("control_threads", control_threads),
        ):
            check_int(name, value, low=1)
        self.coordinator = Coordinator(
            config, secret, event_log=event_log, first_request_id=first_request_id, issuer=issuer
        )
        self.condition = threading.Condition()
        self.stopping = False
        self.max_streams = max_streams
        self.num_streams = 0
        self.max_workers = max_workers
        self.num_directive_streams = 0
        self.directive_streams: dict[int, int] = {}  # worker id -> generation of its newest stream
        self.push_directives = push_directives
        self._host = host
        self._port = port
        self._metrics_port = metrics_port
        self._reap_interval_s = config.lease_s / 10.0 if reap_interval_s is None else float(reap_interval_s)
        self._started_s = time.monotonic()
        self._secret = secret
        self.instance_id = new_instance_id()
        self.verifier = CallVerifier(self.instance_id)
        self.credentials = CredentialTable()
        self.num_forbidden_calls = 0
        self.num_refused_token_reports = 0  # under self.condition (the servicer's lock)
        self._executor = futures.ThreadPoolExecutor(
            max_workers=max_streams + max_workers + control_threads, thread_name_prefix="lumen-gateway"
        )
        self._grpc = grpc.server(
            self._executor,
            interceptors=[_AuthInterceptor(self)],
            options=[("grpc.so_reuseport", 0)],
        )
        pb_grpc.add_GatewayServicer_to_server(_Servicer(self), self._grpc)  # type: ignore[no-untyped-call]
        # What the metrics endpoint serves; the HTTP front door adds its counters to it.
        self.registry = CollectorRegistry()
        self.registry.register(_Collector(self))
        self._stop_reaper = threading.Event()
        self._reaper: threading.Thread | None = None
        self._httpd: Any = None
        self._http_thread: threading.Thread | None = None
        self.port = 0
        self.metrics_port = 0

    @property
    def address(self) -> str:
        return f"{self._host}:{self.port}"

    @property
    def num_refused_calls(self) -> int:
        """Calls refused for lack of a valid ``lumen-call-v3`` value."""
        return self.verifier.num_refused

    def derive_key(self, label: bytes) -> bytes:
        """A 32-byte key for one purpose (``label``), derived from the cluster secret
        (HMAC-SHA256): the same after a restart, and revealing nothing of the secret."""
        if not isinstance(label, bytes) or not label:
            raise ValueError("`label` must be non-empty bytes")
        return hmac.new(self._secret, b"lumen-derived-key|" + label, hashlib.sha256).digest()

    def key_of(self, principal: str) -> bytes | None:
        """The key a principal signs with: the cluster secret, or the call key issued to a
        worker incarnation; None for a principal this instance does not know."""
        return self._secret if principal == CLUSTER_PRINCIPAL else self.credentials.key_of(principal)

    def issue_call_key(self, worker_id: int, epoch: int, exchange_key: bytes) -> tuple[bytes, bytes, bytes]:
        """A new call key for the worker incarnation, as (salt, wrapped key, the gateway's
        exchange key) for its reply, wrapped for the worker's X25519 ``exchange_key``.
        Raises ValueError for an exchange key that is not a usable X25519 public key."""
        principal = worker_principal(worker_id, epoch)
        key = self.credentials.issue(worker_id, epoch)
        return wrap_call_key(
            self._secret,
            key,
            instance_id=self.instance_id,
            principal=principal,
            worker_exchange_key=exchange_key,
        )

    def authorize(self, name: str, principal: str, request: Any) -> None:
        """Raise _Forbidden (counted) unless ``principal`` may call method ``name`` with
        ``request``: the cluster secret the methods of CLUSTER_SIGNED, a worker's call key
        those of WORKER_SIGNED naming its own worker id and epoch."""
        if name in CLUSTER_SIGNED and principal == CLUSTER_PRINCIPAL:
            return
        reason = f"{name} must be signed with the cluster secret, got {principal}'s key"
        if name in WORKER_SIGNED:
            id_field, epoch_field = WORKER_SIGNED[name]
            named = (getattr(request, id_field), getattr(request, epoch_field))
            caller = parse_worker_principal(principal)
            if caller == named:
                return
            reason = (
                f"{name} must be signed with worker {named[0]} epoch {named[1]}'s call key, got {principal}'s"
            )
        with self.condition:
            self.num_forbidden_calls += 1
            if name == "ReportTokens":
                self.num_refused_token_reports += len(request.requests)
        raise _Forbidden(reason)

    def report_exit(self, worker_id: int, epoch: int, reason: str = "") -> bool:
        """A supervisor in this process reports that worker incarnation (``worker_id``,
        ``epoch``) exited (over gRPC, ReportExit needs that incarnation's call key); True if it
        was failed now. Raises as ``Coordinator.process_exited``."""
        with self.condition:
            failed = self.coordinator.process_exited(self.now_s(), worker_id, epoch, reason) is not None
            self.condition.notify_all()
        return failed

    def now_s(self) -> float:
        """The gateway's clock: seconds since it was built (monotonic)."""
        return time.monotonic() - self._started_s

    def monotonic_s(self, gateway_s: float) -> float:
        """A time on the gateway's clock as ``time.monotonic()`` (the host's clock, which the
        other processes of the host share)."""
        return self._started_s + gateway_s

    def start(self) -> GatewayServer:
        self.port = self._grpc.add_insecure_port(f"{self._host}:{self._port}")
        if self.port == 0:
            raise RuntimeError(f"cannot listen on {self._host}:{self._port}")
        self._grpc.start()
        self._reaper = threading.Thread(target=self._reap, name="lumen-gateway-leases", daemon=True)
        self._reaper.start()
        if self._metrics_port is not None:
            self._httpd, self._http_thread = start_http_server(
                self._metrics_port, addr=self._host, registry=self.registry
            )
            self.metrics_port = self._httpd.server_address[1]
        return self

    def _reap(self) -> None:
        while not self._stop_reaper.wait(self._reap_interval_s):
            with self.condition:
                failed = self.coordinator.expire_leases(self.now_s()) is not None
                failed |= self.coordinator.expire_drains(self.now_s()) > 0
                if self.coordinator.driver.parked:  # parked requests past their bound are lost
                    failed |= self.coordinator.unpark(self.now_s()) > 0
                self.coordinator.forget_finished(self.now_s())
                released = self.coordinator.drop_orphaned_holds(self.now_s()) > 0
                renewed = self.coordinator.renew_capabilities(self.now_s()) > 0
                if failed or released or renewed:  # directives were decided: push them now
                    self.condition.notify_all()

    def stop(self, grace_s: float = 1.0) -> None:
        with self.condition:
            self.stopping = True
            self.condition.notify_all()
        self._stop_reaper.set()
        self._grpc.stop(grace_s).wait(grace_s + 5.0)
        self._executor.shutdown(wait=True)
        if self._reaper is not None:
            self._reaper.join(timeout=5.0)
        if self._httpd is not None:
            self._httpd.shutdown()
            self._httpd.server_close()
            assert self._http_thread is not None
            self._http_thread.join(timeout=5.0)
            self._httpd = None

    def __enter__(self) -> GatewayServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
