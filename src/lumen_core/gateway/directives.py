"""The directives the gateway sends a worker: one frozen dataclass per kind (lumen.proto's
``Directive.body`` oneof), and ``Delivery``, a directive with its place in the worker's
sequence.

Request ids are the gateway's ints end to end; epochs are request epochs (appends and reads
of older epochs are refused by the holders). ``reason`` says why the policy decided it (for
logs only).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from lumen_core._validate import U64_MAX, check_int, check_number
from lumen_core.policy.events import RecoveryAction


@dataclass(frozen=True)
class HolderGrant:
    """A checkpoint holder and the capabilities (one per shard) for one request epoch."""

    worker_id: int
    address: str
    capabilities: tuple[bytes, ...]


@dataclass(frozen=True)
class Sampling:
    """How a request samples: ``temperature`` 0 is greedy; above it, the token at output
    position ``p`` is drawn keyed by ``(seed, p)`` (the engine's ``SamplingParams``), so a request
    resumed elsewhere draws the same tokens. Raises TypeError/ValueError for a temperature that
    is not a finite number >= 0 or a seed outside [0, 2**64)."""

    temperature: float = 0.0
    seed: int = 0

    def __post_init__(self) -> None:
        temperature = check_number("temperature", self.temperature, low=0.0)
        if math.isinf(temperature):
            raise ValueError(f"`temperature` must be finite, got {self.temperature}")
        check_int("seed", self.seed, low=0, high=U64_MAX)


GREEDY = Sampling()


@dataclass(frozen=True)
class Run:
    """Serve a new request, streaming its checkpoint to ``holders``."""

    request_id: int
    epoch: int
    holders: tuple[HolderGrant, ...]
    prompt_token_ids: tuple[int, ...]
    max_new_tokens: int
    reason: str = ""
    sampling: Sampling = GREEDY


@dataclass(frozen=True)
class Resume:
    """Serve an interrupted request: restore its KV from ``source`` (RESTORE on the holder
    itself, REMOTE_RESTORE from another) or re-prefill it; ``output_token_ids`` are the tokens
    the client already has; stream its checkpoint to ``holders`` from here on."""

    request_id: int
    epoch: int
    action: RecoveryAction
    holders: tuple[HolderGrant, ...]
    source: HolderGrant | None
    prompt_token_ids: tuple[int, ...]
    output_token_ids: tuple[int, ...]
    max_new_tokens: int
    reason: str = ""
    sampling: Sampling = GREEDY


@dataclass(frozen=True)
class Hold:
    """Keep the checkpoint of ``request_id`` that ``serving_worker_id`` streams at ``epoch``:
    ``grant`` is this holder's own (its shard count sizes the reservation), ``reserved_bytes``
    the room to reserve (0: only the epoch moved on, nothing to reserve)."""

    request_id: int
    epoch: int
    grant: HolderGrant
    reserved_bytes: int
    serving_worker_id: int
    reason: str = ""


@dataclass(frozen=True)
class Stream:
    """The holders of a request served here changed: stream its whole checkpoint to
    ``holders`` (all of them; none = keep no checkpoint)."""

    request_id: int
    epoch: int
    holders: tuple[HolderGrant, ...]
    reason: str = ""


@dataclass(frozen=True)
class Renew:
    """The capabilities of a request served here are due for renewal: the same holders, in
    the same order as its last RUN, RESUME or STREAM, at the same ``epoch``, each with fresh
    capabilities (a later expiry). Unlike STREAM, the checkpoint goes on where it is: each
    replica re-opens with its new capability before its next append."""

    request_id: int
    epoch: int
    holders: tuple[HolderGrant, ...]
    reason: str = ""


@dataclass(frozen=True)
class Release:
    """Drop the checkpoint of ``request_id`` (finished, re-homed or stale); ``epoch`` 0 when
    the gateway does not know the request's epoch."""

    request_id: int
    epoch: int = 0
    reason: str = ""


@dataclass(frozen=True)
class AssistDraft:
    """This worker is recovering: draft for ``survivor_id``, whose holder listens at
    ``survivor_address``, ``num_draft_tokens`` tokens a step to begin with."""

    survivor_id: int
    survivor_address: str
    num_draft_tokens: int
    reason: str = ""


@dataclass(frozen=True)
class AssistVerify:
    """Recovering worker ``assistant_id`` (holder at ``assistant_address``) drafts for this one."""

    assistant_id: int
    assistant_address: str
    num_draft_tokens: int
    reason: str = ""


@dataclass(frozen=True)
class AssistStop:
    """The assist pairing with ``peer_worker_id`` ended."""

    peer_worker_id: int
    reason: str = ""


@dataclass(frozen=True)
class Cancel:
    """Stop serving ``request_id``: another worker serves it now, or its client gave up."""

    request_id: int
    reason: str = ""


@dataclass(frozen=True)
class Flush:
    """This worker is drained: run no more steps, flush the checkpoint streamer (every
    computed token durable on its holders), then say so in the next heartbeat (``flushed``);
    the gateway then moves each request away."""

    reason: str = ""


@dataclass(frozen=True)
class Stop:
    """This worker runs nothing and holds nothing (drained): exit cleanly."""

    reason: str = ""


Directive = (
    Run
    | Resume
    | Hold
    | Stream
    | Renew
    | Release
    | AssistDraft
    | AssistVerify
    | AssistStop
    | Cancel
    | Flush
    | Stop
)


@dataclass(frozen=True)
class Delivery:
    """A directive with its sequence number: 1, 2, ... per worker epoch, in the order the
    gateway decided them. A worker applies each number once, whichever path brought it
    (the pushed stream or a heartbeat reply), and acknowledges the highest it has applied."""

    sequence: int
    directive: Directive
