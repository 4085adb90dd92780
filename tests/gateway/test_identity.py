"""The gateway plane's identities over real gRPC: the cluster secret only admits
registrations (and the client API), each worker incarnation calls with its own call key and
only as itself, token reports come from a request's worker at its epoch, calls are bound to
the gateway instance and their whole body, and one out-of-range field fails its call alone."""

import re
import urllib.request

import grpc
import pytest

from lumen_core.auth import (
    CALL_METADATA_KEY,
    INSTANCE_METADATA_KEY,
    REPLY_MAC_BYTES,
    WorkerIdentity,
    generate_exchange_key,
    sign_call,
    unwrap_call_key,
    verify_capability,
    verify_credential,
)
from lumen_core.gateway import lumen_pb2 as pb
from lumen_core.gateway import lumen_pb2_grpc as pb_grpc
from lumen_core.gateway.client import RequestTokens
from lumen_core.gateway.config import GatewayConfig
from lumen_core.gateway.directives import Run
from lumen_core.gateway.errors import GatewayError
from lumen_core.gateway.protocol import REPLIES, method
from lumen_core.gateway.reports import HeldReport, WorkerReport

pytestmark = pytest.mark.timeout(60)

SECRET = b"gateway-tests-secret-0123456789abcdef"  # as conftest.py
GIB = 1 << 30
# A registration's X25519 public key, for requests sent by hand (GatewayClient draws its own).
EXCHANGE = {"exchange_public_key": generate_exchange_key()[1]}


def raw_call(server, client, name, request, metadata=None):
    """Send ``request`` as Gateway method ``name`` over a channel of its own, signed by
    ``client`` as its principal for that method (or with ``metadata`` as given); the first
    reply message, its seal left unchecked (tests/gateway/test_replies.py checks seals)."""
    if metadata is None:
        metadata = client.signed_metadata(name, request.SerializeToString())
    reply_type, streams = REPLIES[name]
    with grpc.insecure_channel(server.address) as channel:
        call = (channel.unary_stream if streams else channel.unary_unary)(method(name))
        data = call(request.SerializeToString(), metadata=metadata, timeout=5.0)
        return reply_type.FromString((next(data) if streams else data)[REPLY_MAC_BYTES:])


def signed_with(server, key, principal, name, request):
    """Metadata signed by hand for ``server``'s instance."""
    value = sign_call(
        key,
        instance_id=server.instance_id,
        principal=principal,
        method=method(name),
        body=request.SerializeToString(),
    )
    return ((CALL_METADATA_KEY, value),)


def refused(server, client, name, request, metadata=None):
    with pytest.raises(grpc.RpcError) as info:
        raw_call(server, client, name, request, metadata)
    return info.value.code(), info.value.details()


def metrics(server):
    url = f"http://127.0.0.1:{server.metrics_port}/metrics"
    text = urllib.request.urlopen(url, timeout=5).read().decode()
    return {
        line.split(" ")[0]: float(line.split(" ")[1])
        for line in text.splitlines()
        if line.startswith("lumen_")
    }


def test_a_worker_cannot_register_as_another_live_worker(start_gateway, connect):
    server = start_gateway(GatewayConfig(policy="S&R"))
    victim = connect(server)
    victim.register(0, budget_bytes=GIB, holder_address="127.0.0.1:7000")
    # The call key travels wrapped: the reply's bytes do not hold it.
    reply = raw_call(
        server, victim, "Register", pb.RegisterRequest(worker_id=5, state=pb.SERVING, **EXCHANGE)
    )
    assert server.credentials.key_of("worker-5-1") not in reply.SerializeToString()
    rogue = connect(server)  # holds the cluster secret, like every worker
    with pytest.raises(GatewayError, match="ALREADY_EXISTS: worker 0 epoch 1 is live"):
        rogue.register(0, budget_bytes=GIB, holder_address="127.0.0.1:9")
    assert not victim.heartbeat().fenced and server.coordinator.worker_epoch(0) == 1
    # Once the incarnation is gone (its exit reported, or its lease expired), the id is free.
    assert server.report_exit(0, 1, "SIGKILL")
    assert rogue.register(0, budget_bytes=GIB).epoch == 2


