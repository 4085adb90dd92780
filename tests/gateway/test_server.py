"""The gateway over real gRPC on loopback, driven by real GatewayClients (the worker's API)."""

import time
import urllib.request

import grpc
import pytest

from lumen_core.auth import Rights, generate_exchange_key
from lumen_core.gateway import lumen_pb2 as pb
from lumen_core.gateway import lumen_pb2_grpc as pb_grpc
from lumen_core.gateway.client import FencedError
from lumen_core.gateway.config import GatewayConfig
from lumen_core.gateway.directives import (
    AssistDraft,
    AssistStop,
    AssistVerify,
    Hold,
    Release,
    Resume,
    Run,
    Stream,
)
from lumen_core.gateway.errors import AuthError, GatewayError, StaleEpochError
from lumen_core.gateway.reports import HeldReport, RunningReport, WorkerReport
from lumen_core.policy.events import RecoveryAction, WorkerState
from lumen_core.testing import wait_until

pytestmark = pytest.mark.timeout(60)

SECRET = b"gateway-tests-secret-0123456789abcdef"  # as conftest.py
GIB = 1 << 30


def register_workers(server, connect, num_workers, **kwargs):
    workers = []
    for worker_id in range(num_workers):
        client = connect(server)
        registered = client.register(
            worker_id, budget_bytes=64 * GIB, holder_address=f"127.0.0.1:{7000 + worker_id}", **kwargs
        )
        # every holder learns the key the gateway's capabilities verify with
        assert registered.issuer_public_key == server.coordinator.issuer_public_key
        workers.append(client)
    return workers


def directives_of(worker, kind, **report):
    """Heartbeat once and keep the directives of one kind (the others are dropped)."""
    return [d for d in worker.heartbeat(WorkerReport(**report)).directives if isinstance(d, kind)]


def drain(workers):
    """Heartbeat every worker once: {worker index: its directives}."""
    return {w: list(worker.heartbeat().directives) for w, worker in enumerate(workers)}


def of_kind(directives, kind):
    return [d for d in directives if isinstance(d, kind)]


def test_a_client_without_the_secret_is_refused(start_gateway, connect):
    server = start_gateway()
    rogue = connect(server, secret=b"not-the-cluster-secret-at-all!!")
    with pytest.raises(AuthError, match="UNAUTHENTICATED: bad MAC"):
        rogue.register(0, budget_bytes=GIB)
    with pytest.raises(AuthError, match="UNAUTHENTICATED"):
        list(rogue.submit([1, 2, 3], 4, timeout_s=5.0))
    with grpc.insecure_channel(server.address) as channel:  # no metadata at all
        with pytest.raises(grpc.RpcError) as info:
            pb_grpc.GatewayStub(channel).Status(pb.StatusRequest(), timeout=5.0)
        assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert "missing lumen-call-v3" in info.value.details()
    assert server.num_refused_calls == 3
    assert server.coordinator.worker_ids() == []
    assert connect(server).status().workers == []  # the real secret still works


def test_submit_streams_tokens_once_per_position_and_grants_capabilities(start_gateway, connect, granted):
    server = start_gateway(GatewayConfig(policy="LUMEN"))
    workers = register_workers(server, connect, 3)
    client = connect(server)
    stream = client.submit([11, 12, 13], 6, timeout_s=30.0)
    request_id = next(stream).request_id
    got = drain(workers)
    serving_id = next(w for w, d in got.items() if of_kind(d, Run))
    (run,) = of_kind(got[serving_id], Run)
    assert run.request_id == request_id and run.prompt_token_ids == (11, 12, 13) and run.epoch == 1
    (grant,) = run.holders
    assert grant.worker_id != serving_id and grant.address == f"127.0.0.1:{7000 + grant.worker_id}"
    key = server.coordinator.issuer_public_key
    assert granted(key, grant.capabilities) == [
        (request_id, 0, 1, grant.worker_id, Rights.WRITE | Rights.READ)
    ]
    holds = of_kind(got[grant.worker_id], Hold)
    assert [h.request_id for h in holds] == [request_id] and holds[0].serving_worker_id == serving_id

    worker = workers[serving_id]
    assert worker.report_tokens(request_id, 1, 0, [5, 6, 7]).num_new == 3
    ack = worker.report_tokens(request_id, 1, 1, [6, 9, 8, 4])  # overlap: 6 matches, 9 conflicts
    assert (ack.num_new, ack.num_conflicts, ack.next_position) == (2, 1, 5)
    with pytest.raises(GatewayError, match="INVALID_ARGUMENT: start_position must be <= 5"):
        worker.report_tokens(request_id, 1, 7, [1])
    worker.report_tokens(request_id, 1, 5, [3], finished=True)
    chunks = list(stream)
    positions = [c.start_position + i for c in chunks for i in range(len(c.token_ids))]
    assert positions == list(range(6))
    assert [t for c in chunks for t in c.token_ids] == [5, 6, 7, 8, 4, 3]
    assert chunks[-1].finished
    replay = [t for c in client.watch(request_id, 2, timeout_s=5.0) for t in c.token_ids]
    assert replay == [7, 8, 4, 3]
    released = directives_of(workers[grant.worker_id], Release)
    assert [d.request_id for d in released] == [request_id]


