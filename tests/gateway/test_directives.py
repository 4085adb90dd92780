"""Typed directives and reports: their wire converters, and the sequence both delivery paths
share (the gateway's outbox, the worker's inbox). No gRPC here."""

import dataclasses
import threading
import typing

import pytest

from lumen_core.gateway import lumen_pb2 as pb
from lumen_core.gateway.config import GatewayConfig
from lumen_core.gateway.coordinator import Coordinator
from lumen_core.gateway.directives import (
    AssistDraft,
    AssistStop,
    AssistVerify,
    Cancel,
    Delivery,
    Directive,
    Flush,
    Hold,
    HolderGrant,
    Release,
    Renew,
    Resume,
    Run,
    Sampling,
    Stop,
    Stream,
)
from lumen_core.gateway.inbox import DirectiveInbox
from lumen_core.gateway.outbox import DirectiveOutbox
from lumen_core.gateway.protocol import delivery_from_pb, delivery_to_pb, report_from_pb, report_to_pb
from lumen_core.gateway.reports import HeldReport, LostReplica, RunningReport, WorkerReport
from lumen_core.policy.events import RecoveryAction

pytestmark = pytest.mark.timeout(60)

GRANT = HolderGrant(3, "127.0.0.1:7003", (b"\x01" * 32, b"\x02" * 32))
OTHER = HolderGrant(4, "127.0.0.1:7004", (b"\x03" * 32,))
# One of each kind, with every field away from its proto default (so a dropped field shows).
EXAMPLES = [
    Run(2**63 + 5, 7, (GRANT, OTHER), (1, 2, 2**40), 9, "placed", Sampling(0.7, 2**64 - 1)),
    Resume(
        11, 2, RecoveryAction.REMOTE_RESTORE, (OTHER,), GRANT, (5, 6), (7,), 12, "routed", Sampling(1.5, 3)
    ),
    Resume(12, 3, RecoveryAction.REPREFILL, (), None, (5,), (), 4, "no copy"),
    Hold(13, 4, GRANT, 4096, 1, "placed"),
    Stream(14, 5, (GRANT,), "re-placed"),
    Stream(15, 1, (), "no holder left"),
    Renew(18, 6, (GRANT, OTHER), "before expiry"),
    Release(16, 2, "finished"),
    AssistDraft(2, "127.0.0.1:7002", 3, "most loaded"),
    AssistVerify(0, "127.0.0.1:7100", 3, "most loaded"),
    AssistStop(2, "assistant switched over"),
    Cancel(17, "served elsewhere now"),
    Flush("drain: deadline 30 s"),
    Stop("drained: 16 requests moved"),
]


def test_the_examples_cover_every_kind():
    assert {type(d) for d in EXAMPLES} == set(typing.get_args(Directive)) and len(
        typing.get_args(Directive)
    ) == 12


@pytest.mark.parametrize("directive", EXAMPLES, ids=lambda d: type(d).__name__)
def test_every_kind_round_trips_through_its_proto_message(directive):
    message = delivery_to_pb(Delivery(41, directive))
    wire = pb.Directive.FromString(message.SerializeToString())
    assert wire.WhichOneof("body") is not None and wire.sequence == 41
    assert delivery_from_pb(wire) == Delivery(41, directive)


def test_sampling_validation_and_greedy_default():
    assert Run(1, 1, (), (1,), 2).sampling == Sampling(0.0, 0)  # an unset message is greedy too
    with pytest.raises(ValueError, match="`temperature` must be >= 0.0, got -0.5"):
        Sampling(-0.5)
    with pytest.raises(ValueError, match="`temperature` must be finite, got inf"):
        Sampling(float("inf"))
    with pytest.raises(TypeError, match="`temperature` must be a number, got str"):
        Sampling("1")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"`seed` must be in \[0, 18446744073709551615\], got -1"):
        Sampling(1.0, -1)


def test_converters_refuse_what_is_not_a_directive():
    with pytest.raises(TypeError, match="directive must be one of the directive kinds, got HeldReport"):
        delivery_to_pb(Delivery(1, HeldReport(1, 1, 1)))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="directive must have a body, got none"):
        delivery_from_pb(pb.Directive(sequence=3))
    with pytest.raises(ValueError, match="action must be RESTORE, REMOTE_RESTORE or REPREFILL, got 0"):
        delivery_from_pb(pb.Directive(sequence=1, resume=pb.Resume(request_id=1)))


def test_the_heartbeat_report_round_trips_except_running():
    report = WorkerReport(
        num_running=3,
        num_waiting=2,
        held_bytes=1 << 33,
        held=(HeldReport(5, 2, 100), HeldReport(2**63, 1, 7)),
        refused_request_ids=(8, 9),
        evicted_request_ids=(10,),
        assist_steps=4,
        proposed_draft_tokens=12,
        accepted_draft_tokens=9,
        lost_replicas=(LostReplica(5, 1), LostReplica(2**63, 0)),
        flushed=True,
        running=(RunningReport(5, 2, (1,), (2,), 4, 4),),
    )
    wire = pb.WorkerReport.FromString(report_to_pb(report).SerializeToString())
    back = report_from_pb(wire)
    assert back.running == ()  # it travels with Register only
    assert dataclasses.replace(report, running=()) == back


