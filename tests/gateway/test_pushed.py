"""The pushed directive channel over real gRPC: directives leave when decided, heartbeat
replies stay the fallback when the stream is down or refused, and a stream that drops and
reopens loses and repeats nothing."""

import threading
import time

import grpc
import pytest

from lumen_core.gateway import lumen_pb2 as pb
from lumen_core.gateway import lumen_pb2_grpc as pb_grpc
from lumen_core.gateway.client import FencedError
from lumen_core.gateway.config import GatewayConfig
from lumen_core.gateway.directives import Run
from lumen_core.gateway.errors import GatewayError, StaleEpochError
from lumen_core.gateway.heartbeat import HeartbeatLoop
from lumen_core.gateway.reports import WorkerReport
from lumen_core.testing import wait_until

pytestmark = pytest.mark.timeout(60)

GIB = 1 << 30


def runs(directives):
    return [d.request_id for d in directives if isinstance(d, Run)]


def submit(client):
    stream = client.submit([1, 2], 4, timeout_s=30.0)
    request_id = next(stream).request_id
    stream.close()
    return request_id


@pytest.mark.parametrize("pushed", [True, False])
def test_a_run_arrives_pushed_at_once_or_with_the_next_heartbeat(start_gateway, connect, pushed):
    # Heartbeats every 2 s: a directive that arrives well within that was pushed.
    server = start_gateway(GatewayConfig(policy="S&R", lease_s=10.0, heartbeat_s=2.0))
    worker = connect(server)
    worker.register(0, budget_bytes=GIB)
    received = []
    loop = HeartbeatLoop(worker, WorkerReport, received.extend, print, pushed=pushed).start()
    try:
        time.sleep(0.3)  # the stream is open (pushed) before the request exists
        started = time.monotonic()
        request_id = submit(connect(server))
        assert wait_until(lambda: runs(received) == [request_id], timeout_s=10.0)
        waited_s = time.monotonic() - started
        if pushed:
            assert waited_s < 1.0 and loop.num_stream_errors == 0
        else:
            assert waited_s > 0.5  # it waited for the heartbeat (on average half a period)
    finally:
        loop.stop()
    assert runs(received) == [request_id]  # once, though both paths could carry it


def test_heartbeats_deliver_when_the_gateway_refuses_streams(start_gateway, connect):
    server = start_gateway(GatewayConfig(policy="S&R", heartbeat_s=0.05), push_directives=False)
    worker = connect(server)
    worker.register(0, budget_bytes=GIB)
    received = []
    loop = HeartbeatLoop(worker, WorkerReport, received.extend, print).start()
    try:
        request_ids = [submit(connect(server)) for _ in range(3)]
        assert wait_until(lambda: runs(received) == request_ids)
        assert wait_until(lambda: loop.num_stream_errors >= 2)  # it keeps trying, backing off
    finally:
        loop.stop()
    with pytest.raises(GatewayError, match="UNIMPLEMENTED: pushed directives are off"):
        worker.receive_directives(print)


def test_a_stream_that_keeps_dropping_loses_and_repeats_nothing(start_gateway, connect):
    # Heartbeats back to back: replies often carry directives the stream pushed too.
    server = start_gateway(GatewayConfig(policy="S&R", heartbeat_s=0.002))
    worker = connect(server)
    worker.register(0, budget_bytes=GIB)
    received = []
    loop = HeartbeatLoop(worker, WorkerReport, received.extend, print).start()
    submitter = connect(server)
    request_ids = []
    try:
        while len(request_ids) < 30 or (worker.inbox.num_repeated == 0 and len(request_ids) < 300):
            request_ids.append(submit(submitter))
            if len(request_ids) % 3 == 0:
                worker.cancel_directives()  # the stream drops; the loop reopens it
        assert wait_until(lambda: len(runs(received)) >= len(request_ids))
        time.sleep(0.3)  # more heartbeats and reopened streams: nothing comes twice
    finally:
        loop.stop()
    assert worker.inbox.num_repeated > 0  # both paths carried some directive
    assert runs(received) == request_ids
    assert worker.inbox.sequence == len(request_ids)