def test_submit_without_a_serving_worker_is_unavailable(start_gateway, connect):
    server = start_gateway()
    with pytest.raises(GatewayError, match="UNAVAILABLE: no worker is serving"):
        list(connect(server).submit([1], 1, timeout_s=5.0))


def test_a_stale_epoch_is_refused_and_the_old_incarnation_is_fenced(start_gateway, connect):
    server = start_gateway(GatewayConfig(policy="FC"))
    old, other = register_workers(server, connect, 2)
    stream = connect(server).submit([1, 2], 4, timeout_s=30.0)
    request_id = next(stream).request_id
    assert directives_of(old, Run)[0].request_id == request_id
    old.report_tokens(request_id, 1, 0, [7])
    # The worker process restarted before its lease ran out: the cluster secret alone does
    # not let the new process take the live worker id over; its supervisor reports the exit.
    new = connect(server)
    with pytest.raises(GatewayError, match="ALREADY_EXISTS: worker 0 epoch 1 is live"):
        new.register(0, budget_bytes=GIB)
    assert server.report_exit(0, 1, "restarted")
    assert new.register(0, budget_bytes=GIB).epoch == 2
    assert old.lease_valid()  # it has not heard yet
    with pytest.raises(StaleEpochError, match="FAILED_PRECONDITION: worker 0 epoch 1 is fenced"):
        old.report_tokens(request_id, 1, 1, [8])
    reply = old.heartbeat()
    assert reply.fenced and "epoch 1 is stale" in reply.reason
    assert not old.lease_valid()
    with pytest.raises(FencedError, match="holds no lease"):
        old.report_tokens(request_id, 1, 1, [8])
    # The request moved on at epoch 2; a report at its old epoch is refused too.
    resume = directives_of(other, Resume)[0]
    assert (resume.request_id, resume.epoch, resume.output_token_ids) == (request_id, 2, (7,))
    with pytest.raises(StaleEpochError, match="epoch 1 on worker 1 is stale"):
        other.report_tokens(request_id, 1, 1, [8])
    other.report_tokens(request_id, 2, 0, [7, 8, 9, 10], finished=True)
    assert [t for c in stream for t in c.token_ids] == [7, 8, 9, 10]


