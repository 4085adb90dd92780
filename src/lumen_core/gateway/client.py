"""GatewayClient: what worker processes and clients call the gateway with.

Every call is signed (``auth.sign_call``) over its serialized request for the gateway's
instance (learnt with Hello, again when a call is refused as signed for another instance):
registrations and the client API with the cluster secret, every later call of a worker with
the call key its registration returned; every reply message is checked under that same key
(``auth.open_reply``) before it is decoded, and one that does not verify fails its call
(DATA_LOSS). Every call has a deadline (the pushed directive
stream excepted: it stays open). Worker side: ``register``, then
``heartbeat`` every ``heartbeat_s`` and ``receive_directives`` on a thread of its own (the
pushed delivery); both deliver through the client's ``DirectiveInbox``, so each directive
reaches the handler once and in order whichever path brought it. The lease is the worker's to
watch: ``lease_valid()`` turns False once a heartbeat reply says ``fenced`` or once no
heartbeat has been acknowledged for ``lease_s`` (measured from when the last acknowledged one
was sent, so the worker's deadline is never later than the gateway's). A worker whose lease
is not valid must stop serving (fence itself) and register again as a new incarnation. A
restarted gateway knows no call key: a heartbeat then answers ``reregister``.
Client side: ``submit`` streams a request's tokens, ``watch`` re-attaches to one.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import grpc

from lumen_core._validate import check_number
from lumen_core.auth import (
    CALL_METADATA_KEY,
    CLUSTER_PRINCIPAL,
    INSTANCE_METADATA_KEY,
    ReplyForged,
    WorkerIdentity,
    check_secret,
    generate_exchange_key,
    open_reply,
    sign_call,
    unwrap_call_key,
    worker_principal,
)
from lumen_core.gateway import lumen_pb2 as pb
from lumen_core.gateway.directives import Directive
from lumen_core.gateway.errors import AuthError, GatewayError, StaleEpochError
from lumen_core.gateway.inbox import DirectiveHandler, DirectiveInbox
from lumen_core.gateway.protocol import (
    CLUSTER_SIGNED,
    REPLIES,
    bound_error,
    delivery_from_pb,
    held_to_pb,
    method,
    report_to_pb,
    running_to_pb,
    state_to_pb,
)
from lumen_core.gateway.reports import HeldReport, RunningReport, WorkerReport
from lumen_core.policy.events import WorkerState

# gRPC backs off reconnecting to an address that failed (up to 120 s by default): a worker
# could then lose its lease after a gateway restart before it even tried the new gateway.
# Reconnect attempts here are at most 1 s apart, well inside any sensible lease.
_CHANNEL_OPTIONS = (
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1000),
)


_NO_REPORT = WorkerReport()


@dataclass(frozen=True)
class _Signed:
    """One call as signed: its metadata, and the key and value its replies are sealed with."""

    metadata: tuple[tuple[str, str], ...]
    key: bytes
    value: str

    def open(self, name: str, index: int, data: bytes) -> Any:
        """Reply message ``index`` of Gateway method ``name``, decoded once its MAC verifies;
        GatewayError (DATA_LOSS) if it does not."""
        try:
            body = open_reply(self.key, self.value, index, data)
        except ReplyForged as exc:
            raise GatewayError(grpc.StatusCode.DATA_LOSS, f"{name}: {exc}") from None
        return REPLIES[name][0].FromString(body)


@dataclass(frozen=True)
class _Credential:
    """A worker incarnation's call key, issued by gateway instance ``instance_id``: one object,
    so a call's body and its signature always name the same incarnation."""

    worker_id: int
    epoch: int
    key: bytes
    instance_id: str


class FencedError(RuntimeError):
    """A call that needs a valid lease was made after the lease was lost."""


def _current_instance(error: grpc.RpcError) -> str | None:
    """The gateway instance a refusal names (a call signed for another instance), or None."""
    if error.code() != grpc.StatusCode.UNAUTHENTICATED:
        return None
    # grpc's stubs type every trailing value as bytes; a key not ending in "-bin" carries a str.
    metadata: dict[str, str] = dict(error.trailing_metadata() or ())  # type: ignore[arg-type]
    return metadata.get(INSTANCE_METADATA_KEY)