def test_each_delivery_path_resumes_after_the_last_applied_number(start_gateway, connect):
    server = start_gateway(GatewayConfig(policy="S&R"))
    worker = connect(server)
    worker.register(0, budget_bytes=GIB)
    submitter = connect(server)
    first = submit(submitter)
    assert runs(worker.heartbeat().directives) == [first]  # applied: acked by the next heartbeat
    second = submit(submitter)
    received = []
    thread = threading.Thread(target=worker.receive_directives, args=(received.extend,))
    thread.start()
    try:
        assert wait_until(lambda: runs(received) == [second])  # the stream starts after 1
        third = submit(submitter)
        assert wait_until(lambda: runs(received) == [second, third])
        assert worker.heartbeat().directives == ()  # the reply's copies were applied already
        with server.condition:
            assert server.coordinator.directives_after(0, 0) == []  # acknowledged: forgotten
    finally:
        worker.cancel_directives()
        thread.join(10.0)
    assert not thread.is_alive()


def test_a_newer_stream_ends_the_older_and_a_fenced_epoch_gets_none(start_gateway, connect):
    server = start_gateway(GatewayConfig(policy="S&R"))
    worker = connect(server)
    worker.register(0, budget_bytes=GIB)
    older = threading.Thread(target=worker.receive_directives, args=(print,))
    older.start()
    assert wait_until(lambda: server.num_directive_streams == 1)
    newer_received, newer_errors = [], []

    def receive_newer():
        try:
            worker.receive_directives(newer_received.extend)
        except StaleEpochError as exc:
            newer_errors.append(exc)

    newer = threading.Thread(target=receive_newer)
    newer.start()
    older.join(10.0)
    assert not older.is_alive()  # the gateway ended it: one stream (one thread) per worker
    assert wait_until(lambda: server.num_directive_streams == 1)
    request_id = submit(connect(server))
    assert wait_until(lambda: runs(newer_received) == [request_id])
    assert server.report_exit(0, 1, "restarted")  # its supervisor: the old epoch is fenced
    connect(server).register(0, budget_bytes=GIB)  # the new incarnation
    newer.join(10.0)
    assert not newer.is_alive() and "epoch 1 is fenced" in str(newer_errors[0])
    with pytest.raises(StaleEpochError, match="FAILED_PRECONDITION: worker 0 epoch 1 is fenced"):
        worker.receive_directives(print)
    assert wait_until(lambda: server.num_directive_streams == 0)


def test_directive_streams_are_authenticated_validated_and_capped(start_gateway, connect):
    from lumen_core.gateway.server import GatewayServer

    with pytest.raises(ValueError, match="`max_workers` must be >= 1, got 0"):
        GatewayServer(GatewayConfig(), b"directive-tests-secret-0123456789", max_workers=0)
    server = start_gateway(GatewayConfig(policy="S&R"), max_workers=1)
    signed = connect(server)
    signed.register(5, budget_bytes=GIB)
    with grpc.insecure_channel(server.address) as channel:
        stub = pb_grpc.GatewayStub(channel)
        for request, match in (
            (pb.DirectivesRequest(worker_id=-1), "worker -1 epoch 0's call key, got worker-5-1's"),
            (pb.DirectivesRequest(worker_id=0, epoch=1), "worker 0 epoch 1's call key, got worker-5-1's"),
        ):
            metadata = signed.signed_metadata("Directives", request.SerializeToString())
            with pytest.raises(grpc.RpcError) as info:
                next(stub.Directives(request, metadata=metadata))
            assert info.value.code() == grpc.StatusCode.PERMISSION_DENIED
            assert match in info.value.details()
        with pytest.raises(grpc.RpcError) as info:
            next(stub.Directives(pb.DirectivesRequest(), timeout=5.0))
        assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
    rogue = connect(server)
    rogue.worker_id = 0
    with pytest.raises(FencedError, match="receive_directives before register"):
        rogue.receive_directives(print)
    first, second = connect(server), connect(server)
    first.register(0, budget_bytes=GIB)
    second.register(1, budget_bytes=GIB)
    thread = threading.Thread(target=first.receive_directives, args=(print,))
    thread.start()
    try:
        assert wait_until(lambda: server.num_directive_streams == 1)
        with pytest.raises(
            GatewayError, match=r"RESOURCE_EXHAUSTED: 1 directive streams open \(max_workers\)"
        ):
            second.receive_directives(print)
        assert not second.heartbeat().fenced  # its heartbeats still deliver
    finally:
        first.cancel_directives()
        thread.join(10.0)