def test_lease_expiry_fences_a_live_worker_and_its_requests_move(start_gateway, connect, granted):
    # FC: always back to the holder. 1 s: the others' heartbeats (every 50 ms) keep theirs
    # even when the shared machine stalls this process for a while.
    config = GatewayConfig(policy="FC", lease_s=1.0, heartbeat_s=0.1)
    server = start_gateway(config, reap_interval_s=0.02)
    silent, survivor, third = register_workers(server, connect, 3)
    stream = connect(server).submit([3, 1, 4, 1, 5], 8, timeout_s=30.0)
    request_id = next(stream).request_id
    got = drain([silent, survivor, third])
    assert of_kind(got[0], Run)[0].request_id == request_id  # lowest id among equals
    silent.report_tokens(request_id, 1, 0, [2, 7])
    assert of_kind(got[1], Hold)  # FC: the next worker holds it
    holder = survivor
    holder.heartbeat(WorkerReport(held=(HeldReport(request_id, 1, 6),)))

    received = {survivor: [], third: []}

    def others_heartbeat_until_silent_fails():
        for worker, directives in received.items():
            directives.extend(worker.heartbeat().directives)
        return server.coordinator.worker_state(0) == "failed"

    assert wait_until(others_heartbeat_until_silent_fails, timeout_s=10.0, poll_s=0.05)
    assert not silent.lease_valid()  # its own deadline passed too: it fenced itself
    reply = silent.heartbeat()  # alive, but the lease is gone: the reply tells it
    assert reply.fenced and "lease expired" in reply.reason
    with pytest.raises(FencedError):
        silent.report_tokens(request_id, 1, 2, [1])
    (resume,) = of_kind(received[holder] + list(holder.heartbeat().directives), Resume)
    assert resume.action is RecoveryAction.RESTORE
    assert server.coordinator.failures[0].routes[0].restorable_tokens == 6
    assert resume.source.worker_id == server.coordinator.request_worker(request_id)[0]
    assert granted(server.coordinator.issuer_public_key, resume.source.capabilities) == [
        (request_id, 0, 2, resume.source.worker_id, Rights.READ)
    ]
    holder.report_tokens(request_id, 2, 0, [2, 7, 1, 8], finished=True)
    assert [t for c in stream for t in c.token_ids] == [2, 7, 1, 8]
    metrics = server.coordinator.metrics()
    assert metrics.num_failures == 1 and metrics.recovery_s > 0


def test_process_exit_routes_restores_and_replaces_a_dead_holders_checkpoints(start_gateway, connect):
    server = start_gateway(GatewayConfig(policy="LUMEN"))
    workers = register_workers(server, connect, 4)
    client = connect(server)
    streams = [client.submit([1] * 40, 16, timeout_s=30.0) for _ in range(2)]
    request_ids = [next(s).request_id for s in streams]
    got = drain(workers)
    serving = {d.request_id: w for w in got for d in of_kind(got[w], Run)}
    holders = {}
    for w, worker in enumerate(workers):
        held = tuple(HeldReport(d.request_id, 1, 40) for d in of_kind(got[w], Hold))
        holders.update({h.request_id: w for h in held})
        worker.heartbeat(WorkerReport(held=held))
    first, second = request_ids
    # The serving worker of the first request exits: it is restored on its holder.
    # Each exit is reported with the incarnation's own call key (its supervisor's copy).
    assert workers[serving[first]].report_exit(serving[first], 1, "SIGKILL")
    assert not workers[serving[first]].report_exit(serving[first], 1, "SIGKILL")  # already failed
    (failure,) = server.coordinator.failures
    assert "process exited: SIGKILL" in failure.cause
    route = next(r for r in failure.routes if r.request_id == first)
    assert route.action is RecoveryAction.RESTORE and route.target_worker_id == holders[first]
    resume = next(d for d in directives_of(workers[holders[first]], Resume) if d.request_id == first)
    assert resume.epoch == 2 and resume.source.worker_id == holders[first]
    # A holder that dies leaves its checkpoints re-placed and streamed again in full.
    live_holder = holders[second]
    assert live_holder not in (serving[first], serving[second])  # LoadAware spread them
    assert workers[live_holder].report_exit(live_holder, 1, "SIGKILL")
    replaced = [d for d in server.coordinator.failures[-1].replacements if d.request_id == second]
    assert replaced and replaced[0].new_holder_ids and live_holder not in replaced[0].holder_ids
    new_holder = replaced[0].new_holder_ids[0]
    got = drain(workers)
    streams_to = [d for d in of_kind(got[serving[second]], Stream) if d.request_id == second]
    assert [g.worker_id for g in streams_to[0].holders] == [new_holder]
    assert any(d.request_id == second for d in of_kind(got[new_holder], Hold))