def test_a_worker_that_reads_the_network_cannot_unwrap_another_workers_call_key(start_gateway, connect):
    """It holds the cluster secret and sees the registration and its reply, public keys and all;
    the wrap's pad also takes one of the registration's X25519 private keys, which never leave
    their ends (before, the secret alone computed it)."""
    server = start_gateway(GatewayConfig(policy="S&R"))
    victim_exchange = generate_exchange_key()
    request = pb.RegisterRequest(
        worker_id=3, state=pb.SERVING, budget_bytes=GIB, exchange_public_key=victim_exchange[1]
    )
    reply = raw_call(server, connect(server), "Register", request)  # what crosses the network
    principal, key = "worker-3-1", server.credentials.key_of("worker-3-1")

    def unwrap(exchange_key: tuple[bytes, bytes]) -> bytes:
        return unwrap_call_key(
            SECRET,
            reply.wrapped_call_key,
            reply.call_key_salt,
            instance_id=server.instance_id,
            principal=principal,
            exchange_key=exchange_key,
            gateway_exchange_key=reply.exchange_public_key,
        )

    assert unwrap(victim_exchange) == key
    guessed = unwrap((generate_exchange_key()[0], victim_exchange[1]))  # its own private key
    assert guessed != key
    heartbeat = pb.HeartbeatRequest(worker_id=3, epoch=1, state=pb.SERVING)
    code, details = refused(
        server, None, "Heartbeat", heartbeat, signed_with(server, guessed, principal, "Heartbeat", heartbeat)
    )
    assert code == grpc.StatusCode.UNAUTHENTICATED and details.startswith("bad MAC")


def test_a_worker_cannot_call_as_another_worker(start_gateway, connect):
    server = start_gateway(GatewayConfig(policy="S&R"), metrics_port=0)
    victim, rogue = connect(server), connect(server)
    victim.register(0, budget_bytes=GIB)
    rogue.register(1, budget_bytes=GIB)
    # With its own call key, naming the victim: every worker call is refused.
    for name, request in (
        ("Heartbeat", pb.HeartbeatRequest(worker_id=0, epoch=1, state=pb.SERVING)),
        ("Directives", pb.DirectivesRequest(worker_id=0, epoch=1)),
        ("ReportExit", pb.ExitReport(worker_id=0, epoch=1)),
        ("ModelLoaded", pb.ModelLoadedRequest(worker_id=0, epoch=1)),
        ("Heartbeat", pb.HeartbeatRequest(worker_id=1, epoch=2, state=pb.SERVING)),  # its own next epoch
    ):
        code, details = refused(server, rogue, name, request)
        assert code == grpc.StatusCode.PERMISSION_DENIED, name
        assert (
            f"{name} must be signed with worker {request.worker_id} epoch {request.epoch}'s call key"
            in details
        )
    with pytest.raises(
        GatewayError, match="PERMISSION_DENIED: ReportExit must be signed with worker 0 epoch 1"
    ):
        rogue.report_exit(0, 1, "forged")
    # Claiming the victim's principal takes the victim's key, which it does not hold.
    own_key = server.credentials.key_of("worker-1-1")
    request = pb.HeartbeatRequest(worker_id=0, epoch=1, state=pb.SERVING)
    metadata = signed_with(server, own_key, "worker-0-1", "Heartbeat", request)
    code, details = refused(server, None, "Heartbeat", request, metadata)
    assert code == grpc.StatusCode.UNAUTHENTICATED
    assert details == "bad MAC: the caller does not hold the key of worker-0-1"
    # The cluster secret, which every worker holds, does not sign a worker's call.
    request = pb.HeartbeatRequest(worker_id=0, epoch=1, state=pb.SERVING)
    code, details = refused(
        server, None, "Heartbeat", request, signed_with(server, SECRET, "cluster", "Heartbeat", request)
    )
    assert code == grpc.StatusCode.PERMISSION_DENIED and "got cluster's" in details
    assert server.coordinator.worker_state(0) == "serving" and not victim.heartbeat().fenced
    assert metrics(server)["lumen_forbidden_calls_total"] == 7