def test_the_outbox_numbers_keeps_until_acknowledged_and_refuses_acks_of_the_unsent():
    outbox = DirectiveOutbox()
    assert outbox.after(0) == [] and outbox.last_sequence == 0
    sent = [outbox.put(Cancel(r)) for r in (1, 2, 3)]
    assert [d.sequence for d in sent] == [1, 2, 3]
    assert outbox.after(1) == sent[1:]
    outbox.acknowledge(2)
    assert outbox.after(0) == sent[2:]  # 1 and 2 are gone, 3 waits for its ack
    outbox.acknowledge(2)  # an ack heard again changes nothing
    assert outbox.after(0) == sent[2:]
    with pytest.raises(ValueError, match=r"`acked_sequence` must be <= 3 \(the newest sent\), got 4"):
        outbox.acknowledge(4)
    with pytest.raises(ValueError, match="`acked_sequence` must be >= 0, got -1"):
        outbox.acknowledge(-1)
    outbox.acknowledge(3)
    assert outbox.after(0) == []


def test_the_inbox_applies_each_number_once_in_order_and_drops_other_epochs():
    inbox = DirectiveInbox()
    inbox.reset(2)
    got = []
    d = [Delivery(i, Cancel(i)) for i in range(1, 6)]
    assert inbox.accept(2, d[:2], got.extend) == (Cancel(1), Cancel(2))
    assert inbox.accept(2, d[:3], got.extend) == (Cancel(3),)  # 1, 2 came the other way already
    assert inbox.accept(2, [d[4]]) == ()  # a gap (4 is missing): wait for the heartbeat reply
    assert inbox.accept(1, d[3:]) == ()  # a stream of the older incarnation
    assert inbox.sequence == 3 and inbox.position() == (2, 3) and inbox.num_repeated == 2
    assert inbox.accept(2, d[3:], got.extend) == (Cancel(4), Cancel(5))
    assert got == [Cancel(i) for i in range(1, 6)]
    inbox.reset(3)
    assert inbox.sequence == 0 and inbox.accept(3, d[:1]) == (Cancel(1),)


def test_the_inbox_hands_over_batches_from_two_threads_without_interleaving():
    inbox = DirectiveInbox()
    deliveries = [Delivery(i, Cancel(i)) for i in range(1, 2001)]
    got: list[Cancel] = []
    threads = [
        threading.Thread(
            target=lambda: [inbox.accept(0, deliveries[i : i + 7], got.extend) for i in range(0, 2000, 7)]
        )
        for _ in range(2)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30.0)
    assert got == [d.directive for d in deliveries]


def test_a_heartbeat_acknowledges_and_gets_only_what_follows():
    coordinator = Coordinator(GatewayConfig(policy="S&R"), b"directive-tests-secret-0123456789")
    coordinator.register(0.0, 0, budget_bytes=1 << 30)
    first = coordinator.admit(0.0, [1, 2], 4).request_id
    second = coordinator.admit(0.0, [1, 2], 4).request_id
    _, deliveries, _ = coordinator.heartbeat(0.1, 0, 1, WorkerReport())
    assert [(d.sequence, d.directive.request_id) for d in deliveries] == [(1, first), (2, second)]
    _, deliveries, _ = coordinator.heartbeat(0.2, 0, 1, WorkerReport(), acked_sequence=1)
    assert [d.sequence for d in deliveries] == [2]  # 1 is applied: never sent again
    assert coordinator.directives_after(0, 0) == deliveries
    with pytest.raises(ValueError, match=r"`acked_sequence` must be <= 2 \(the newest sent\), got 3"):
        coordinator.heartbeat(0.3, 0, 1, WorkerReport(), acked_sequence=3)
    with pytest.raises(TypeError, match="report must be a WorkerReport, got dict"):
        coordinator.heartbeat(0.3, 0, 1, {})  # type: ignore[arg-type]
    coordinator.register(0.4, 0, budget_bytes=1 << 30)  # a new epoch numbers from 1 again
    # its old incarnation failed with no worker left: its requests were parked, now resumed here
    moved = coordinator.directives_after(0, 0)
    assert [(d.sequence, type(d.directive), d.directive.request_id) for d in moved] == [
        (1, Resume, first),
        (2, Resume, second),
    ]
    assert coordinator.admit(0.5, [1], 2).request_id == 3
    assert [d.sequence for d in coordinator.directives_after(0, 0)] == [1, 2, 3]