def test_assist_pairing_then_switch_over(start_gateway, connect):
    server = start_gateway(GatewayConfig(policy="LUMEN"))
    workers = register_workers(server, connect, 3)
    workers[2].heartbeat(WorkerReport(num_running=6))
    workers[1].heartbeat(WorkerReport(num_running=2))
    assert workers[0].report_exit(0, 1, "SIGKILL")
    restarted = connect(server)
    registration = restarted.register(0, state=WorkerState.RECOVERING, holder_address="127.0.0.1:7100")
    assert registration.epoch == 2
    (draft,) = [d for d in registration.directives if isinstance(d, AssistDraft)]
    assert draft.survivor_id == 2 and draft.num_draft_tokens == 2  # most loaded; cold k
    (verify,) = directives_of(workers[2], AssistVerify)
    assert verify.assistant_id == 0 and verify.assistant_address == "127.0.0.1:7100"
    reply = restarted.heartbeat(
        WorkerReport(assist_steps=150, proposed_draft_tokens=40, accepted_draft_tokens=30)
    )
    assert not reply.fenced and reply.num_draft_tokens == 4  # warm k after cold_steps
    assert server.coordinator.metrics().acceptance == pytest.approx(0.75)
    assert restarted.model_loaded(budget_bytes=64 * GIB) == 2
    (stop,) = directives_of(workers[2], AssistStop)
    assert stop.peer_worker_id == 0
    assert server.coordinator.worker_state(0) == "serving"
    with pytest.raises(GatewayError, match="INVALID_ARGUMENT: worker_id must be a recovering worker"):
        restarted.model_loaded(budget_bytes=GIB)


def test_metrics_endpoint_serves_the_shared_metrics_on_loopback(start_gateway, connect):
    server = start_gateway(GatewayConfig(policy="LUMEN"), metrics_port=0)
    workers = register_workers(server, connect, 3)
    stream = connect(server).submit([1] * 100, 10, timeout_s=30.0)
    assert next(stream).request_id == 1
    got = drain(workers)
    for w, worker in enumerate(workers):
        held = tuple(HeldReport(d.request_id, 1, 100) for d in of_kind(got[w], Hold))
        num_running = 1 if worker is workers[0] else 0
        worker.heartbeat(WorkerReport(num_running=num_running, held=held, held_bytes=100 * 4096 * len(held)))
    text = (
        urllib.request.urlopen(f"http://127.0.0.1:{server.metrics_port}/metrics", timeout=5).read().decode()
    )
    values = {
        line.split(" ")[0]: float(line.split(" ")[1])
        for line in text.splitlines()
        if line.startswith("lumen_")
    }
    assert values["lumen_checkpoint_coverage"] == 1.0
    assert values["lumen_holder_balance_ratio"] == float("inf")  # one holder has it all, one none
    assert values['lumen_worker_queue_depth{worker="0"}'] == 1.0
    load = server.coordinator.monitor.load(1)
    assert values['lumen_worker_load{worker="1"}'] == pytest.approx(load) and load > 0
    assert values['lumen_worker_held_checkpoint_bytes{worker="1"}'] == 409600.0
    assert values['lumen_worker_state{state="serving",worker="0"}'] == 1.0
    assert values["lumen_failures"] == 0.0


