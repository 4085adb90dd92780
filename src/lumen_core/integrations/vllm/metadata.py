"""What the scheduler side tells the worker side each step (pickled between processes in
vLLM's multiprocess mode): requests to start streaming, restores to start (asynchronous loads),
the step's computed tokens to save, preempted requests (streaming ones), and what the local
control channel asked for: requests to stop checkpointing, renewed capabilities, a durable-lag
sample, the identity's new credential."""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata

from lumen_core.connector import Address, RestoreSource
from lumen_core.integrations.vllm.params import CredentialGrant

__all__ = ["LoadSpec", "LumenMetadata", "OpenSpec", "RenewSpec", "SaveSpec"]


@dataclass(frozen=True)
class OpenSpec:
    """Start streaming ``req_id`` (LUMEN id ``request_id``, wire key ``key``) to ``holders`` at
    ``epoch``; each holder reserves ``expected_tokens`` records (prompt + max output)."""

    req_id: str
    request_id: str
    key: int
    holders: tuple[Address, ...]
    capabilities: tuple[bytes, ...]  # one per holder
    epoch: int
    expected_tokens: int


@dataclass(frozen=True)
class LoadSpec:
    """Restore the first ``len(slot_ids)`` tokens of ``req_id`` (LUMEN id ``request_id``, ids
    ``token_ids``) from ``restore`` into ``slot_ids`` (load errors are reported by the blocks
    of the slots that failed)."""

    req_id: str
    request_id: str
    key: int
    slot_ids: list[int]
    token_ids: list[int]
    restore: RestoreSource


@dataclass(frozen=True)
class SaveSpec:
    """Tokens ``start .. start + len(slot_ids)`` of ``req_id`` are in ``slot_ids`` once this
    step's forward is done (the first save of a request starts at 0: prefix-cache hits and
    restored tokens are streamed too)."""

    req_id: str
    start: int
    slot_ids: list[int]
    token_ids: list[int]


@dataclass(frozen=True)
class RenewSpec:
    """Fresh ``capabilities`` for the replicas of LUMEN request ``request_id`` (streaming), one
    per holder in its open's order (control ``renew``)."""

    request_id: str
    capabilities: tuple[bytes, ...]


@dataclass
class LumenMetadata(KVConnectorMetadata):
    opens: list[OpenSpec] = field(default_factory=list)
    loads: list[LoadSpec] = field(default_factory=list)
    saves: list[SaveSpec] = field(default_factory=list)
    preempted_req_ids: list[str] = field(default_factory=list)
    releases: list[str] = field(default_factory=list)  # LUMEN request ids (control `release`)
    renewals: list[RenewSpec] = field(default_factory=list)  # control `renew`
    flush_mark: int = 0  # a control `flush` waits: the newest one's number (0: none)
    abandon: bool = False  # control `abandon`: stop streaming every request, release none
    credential: CredentialGrant | None = None  # control `credential`: before this step's opens