def _translate(error: grpc.RpcError) -> GatewayError:
    code = error.code()
    details = error.details() or ""
    if code == grpc.StatusCode.UNAUTHENTICATED:
        return AuthError(code, details)
    if code == grpc.StatusCode.FAILED_PRECONDITION:
        return StaleEpochError(details)
    return GatewayError(code, details)


@dataclass(frozen=True)
class RegisterResult:
    """``directives``: those of the reply the inbox had not applied (all of them, unless the
    pushed stream of the new epoch was quicker)."""

    epoch: int
    lease_s: float
    heartbeat_s: float
    directives: tuple[Directive, ...]
    issuer_public_key: bytes  # what the worker's holder verifies capabilities with


@dataclass(frozen=True)
class HeartbeatResult:
    """``directives``: those of the reply the inbox had not applied yet (the pushed stream
    usually delivered them first)."""

    fenced: bool
    reregister: bool
    reason: str
    directives: tuple[Directive, ...]
    num_draft_tokens: int


@dataclass(frozen=True)
class RequestTokens:
    """Output tokens of one request at ``start_position``, as a worker reports them.
    ``error``: the worker refused the request (it ends at its client with this text); with
    ``failed``, the worker failed it (its server's own error), and the gateway moves it."""

    request_id: int
    epoch: int
    start_position: int
    token_ids: tuple[int, ...]
    finished: bool = False
    error: str = ""
    failed: bool = False


@dataclass(frozen=True)
class ReportAck:
    """The gateway's answer for one request of a token report; ``code`` 0 = accepted."""

    request_id: int
    num_new: int
    num_conflicts: int
    next_position: int
    code: int
    details: str


@dataclass(frozen=True)
class TokenChunk:
    request_id: int
    start_position: int
    token_ids: tuple[int, ...]
    finished: bool