def test_gateway_restart_rebuilds_state_from_worker_reports(start_gateway, connect):
    config = GatewayConfig(policy="LUMEN")
    first = start_gateway(config)
    workers = register_workers(first, connect, 3)
    stream = connect(first).submit([9, 8, 7, 6], 8, timeout_s=30.0)
    request_id = next(stream).request_id
    got = drain(workers)
    serving_id = next(w for w in got if of_kind(got[w], Run))
    holder_id = next(w for w in got if of_kind(got[w], Hold))
    workers[serving_id].report_tokens(request_id, 1, 0, [1, 2, 3])
    workers[holder_id].heartbeat(WorkerReport(held=(HeldReport(request_id, 1, 6),)))
    stream.close()
    port = first.port
    first.stop(grace_s=0.1)

    second = start_gateway(config, port=port, first_request_id=1000)
    assert second.coordinator.worker_ids() == []
    for w, worker in enumerate(workers):
        reply = worker.heartbeat()
        assert reply.reregister and not reply.fenced and "re-register" in reply.reason
        running = []
        if w == serving_id:
            running = [RunningReport(request_id, 1, (9, 8, 7, 6), (1, 2, 3), 8, 8)]
        held = [HeldReport(request_id, 1, 6)] if w == holder_id else []
        old_epoch = worker.epoch
        registration = worker.register(w, budget_bytes=64 * GIB, running=running, held=held)
        assert registration.epoch == old_epoch + 1
    monitor = second.coordinator.monitor
    view = monitor.request(request_id)
    assert view.worker_id == serving_id and view.durable_tokens == ((holder_id, 6),)
    assert second.coordinator.request_worker(request_id) == (serving_id, 1)
    watched = connect(second).watch(request_id, timeout_s=30.0)
    assert next(watched).token_ids == (1, 2, 3)
    workers[serving_id].report_tokens(request_id, 1, 3, [4])  # same request epoch: accepted
    assert next(watched).token_ids == (4,)
    assert workers[serving_id].report_exit(serving_id, workers[serving_id].epoch, "SIGKILL")
    (failure_route,) = second.coordinator.failures[0].routes
    assert failure_route.action is RecoveryAction.RESTORE and failure_route.restorable_tokens == 6
    resumed = [d for d in workers[holder_id].heartbeat().directives if isinstance(d, Resume)]
    assert resumed[0].output_token_ids == (1, 2, 3, 4)
    workers[holder_id].report_tokens(request_id, 2, 4, [5], finished=True)
    assert [c.token_ids for c in watched] == [(5,)]
    assert next(connect(second).submit([1], 1, timeout_s=5.0)).request_id == 1000


def test_a_request_whose_last_worker_dies_is_parked_then_ends_with_the_bound_named(start_gateway, connect):
    # Parked (the stream stays open) until the reaper finds it past park_leases x lease_s.
    config = GatewayConfig(policy="S&R", lease_s=1.0, heartbeat_s=0.25, park_leases=0.5)
    server = start_gateway(config, reap_interval_s=0.02)
    (worker,) = register_workers(server, connect, 1)
    stream = connect(server).submit([1, 2], 4, timeout_s=30.0)
    request_id = next(stream).request_id
    worker.report_tokens(request_id, 1, 0, [6])
    assert next(stream).token_ids == (6,)
    assert worker.report_exit(0, 1, "SIGKILL")
    with server.condition:
        assert server.coordinator.metrics().num_parked == 1
    with pytest.raises(
        GatewayError,
        match=rf"UNAVAILABLE: request {request_id} lost: parked 0\.\d s \(park_leases 0\.5 x lease 1\.0 s\)",
    ):
        next(stream)


def test_a_request_its_worker_refuses_ends_the_clients_streams_with_the_error(start_gateway, connect):
    server = start_gateway(GatewayConfig(policy="FC"))
    workers = register_workers(server, connect, 2)
    client = connect(server)
    stream = client.submit([1, 2], 4, timeout_s=30.0)
    request_id = next(stream).request_id
    serving_id, epoch = server.coordinator.request_worker(request_id)
    worker = workers[serving_id]
    worker.report_tokens(request_id, epoch, 0, [6])
    assert next(stream).token_ids == (6,)
    with server.condition:
        (holder_id,) = server.coordinator.monitor.request(request_id).holder_ids
    # A stale epoch's error is refused in its ack; the request goes on.
    with pytest.raises(StaleEpochError, match=f"request {request_id} epoch {epoch + 1} on worker"):
        worker.report_tokens(request_id, epoch + 1, 1, [], error="refused")
    assert server.coordinator.tokens(request_id) == ((6,), False, False)
    error = "the server answered 400: " + "prompt too long\n" * 40  # cut by the client to 512
    worker.report_tokens(request_id, epoch, 1, [], error=error)
    reason = (
        rf"INVALID_ARGUMENT: request {request_id} lost: worker {serving_id} refused it: "
        r"the server answered 400: "
    )
    for tokens in (stream, client.watch(request_id, 1, timeout_s=30.0)):  # the one waiting, a new one
        with pytest.raises(GatewayError, match=reason + r"(prompt too long\?)+") as ended:
            next(tokens)
        assert (
            len(ended.value.details)
            == len(f"request {request_id} lost: worker {serving_id} refused it: ") + 512
        )
    assert [d.request_id for d in directives_of(workers[holder_id], Release)] == [request_id]