def test_a_worker_cannot_put_a_token_into_a_request_it_does_not_serve(start_gateway, connect):
    server = start_gateway(GatewayConfig(policy="S&R"), metrics_port=0)
    victim, rogue = connect(server), connect(server)
    victim.register(0, budget_bytes=GIB)
    rogue.register(1, budget_bytes=GIB)
    stream = connect(server).submit([1, 2], 4, timeout_s=30.0)
    request_id = next(stream).request_id
    assert [d.request_id for d in victim.heartbeat().directives if isinstance(d, Run)] == [request_id]
    # As itself: the request is not its own (acked refused, counted).
    ack = rogue.report_tokens_batch([RequestTokens(request_id, 1, 0, (66,))])[0]
    assert ack.code == grpc.StatusCode.FAILED_PRECONDITION.value[0] and "is stale" in ack.details
    # Naming the victim in the body, signed with its own key: the whole call is refused.
    report = pb.TokenReport(
        worker_id=0,
        worker_epoch=1,
        requests=[pb.RequestTokens(request_id=request_id, epoch=1, token_ids=[66])],
    )
    code, details = refused(server, rogue, "ReportTokens", report)
    assert code == grpc.StatusCode.PERMISSION_DENIED and "got worker-1-1's" in details
    # Claiming the victim's principal: it does not hold the victim's key.
    metadata = signed_with(
        server, server.credentials.key_of("worker-1-1"), "worker-0-1", "ReportTokens", report
    )
    code, details = refused(server, None, "ReportTokens", report, metadata)
    assert code == grpc.StatusCode.UNAUTHENTICATED and details.startswith("bad MAC")
    victim.report_tokens(request_id, 1, 0, [7, 8], finished=True)
    assert [t for chunk in stream for t in chunk.token_ids] == [7, 8]
    values = metrics(server)
    assert values["lumen_refused_token_reports_total"] == 2
    assert server.num_refused_token_reports == 2 and server.num_refused_calls == 1


def test_a_call_captured_at_one_gateway_is_refused_by_its_restarted_successor(start_gateway, connect):
    first = start_gateway(GatewayConfig(policy="S&R"))
    client, worker = connect(first), connect(first)
    worker.register(5, budget_bytes=GIB)
    request = pb.RegisterRequest(worker_id=0, state=pb.SERVING, budget_bytes=GIB, **EXCHANGE)
    captured = client.signed_metadata("Register", request.SerializeToString())
    raw_call(first, None, "Register", request, captured)
    code, details = refused(first, None, "Register", request, captured)
    assert code == grpc.StatusCode.UNAUTHENTICATED and details == "nonce replayed"
    port = first.port
    first.stop(grace_s=0.1)
    restarted = start_gateway(GatewayConfig(policy="S&R"), port=port)
    with grpc.insecure_channel(restarted.address) as channel, pytest.raises(grpc.RpcError) as info:
        pb_grpc.GatewayStub(channel).Register(request, metadata=captured, timeout=5.0)
    error = info.value
    assert error.code() == grpc.StatusCode.UNAUTHENTICATED
    assert f"this is {restarted.instance_id}" in error.details()
    assert dict(error.trailing_metadata())[INSTANCE_METADATA_KEY] == restarted.instance_id
    assert restarted.coordinator.worker_ids() == []
    # The body is covered too: the captured header with another body is refused.
    other = pb.RegisterRequest(worker_id=1, state=pb.SERVING, budget_bytes=GIB, **EXCHANGE)
    fresh = connect(restarted).signed_metadata("Register", request.SerializeToString())
    code, details = refused(restarted, None, "Register", other, fresh)
    assert code == grpc.StatusCode.UNAUTHENTICATED and details.startswith("bad MAC")
    # A client of the old instance signs again for the new one, and its worker registers again.
    assert client.status().workers == []
    assert worker.heartbeat().reregister
    assert worker.register_again().epoch == 2  # above the epoch it reports having held
    assert not worker.heartbeat().fenced