class GatewayClient:
    """One channel to the gateway. Thread-safe for concurrent calls; ``close`` when done.
    ``on_issuer_key`` receives the gateway's capability-issuer public key on every
    registration, before any of its directives is applied (a worker's holder trusts it).
    With ``identity`` each registration sends its public key and ``identity`` takes the
    credential the gateway returns, also before any directive is applied: the worker's
    capabilities are then bound to it, and its connections to holders prove it."""

    def __init__(
        self,
        address: str,
        secret: bytes | None,
        *,
        timeout_s: float = 5.0,
        on_issuer_key: Callable[[bytes], None] | None = None,
        identity: WorkerIdentity | None = None,
    ) -> None:
        if not isinstance(address, str):
            raise TypeError(f"address must be a str, got {type(address).__name__}")
        self._secret = check_secret(secret)
        self.timeout_s = check_number("timeout_s", timeout_s, positive=True)
        if on_issuer_key is not None and not callable(on_issuer_key):
            raise TypeError(f"on_issuer_key must be callable, got {type(on_issuer_key).__name__}")
        self.on_issuer_key = on_issuer_key
        if identity is not None and not isinstance(identity, WorkerIdentity):
            raise TypeError(f"identity must be a WorkerIdentity, got {type(identity).__name__}")
        self.identity = identity
        self._channel = grpc.insecure_channel(address, options=_CHANNEL_OPTIONS)
        # Raw reply bytes: a signed call's are opened (``_Signed.open``) before decoding.
        self._calls: dict[str, Any] = {
            name: (self._channel.unary_stream if streams else self._channel.unary_unary)(
                method(name), response_deserializer=reply.FromString if name == "Hello" else None
            )
            for name, (reply, streams) in REPLIES.items()
        }
        self._lock = threading.Lock()
        self._instance_id = ""  # the gateway instance calls are signed for ("": ask with Hello)
        self._credential: _Credential | None = None  # set by register
        self.worker_id = -1
        self.epoch = 0
        self.lease_s = math.nan
        self.heartbeat_s = math.nan
        self._lease_deadline_s = -math.inf
        self.fenced = False
        self.fence_reason = ""
        self.state: str = WorkerState.SERVING
        self._registration: dict[str, object] = {}
        self.inbox = DirectiveInbox()
        self._pushed: Any = None  # the open Directives call, cancelled by cancel_directives

    def signed_metadata(self, name: str, body: bytes) -> tuple[tuple[str, str], ...]:
        """The metadata of one call of Gateway method ``name`` with serialized request
        ``body``: signed for the gateway instance this client knows, with the cluster secret
        (registrations, the client API) or this worker incarnation's call key. Raises
        FencedError for a worker's call before ``register``, grpc.RpcError when the gateway
        cannot be asked for its instance."""
        return self._sign(name, body, self._credential).metadata

    def _worker_credential(self, name: str) -> _Credential:
        credential = self._credential
        if credential is None:
            raise FencedError(f"{name} before register: this client holds no call key")
        return credential

    def _sign(self, name: str, body: bytes, credential: _Credential | None) -> _Signed:
        if not self._instance_id:
            reply = self._calls["Hello"](b"", timeout=self.timeout_s)
            self._instance_id = reply.instance_id
        if name in CLUSTER_SIGNED:
            key, principal = self._secret, CLUSTER_PRINCIPAL
        else:
            credential = self._worker_credential(name) if credential is None else credential
            key, principal = credential.key, worker_principal(credential.worker_id, credential.epoch)
        value = sign_call(
            key, instance_id=self._instance_id, principal=principal, method=method(name), body=body
        )
        return _Signed(((CALL_METADATA_KEY, value),), key, value)

    def _learn_instance(self, error: grpc.RpcError) -> bool:
        """Take a refusal's current gateway instance; True if it is news (re-sign, retry)."""
        instance_id = _current_instance(error)
        if instance_id is None or instance_id == self._instance_id:
            return False
        self._instance_id = instance_id
        return True

    def _call(self, name: str, request: Any, credential: _Credential | None = None) -> Any:
        """One unary call (a worker's signed with ``credential``, by default the current one);
        a call of the cluster secret's refused for naming an older gateway instance is signed
        again for the current one and sent once more."""
        body = request.SerializeToString()
        try:
            for attempt in range(2):
                try:
                    signed = self._sign(name, body, credential)
                    reply = self._calls[name](body, timeout=self.timeout_s, metadata=signed.metadata)
                    return signed.open(name, 0, reply)
                except grpc.RpcError as error:
                    if not (self._learn_instance(error) and name in CLUSTER_SIGNED and attempt == 0):
                        raise
        except grpc.RpcError as error:
            raise _translate(error) from None
        raise AssertionError("unreachable: the second attempt returns or raises")

    def _stale(self, credential: _Credential) -> bool:
        """Whether the gateway restarted since ``credential`` was issued (the key is gone)."""
        return credential.instance_id != self._instance_id

    # ---- worker side -----------------------------------------------------------------------
    def register(
        self,
        worker_id: int,
        *,
        state: str = WorkerState.SERVING,
        budget_bytes: int = 0,
        domain: str = "",
        holder_address: str = "",
        num_shards: int = 1,
        running: Sequence[RunningReport] = (),
        held: Sequence[HeldReport] = (),
        on_directives: DirectiveHandler | None = None,
    ) -> RegisterResult:
        """Register this worker (again); a new epoch and lease start, and the inbox starts the
        new epoch's sequence. ``running`` and ``held`` report what it serves and holds (after
        a gateway restart). The reply's directives go to ``on_directives`` (as
        ``DirectiveInbox.accept``) and are returned."""
        sent_s = time.monotonic()
        exchange_key = generate_exchange_key()  # this registration's; the call key is wrapped for it
        reply = self._call(
            "Register",
            pb.RegisterRequest(
                exchange_public_key=exchange_key[1],
                worker_id=worker_id,
                state=state_to_pb(state),
                budget_bytes=budget_bytes,
                domain=domain,
                holder_address=holder_address,
                num_shards=num_shards,
                last_epoch=self.epoch,
                running=[running_to_pb(r) for r in running],
                held=[held_to_pb(h) for h in held],
                identity_public_key=self.identity.public_key if self.identity is not None else b"",
            ),
        )
        assert isinstance(reply, pb.RegisterReply)
        with self._lock:
            self.worker_id = worker_id
            self.epoch = reply.epoch
            key = unwrap_call_key(
                self._secret,
                reply.wrapped_call_key,
                reply.call_key_salt,
                instance_id=self._instance_id,
                principal=worker_principal(worker_id, reply.epoch),
                exchange_key=exchange_key,
                gateway_exchange_key=reply.exchange_public_key,
            )
            self._credential = _Credential(worker_id, reply.epoch, key, self._instance_id)
            self.lease_s = reply.lease_s
            self.heartbeat_s = reply.heartbeat_s
            self._lease_deadline_s = sent_s + reply.lease_s
            self.fenced = False
            self.fence_reason = ""
            self.state = state
            self._registration = {
                "worker_id": worker_id,
                "budget_bytes": budget_bytes,
                "domain": domain,
                "holder_address": holder_address,
                "num_shards": num_shards,
            }
        # Before any directive is applied: the holder must trust the key the gateway signs the
        # capabilities of this epoch's directives with.
        if self.on_issuer_key is not None:
            self.on_issuer_key(bytes(reply.issuer_public_key))
        if self.identity is not None:
            self.identity.accept(bytes(reply.credential), bytes(reply.issuer_public_key), worker_id)
        # Outside self._lock: a handler the inbox calls may fence this client (take self._lock).
        self.inbox.reset(reply.epoch)
        directives = self.inbox.accept(
            reply.epoch, [delivery_from_pb(d) for d in reply.directives], on_directives
        )
        return RegisterResult(
            reply.epoch, reply.lease_s, reply.heartbeat_s, directives, bytes(reply.issuer_public_key)
        )

    def register_again(
        self, report: WorkerReport = _NO_REPORT, *, on_directives: DirectiveHandler | None = None
    ) -> RegisterResult:
        """Register with the last registration's parameters and the current state (after a
        ``reregister`` reply: the gateway restarted), reporting what it runs and holds."""
        if not self._registration:
            raise FencedError("register_again before register")
        return self.register(
            **self._registration,  # type: ignore[arg-type]
            state=self.state,
            running=report.running,
            held=report.held,
            on_directives=on_directives,
        )

    def heartbeat(
        self, report: WorkerReport = _NO_REPORT, *, on_directives: DirectiveHandler | None = None
    ) -> HeartbeatResult:
        """Renew the lease, send ``report`` (with the state it registered in or switched over
        to) and acknowledge the directives the inbox applied; a ``fenced`` reply fences this
        client. The reply's directives go through the inbox to ``on_directives``. A gateway
        that restarted since ``register`` knows no call key of this worker: the result then
        says ``reregister`` (it was not sent, or refused as signed for the old instance)."""
        credential = self._credential
        if credential is None:
            raise FencedError("heartbeat before register")
        restarted = HeartbeatResult(False, True, "the gateway restarted: re-register", (), 0)
        if self._stale(credential):
            return restarted
        sent_s = time.monotonic()
        epoch = credential.epoch
        try:
            reply = self._call(
                "Heartbeat",
                pb.HeartbeatRequest(
                    worker_id=credential.worker_id,
                    epoch=epoch,
                    state=state_to_pb(self.state),
                    report=report_to_pb(report),
                    acked_sequence=self.inbox.sequence,
                ),
                credential,
            )
        except AuthError:
            if self._stale(credential):
                return restarted
            raise
        assert isinstance(reply, pb.HeartbeatReply)
        with self._lock:
            if reply.fenced:
                self.fenced = True
                self.fence_reason = reply.reason
            elif not reply.reregister and not self.fenced:
                self._lease_deadline_s = sent_s + reply.lease_s
        directives = self.inbox.accept(epoch, [delivery_from_pb(d) for d in reply.directives], on_directives)
        return HeartbeatResult(
            reply.fenced, reply.reregister, reply.reason, directives, reply.num_draft_tokens
        )

    def receive_directives(
        self, on_directives: DirectiveHandler, stop: threading.Event | None = None
    ) -> None:
        """The pushed delivery: open this epoch's directive stream after the last number the
        inbox applied and hand what arrives to ``on_directives`` (through the inbox) until the
        stream ends. Returns when the gateway ends it, ``cancel_directives`` is called or
        ``stop`` is set (set it before calling ``cancel_directives``: then no stream opened
        concurrently stays open), and at once while a ``register`` is under way (the inbox is
        not at the new epoch yet: call again); raises GatewayError when it cannot be opened or breaks
        (StaleEpochError: this epoch is fenced), FencedError before ``register``."""
        credential = self._credential
        if credential is None:
            raise FencedError("receive_directives before register")
        epoch, after_sequence = self.inbox.position()
        if epoch != credential.epoch:
            return  # a register is under way: its epoch's stream opens on the next call
        body = pb.DirectivesRequest(
            worker_id=credential.worker_id, epoch=epoch, after_sequence=after_sequence
        ).SerializeToString()
        try:
            signed = self._sign("Directives", body, credential)
            call = self._calls["Directives"](body, metadata=signed.metadata)
        except grpc.RpcError as error:  # Hello failed: the gateway is unreachable
            raise _translate(error) from None
        self._pushed = call
        if stop is not None and stop.is_set():
            call.cancel()
        try:
            for index, data in enumerate(call):
                message = signed.open("Directives", index, data)
                self.inbox.accept(epoch, [delivery_from_pb(message)], on_directives)
        except grpc.RpcError as error:
            self._learn_instance(error)
            if error.code() != grpc.StatusCode.CANCELLED:
                raise _translate(error) from None
        except GatewayError:  # a forged directive: nothing more is taken from this stream
            call.cancel()
            raise
        finally:
            self._pushed = None

    def cancel_directives(self) -> None:
        """End the stream ``receive_directives`` reads (it returns)."""
        call = self._pushed
        if call is not None:
            call.cancel()

    def fence(self, reason: str) -> None:
        """Give the lease up locally (the worker cannot go on): ``lease_valid()`` turns False
        and token reports are no longer sent, until it registers again."""
        with self._lock:
            self.fenced = True
            self.fence_reason = reason

    def lease_valid(self) -> bool:
        """Whether this worker may still serve: not fenced and its lease has not run out."""
        with self._lock:
            return not self.fenced and time.monotonic() < self._lease_deadline_s

    def report_tokens(
        self,
        request_id: int,
        epoch: int,
        start_position: int,
        token_ids: Sequence[int],
        *,
        finished: bool = False,
        error: str = "",
        failed: bool = False,
    ) -> ReportAck:
        """Report one request's output tokens (or, with ``error``, that this worker refused
        it, or with ``failed`` too that it failed it); raises what the gateway refused the
        report with (StaleEpochError for a fenced worker or request epoch, GatewayError
        otherwise)."""
        (ack,) = self.report_tokens_batch(
            [RequestTokens(request_id, epoch, start_position, tuple(token_ids), finished, error, failed)]
        )
        if ack.code != grpc.StatusCode.OK.value[0]:
            code = next(c for c in grpc.StatusCode if c.value[0] == ack.code)
            if code == grpc.StatusCode.FAILED_PRECONDITION:
                raise StaleEpochError(ack.details)
            raise GatewayError(code, ack.details)
        return ack

    def report_tokens_batch(self, reports: Sequence[RequestTokens]) -> list[ReportAck]:
        """Report the tokens of many requests in one call (one per engine step). A request the
        gateway refuses gets an ack with a non-zero ``code``; the others are accepted. Not
        sent (FencedError) once this client knows its lease is lost; StaleEpochError when the
        gateway has fenced this worker epoch. Errors are sent as ``protocol.bound_error``
        cuts them (the gateway keeps no more)."""
        credential = self._worker_credential("ReportTokens")
        if not self.lease_valid():
            raise FencedError(
                f"worker {credential.worker_id} epoch {credential.epoch} holds no lease: {self.fence_reason}"
            )
        reply = self._call(
            "ReportTokens",
            pb.TokenReport(
                worker_id=credential.worker_id,
                worker_epoch=credential.epoch,
                requests=[
                    pb.RequestTokens(
                        request_id=r.request_id,
                        epoch=r.epoch,
                        start_position=r.start_position,
                        token_ids=list(r.token_ids),
                        finished=r.finished,
                        error=bound_error(r.error),
                        failed=r.failed,
                    )
                    for r in reports
                ],
            ),
            credential,
        )
        assert isinstance(reply, pb.TokenAcks)
        return [
            ReportAck(a.request_id, a.num_new, a.num_conflicts, a.next_position, a.code, a.details)
            for a in reply.acks
        ]

    def report_exit(self, worker_id: int, epoch: int, reason: str = "") -> bool:
        """Report that the process of (worker, epoch) exited: this client's own incarnation
        (the call is signed with its call key; the gateway refuses any other with
        PERMISSION_DENIED). True if the gateway failed that incarnation now (False: already
        failed or superseded)."""
        reply = self._call("ReportExit", pb.ExitReport(worker_id=worker_id, epoch=epoch, reason=reason))
        assert isinstance(reply, pb.ExitReply)
        return reply.failed

    def model_loaded(self, *, budget_bytes: int, domain: str = "") -> int | None:
        """Switch-over: this recovering worker's full model is loaded. Returns the survivor it
        assisted, or None."""
        credential = self._worker_credential("ModelLoaded")
        reply = self._call(
            "ModelLoaded",
            pb.ModelLoadedRequest(
                worker_id=credential.worker_id,
                epoch=credential.epoch,
                budget_bytes=budget_bytes,
                domain=domain,
            ),
            credential,
        )
        assert isinstance(reply, pb.ModelLoadedReply)
        self.state = WorkerState.SERVING
        return None if reply.freed_survivor_id < 0 else reply.freed_survivor_id

    # ---- client side -----------------------------------------------------------------------
    def _stream(self, name: str, request: Any, timeout_s: float) -> Iterator[TokenChunk]:
        body = request.SerializeToString()
        for attempt in range(2):
            try:
                signed = self._sign(name, body, self._credential)
                call = self._calls[name](body, timeout=timeout_s, metadata=signed.metadata)
                for index, data in enumerate(call):
                    chunk = signed.open(name, index, data)
                    yield TokenChunk(
                        chunk.request_id, chunk.start_position, tuple(chunk.token_ids), chunk.finished
                    )
                return
            except grpc.RpcError as error:
                # Refused before anything streamed (signed for an older gateway instance):
                # sign again for the current one, once.
                if not (self._learn_instance(error) and attempt == 0):
                    raise _translate(error) from None

    def submit(
        self,
        prompt_token_ids: Sequence[int],
        max_new_tokens: int,
        *,
        expected_output_tokens: int = 0,
        timeout_s: float = 60.0,
    ) -> Iterator[TokenChunk]:
        """Submit a request; yields chunks: first an empty one naming the request id once it is
        admitted, then its tokens, each position once, the last chunk with ``finished``.
        ``timeout_s`` bounds the whole stream."""
        request = pb.SubmitRequest(
            prompt_token_ids=list(prompt_token_ids),
            max_new_tokens=max_new_tokens,
            expected_output_tokens=expected_output_tokens,
        )
        return self._stream("Submit", request, timeout_s)

    def watch(
        self, request_id: int, from_position: int = 0, *, timeout_s: float = 60.0
    ) -> Iterator[TokenChunk]:
        """Stream an existing request's tokens from ``from_position``."""
        return self._stream(
            "Watch", pb.WatchRequest(request_id=request_id, from_position=from_position), timeout_s
        )

    def status(self) -> pb.StatusReply:
        reply = self._call("Status", pb.StatusRequest())
        assert isinstance(reply, pb.StatusReply)
        return reply

    def drain(self, worker_id: int, *, deadline_s: float) -> pb.DrainReply:
        """Start draining ``worker_id`` (or read the progress of its drain): an admin call,
        signed with the cluster secret (``Coordinator.drain``)."""
        reply = self._call("Drain", pb.DrainRequest(worker_id=worker_id, deadline_s=deadline_s))
        assert isinstance(reply, pb.DrainReply)
        return reply

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> GatewayClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