def test_parse_address():
    from lumen_core.gateway.protocol import parse_address

    assert parse_address("127.0.0.1:7000") == ("127.0.0.1", 7000)
    for bad in ("127.0.0.1", ":7000", "host:0", "host:70000", "host:x"):
        with pytest.raises(ValueError, match="address must be 'host:port'"):
            parse_address(bad)
    with pytest.raises(TypeError, match="address must be a str, got int"):
        parse_address(7000)


def test_server_and_client_validation(start_gateway, connect):
    from lumen_core.gateway.client import GatewayClient
    from lumen_core.gateway.protocol import state_to_pb
    from lumen_core.gateway.server import GatewayServer

    with pytest.raises(TypeError, match="host must be a str, got int"):
        GatewayServer(GatewayConfig(), SECRET, host=127)
    with pytest.raises(ValueError, match=r"port must be an int in \[0, 65535\], got 70000"):
        GatewayServer(GatewayConfig(), SECRET, port=70000)
    with pytest.raises(
        ValueError, match="`secret` must be given, got None: there is no default cluster secret"
    ):
        GatewayServer(GatewayConfig(), None)
    with pytest.raises(TypeError, match="address must be a str, got int"):
        GatewayClient(5, SECRET)
    with pytest.raises(ValueError, match="`timeout_s` must be > 0, got 0"):
        GatewayClient("127.0.0.1:1", SECRET, timeout_s=0)
    with pytest.raises(ValueError, match="`secret` must be given"):
        GatewayClient("127.0.0.1:1", None)
    with pytest.raises(ValueError, match="state must be 'serving' or 'recovering', got 'failed'"):
        state_to_pb("failed")
    server = start_gateway()
    assert server.address.startswith("127.0.0.1:")
    client = connect(server)
    with pytest.raises(FencedError, match="heartbeat before register"):
        client.heartbeat()
    with pytest.raises(GatewayError, match="INVALID_ARGUMENT: state must be SERVING or RECOVERING, got 0"):
        client._call(
            "Register", pb.RegisterRequest(worker_id=1, exchange_public_key=generate_exchange_key()[1])
        )
    with pytest.raises(GatewayError, match="NOT_FOUND: request_id 5 is not a known request"):
        list(client.watch(5, timeout_s=5.0))


def test_calls_time_out_instead_of_hanging(start_gateway, connect):
    server = start_gateway()
    port = server.port
    server.stop(grace_s=0.1)
    client = connect(server, timeout_s=0.5)
    started = time.monotonic()
    with pytest.raises(GatewayError, match="UNAVAILABLE|DEADLINE_EXCEEDED"):
        client.status()
    assert time.monotonic() - started < 5.0 and port > 0


def test_open_streams_are_capped_so_heartbeats_never_starve(start_gateway, connect):
    server = start_gateway(GatewayConfig(policy="S&R"), max_streams=2, control_threads=2)
    (worker,) = register_workers(server, connect, 1)
    client = connect(server)
    streams = [client.submit([1], 4, timeout_s=30.0) for _ in range(2)]
    request_ids = [next(s).request_id for s in streams]
    with pytest.raises(GatewayError, match=r"RESOURCE_EXHAUSTED: 2 token streams open \(max_streams\)"):
        next(client.submit([1], 4, timeout_s=30.0))
    assert server.coordinator.num_requests == 2  # refused before admission
    for _ in range(5):  # every stream thread is busy, the control plane still answers at once
        assert not worker.heartbeat().fenced
    for request_id in request_ids:
        worker.report_tokens(request_id, 1, 0, [1], finished=True)
    assert [[t for c in s for t in c.token_ids] for s in streams] == [[1], [1]]
    assert wait_until(lambda: server.num_streams == 0, timeout_s=5.0)
    assert next(client.submit([1], 4, timeout_s=30.0)).request_id == 3