def test_one_out_of_range_field_fails_its_call_alone(start_gateway, connect):
    server = start_gateway(GatewayConfig(policy="S&R"))
    worker, bad = connect(server), connect(server)
    worker.register(0, budget_bytes=GIB)
    for request, match in (
        (
            pb.RegisterRequest(worker_id=1, state=pb.SERVING, budget_bytes=2**63),
            r"`budget_bytes` must be in \[0, 9007199254740992\]",
        ),
        (
            pb.RegisterRequest(worker_id=1, state=pb.SERVING, budget_bytes=2**64 - 1),
            "got 18446744073709551615",
        ),
        (
            pb.RegisterRequest(worker_id=1, state=pb.SERVING, last_epoch=2**32 - 1),
            r"`last_epoch` must be in \[0, 4294967294\]",
        ),
        (
            pb.RegisterRequest(worker_id=1, state=pb.SERVING, num_shards=2**20),
            r"`num_shards` must be in \[0, 1024\]",
        ),
        (
            pb.RegisterRequest(
                worker_id=1, held=[pb.HeldCheckpoint(request_id=1, epoch=1, durable_tokens=2**63)]
            ),
            r"`held.durable_tokens` must be in \[0, 4294967295\]",
        ),
        (  # new requests are numbered above it: the next Submit could not be answered
            pb.RegisterRequest(
                worker_id=1, state=pb.SERVING, running=[pb.RunningRequest(request_id=2**64 - 1, epoch=1)]
            ),
            r"`running.request_id` must be in \[0, 9223372036854775807\]",
        ),
        (
            pb.RegisterRequest(
                worker_id=1, state=pb.SERVING, running=[pb.RunningRequest(request_id=9, epoch=2**32 - 1)]
            ),
            r"`running.epoch` must be in \[0, 4294967294\]",
        ),
        (pb.RegisterRequest(worker_id=1, state=pb.SERVING), "`exchange_public_key` must be 32 bytes, got 0"),
        (
            pb.RegisterRequest(worker_id=1, state=pb.SERVING, identity_public_key=bytes(31), **EXCHANGE),
            "`identity_public_key` must be empty or 32 bytes, got 31",
        ),
        (  # a low-order point: its shared secret with any key is zero, so the wrap would be no secret
            pb.RegisterRequest(worker_id=1, state=pb.SERVING, exchange_public_key=bytes(32)),
            "`exchange_public_key` must be a usable X25519 public key",
        ),
    ):
        code, details = refused(server, bad, "Register", request)
        assert code == grpc.StatusCode.INVALID_ARGUMENT and re.search(match, details), details
    with pytest.raises(GatewayError, match=r"INVALID_ARGUMENT: `report.held.durable_tokens` must be in"):
        worker.heartbeat(WorkerReport(held=(HeldReport(1, 1, 2**63 - 1),)))
    with pytest.raises(GatewayError, match=r"INVALID_ARGUMENT: `report.held_bytes` must be in"):
        worker.heartbeat(WorkerReport(held_bytes=2**64 - 1))
    # Nothing of the bad calls stayed behind: everyone else is served as before.
    assert server.coordinator.worker_ids() == [0]
    assert [(w.worker_id, w.epoch) for w in connect(server).status().workers] == [(0, 1)]
    stream = connect(server).submit([1, 2], 2, timeout_s=30.0)
    request_id = next(stream).request_id
    worker.report_tokens(request_id, 1, 0, [3, 4], finished=True)
    assert [t for chunk in stream for t in chunk.token_ids] == [3, 4]


def test_capabilities_are_bound_to_a_worker_that_registers_an_identity(start_gateway, connect):
    server = start_gateway(GatewayConfig(policy="LUMEN"))
    identity = WorkerIdentity()
    bound = connect(server, identity=identity)
    plain = connect(server)
    bound.register(0, budget_bytes=GIB, holder_address="127.0.0.1:7000")
    plain.register(1, budget_bytes=GIB, holder_address="127.0.0.1:7001")
    # The credential names this process's key and worker, signed by the gateway's issuer.
    fields = verify_credential(server.coordinator.issuer_public_key, identity.credential)
    assert (fields.worker_id, fields.epoch, fields.public_key) == (0, 1, identity.public_key)
    client = connect(server)
    streams = [client.submit([1, 2, 3], 8, timeout_s=30.0) for _ in range(4)]
    for stream in streams:
        next(stream)
    issuer_key = server.coordinator.issuer_public_key
    bearers = {
        worker_id: {
            verify_capability(issuer_key, capability).bearer
            for run in worker.heartbeat().directives
            if isinstance(run, Run)
            for holder in run.holders
            for capability in holder.capabilities
        }
        for worker_id, worker in ((0, bound), (1, plain))
    }
    # Each worker's requests stream to the other's holder; a worker without an identity gets
    # capabilities any authenticated connection may use.
    assert bearers == {0: {0}, 1: {None}}
