"""What a worker reports to the gateway: its heartbeat report (lumen.proto's WorkerReport)
and, when it registers again with a restarted gateway, what it runs and holds."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class RunningReport:
    """A request a worker serves, as it reports it when re-registering."""

    request_id: int
    epoch: int
    prompt_token_ids: tuple[int, ...]
    output_token_ids: tuple[int, ...]
    max_new_tokens: int
    expected_output_tokens: int


@dataclass(frozen=True)
class HeldReport:
    """A checkpoint a worker holds for another: its request epoch and durable length."""

    request_id: int
    epoch: int
    durable_tokens: int


@dataclass(frozen=True)
class StreamedReplica:
    """A replica of a request the reporting worker serves, as its streamer has it: durable
    tokens on holder ``holder_worker_id`` at the request's ``epoch`` (sent once flushed, so
    a drain moves each request knowing its checkpoint without waiting for the holders)."""

    request_id: int
    epoch: int
    holder_worker_id: int
    durable_tokens: int


@dataclass(frozen=True)
class LostReplica:
    """A replica of a request the reporting worker serves that ``holder_worker_id`` lost for
    good (the streamer gave up on that holder or was refused by it)."""

    request_id: int
    holder_worker_id: int


@dataclass(frozen=True)
class WorkerReport:
    """A worker's heartbeat report. ``refused_request_ids``: HOLDs it refused (budget);
    ``evicted_request_ids``: checkpoints it evicted; ``lost_replicas``: replicas of the
    requests it serves that their holders lost for good (the gateway places them again,
    as after a refusal); the assist counters are cumulative since
    it registered; ``flushed``: it applied a FLUSH (drained: it steps no more, its streamer
    is flushed), with ``streamed``: the durable length of each replica it streams.
    ``running`` travels only with a registration (after a gateway restart), never in a
    heartbeat."""

    num_running: int = 0
    num_waiting: int = 0
    held_bytes: int = 0
    held: tuple[HeldReport, ...] = ()
    refused_request_ids: tuple[int, ...] = ()
    evicted_request_ids: tuple[int, ...] = ()
    assist_steps: int = 0
    proposed_draft_tokens: int = 0
    accepted_draft_tokens: int = 0
    lost_replicas: tuple[LostReplica, ...] = ()
    running: tuple[RunningReport, ...] = ()
    flushed: bool = False
    streamed: tuple[StreamedReplica, ...] = ()