def test_one_batched_report_per_step_refuses_only_the_stale_request(start_gateway, connect):
    from lumen_core.gateway.client import RequestTokens

    server = start_gateway(GatewayConfig(policy="S&R"))
    worker, other = register_workers(server, connect, 2)
    client = connect(server)
    streams = [client.submit([1, 2], 3, timeout_s=30.0) for _ in range(3)]
    request_ids = [next(s).request_id for s in streams]
    on_worker = [r for r in request_ids if server.coordinator.request_worker(r)[0] == 0]
    assert len(on_worker) == 2
    acks = worker.report_tokens_batch(
        [RequestTokens(r, 1, 0, (4, 5)) for r in on_worker] + [RequestTokens(on_worker[0], 9, 2, (6,))]
    )
    assert [(a.request_id, a.num_new, a.code) for a in acks[:2]] == [(r, 2, 0) for r in on_worker]
    assert acks[2].code == grpc.StatusCode.FAILED_PRECONDITION.value[0] and "epoch 9" in acks[2].details
    refused = worker.report_tokens_batch(
        [RequestTokens(on_worker[1], 1, 5, (6,)), RequestTokens(77, 1, 0, (1,))]
    )
    assert [a.code for a in refused] == [
        grpc.StatusCode.INVALID_ARGUMENT.value[0],
        grpc.StatusCode.NOT_FOUND.value[0],
    ]
    with pytest.raises(GatewayError, match="NOT_FOUND: request_id 77 is not a known request"):
        worker.report_tokens(77, 1, 0, [1])
    for stream in streams:
        stream.close()


def test_heartbeat_loop_keeps_the_lease_reregisters_after_a_restart_and_fences_when_cut_off(
    start_gateway, connect
):
    from lumen_core.gateway.heartbeat import HeartbeatLoop

    config = GatewayConfig(policy="S&R", lease_s=1.5, heartbeat_s=0.05)
    first = start_gateway(config, reap_interval_s=0.02)
    worker = connect(first)
    worker.register(0, budget_bytes=GIB, holder_address="127.0.0.1:7000")
    received = []
    fenced = []
    running = []
    loop = HeartbeatLoop(
        worker,
        lambda: WorkerReport(num_running=len(running), running=tuple(running)),
        received.extend,
        fenced.append,
    ).start()
    try:
        stream = connect(first).submit([1, 2], 4, timeout_s=30.0)
        request_id = next(stream).request_id
        assert wait_until(lambda: any(isinstance(d, Run) for d in received), timeout_s=10.0)
        running.append(RunningReport(request_id, 1, (1, 2), (), 4, 4))
        time.sleep(2 * config.lease_s)  # well past the lease: the loop keeps it
        assert first.coordinator.worker_state(0) == "serving" and worker.lease_valid()
        stream.close()
        port = first.port
        first.stop(grace_s=0.1)
        second = start_gateway(config, port=port, reap_interval_s=0.02)
        # The gateway rebuilds the request before the worker has read the register reply.
        assert wait_until(
            lambda: second.coordinator.has_request(request_id) and worker.epoch == 2, timeout_s=10.0
        )
        assert second.coordinator.request_worker(request_id) == (0, 1)
        second.stop(grace_s=0.1)  # cut off: the worker must stop on its own clock
        assert wait_until(lambda: bool(fenced), timeout_s=10.0)
        assert "no heartbeat acknowledged for 1.5 s" in fenced[0] and loop.num_errors > 0
        assert not worker.lease_valid() and not loop.running
    finally:
        loop.stop()
    assert fenced == [fenced[0]]


def test_heartbeat_loop_acknowledges_only_the_reports_the_gateway_received(start_gateway, connect):
    from lumen_core.gateway.heartbeat import HeartbeatLoop

    server = start_gateway(GatewayConfig(policy="S&R", lease_s=5.0, heartbeat_s=0.05))
    (worker,) = register_workers(server, connect, 1)
    acked = []
    report = WorkerReport(refused_request_ids=(5,), evicted_request_ids=(6,))
    loop = HeartbeatLoop(worker, lambda: report, print, print, on_reported=acked.append).start()
    try:
        assert wait_until(lambda: len(acked) >= 2)
        assert acked[0] is report
        server.stop(grace_s=0.1)
        assert wait_until(lambda: loop.num_errors >= 1)
        count, errors = len(acked), loop.num_errors
        assert wait_until(lambda: loop.num_errors >= errors + 3)
        assert len(acked) == count  # the gateway is gone: nothing it did not receive is acked
    finally:
        loop.stop()


def test_heartbeat_loop_validation(start_gateway, connect):
    from lumen_core.gateway.heartbeat import HeartbeatLoop

    server = start_gateway()
    client = connect(server)
    with pytest.raises(TypeError, match="client must be a GatewayClient, got str"):
        HeartbeatLoop("client", WorkerReport, print, print)
    with pytest.raises(ValueError, match="client must be registered before its heartbeats start"):
        HeartbeatLoop(client, WorkerReport, print, print)
    client.register(0)
    with pytest.raises(ValueError, match="`heartbeat_s` must be > 0, got 0"):
        HeartbeatLoop(client, WorkerReport, print, print, heartbeat_s=0)
    with pytest.raises(FencedError, match="register_again before register"):
        connect(server).register_again()


def test_heartbeat_loop_of_an_assisting_worker_gets_its_pairing_and_draft_length(start_gateway, connect):
    from lumen_core.gateway.heartbeat import HeartbeatLoop

    server = start_gateway(GatewayConfig(policy="LUMEN", lease_s=2.0, heartbeat_s=0.05))
    survivors = register_workers(server, connect, 2)
    survivors[1].heartbeat(WorkerReport(num_running=4))
    assert server.report_exit(0, 1, "SIGKILL")  # a supervisor beside the gateway
    assistant = connect(server)
    registration = assistant.register(0, state=WorkerState.RECOVERING)
    assert [type(d) for d in registration.directives] == [AssistDraft]
    received = []
    loop = HeartbeatLoop(assistant, lambda: WorkerReport(assist_steps=200), received.extend, print).start()
    try:
        assert wait_until(lambda: loop.last_num_draft_tokens == 4, timeout_s=10.0)  # warm k after cold_steps
        assistant.model_loaded(budget_bytes=GIB)
        assert wait_until(lambda: loop.last_num_draft_tokens == 0, timeout_s=10.0)  # serving: no drafts
    finally:
        loop.stop()
    assert not loop.running and assistant.lease_valid()


@pytest.mark.parametrize("failing", ["report", "on_directives", "on_reported"])
def test_heartbeat_loop_fences_when_a_worker_callback_fails(start_gateway, connect, failing):
    from lumen_core.gateway.heartbeat import HeartbeatLoop

    server = start_gateway(GatewayConfig(policy="S&R", lease_s=2.0, heartbeat_s=0.05))
    (worker,) = register_workers(server, connect, 1)
    fenced = []

    def broken(*args):
        raise RuntimeError("engine gone")

    report = broken if failing == "report" else WorkerReport
    on_directives = broken if failing == "on_directives" else print
    on_reported = broken if failing == "on_reported" else print
    loop = HeartbeatLoop(worker, report, on_directives, fenced.append, on_reported=on_reported).start()
    try:
        stream = connect(server).submit([1], 2, timeout_s=30.0)
        next(stream)
        assert wait_until(lambda: bool(fenced), timeout_s=10.0)
        what = "directive handler" if failing == "on_directives" else "worker report"
        assert fenced == [f"{what} failed: RuntimeError: engine gone"]
        assert not worker.lease_valid() and worker.fence_reason == fenced[0]
        with pytest.raises(FencedError, match="engine gone"):
            worker.report_tokens(1, 1, 0, [3])
        assert wait_until(lambda: not loop.running, timeout_s=10.0)
        stream.close()
    finally:
        loop.stop()


def test_a_worker_reaches_a_restarted_gateway_within_a_second_or_so(start_gateway, connect):
    first = start_gateway()
    worker = connect(first, timeout_s=0.5)
    worker.register(0, budget_bytes=GIB)
    port = first.port
    first.stop(grace_s=0.1)
    down_until = time.monotonic() + 3.0  # long enough for gRPC's default backoff to reach seconds
    while time.monotonic() < down_until:
        with pytest.raises(GatewayError, match="UNAVAILABLE|DEADLINE_EXCEEDED"):
            worker.heartbeat()
        time.sleep(0.1)
    start_gateway(port=port)
    started = time.monotonic()

    def reached():
        try:
            return worker.heartbeat().reregister
        except GatewayError:
            return False

    assert wait_until(reached, timeout_s=10.0, poll_s=0.05)
    assert time.monotonic() - started < 2.5  # reconnect attempts at most 1 s apart
