from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class WorkerState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    WORKER_STATE_UNSPECIFIED: _ClassVar[WorkerState]
    SERVING: _ClassVar[WorkerState]
    RECOVERING: _ClassVar[WorkerState]

class RecoveryAction(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    RECOVERY_ACTION_UNSPECIFIED: _ClassVar[RecoveryAction]
    RESTORE: _ClassVar[RecoveryAction]
    REMOTE_RESTORE: _ClassVar[RecoveryAction]
    REPREFILL: _ClassVar[RecoveryAction]
WORKER_STATE_UNSPECIFIED: WorkerState
SERVING: WorkerState
RECOVERING: WorkerState
RECOVERY_ACTION_UNSPECIFIED: RecoveryAction
RESTORE: RecoveryAction
REMOTE_RESTORE: RecoveryAction
REPREFILL: RecoveryAction

class HolderGrant(_message.Message):
    __slots__ = ("worker_id", "address", "capabilities")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    CAPABILITIES_FIELD_NUMBER: _ClassVar[int]
    worker_id: int
    address: str
    capabilities: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, worker_id: _Optional[int] = ..., address: _Optional[str] = ..., capabilities: _Optional[_Iterable[bytes]] = ...) -> None: ...

class Sampling(_message.Message):
    __slots__ = ("temperature", "seed")
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    seed: int
    def __init__(self, temperature: _Optional[float] = ..., seed: _Optional[int] = ...) -> None: ...

class Run(_message.Message):
    __slots__ = ("request_id", "epoch", "holders", "prompt_token_ids", "max_new_tokens", "reason", "sampling")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    HOLDERS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    MAX_NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    request_id: int
    epoch: int
    holders: _containers.RepeatedCompositeFieldContainer[HolderGrant]
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    max_new_tokens: int
    reason: str
    sampling: Sampling
    def __init__(self, request_id: _Optional[int] = ..., epoch: _Optional[int] = ..., holders: _Optional[_Iterable[_Union[HolderGrant, _Mapping]]] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., max_new_tokens: _Optional[int] = ..., reason: _Optional[str] = ..., sampling: _Optional[_Union[Sampling, _Mapping]] = ...) -> None: ...

class Resume(_message.Message):
    __slots__ = ("request_id", "epoch", "action", "holders", "source", "prompt_token_ids", "output_token_ids", "max_new_tokens", "reason", "sampling")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    ACTION_FIELD_NUMBER: _ClassVar[int]
    HOLDERS_FIELD_NUMBER: _ClassVar[int]
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    MAX_NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    request_id: int
    epoch: int
    action: RecoveryAction
    holders: _containers.RepeatedCompositeFieldContainer[HolderGrant]
    source: HolderGrant
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    output_token_ids: _containers.RepeatedScalarFieldContainer[int]
    max_new_tokens: int
    reason: str
    sampling: Sampling
    def __init__(self, request_id: _Optional[int] = ..., epoch: _Optional[int] = ..., action: _Optional[_Union[RecoveryAction, str]] = ..., holders: _Optional[_Iterable[_Union[HolderGrant, _Mapping]]] = ..., source: _Optional[_Union[HolderGrant, _Mapping]] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., output_token_ids: _Optional[_Iterable[int]] = ..., max_new_tokens: _Optional[int] = ..., reason: _Optional[str] = ..., sampling: _Optional[_Union[Sampling, _Mapping]] = ...) -> None: ...

class Hold(_message.Message):
    __slots__ = ("request_id", "epoch", "grant", "reserved_bytes", "serving_worker_id", "reason")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    GRANT_FIELD_NUMBER: _ClassVar[int]
    RESERVED_BYTES_FIELD_NUMBER: _ClassVar[int]
    SERVING_WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    request_id: int
    epoch: int
    grant: HolderGrant
    reserved_bytes: int
    serving_worker_id: int
    reason: str
    def __init__(self, request_id: _Optional[int] = ..., epoch: _Optional[int] = ..., grant: _Optional[_Union[HolderGrant, _Mapping]] = ..., reserved_bytes: _Optional[int] = ..., serving_worker_id: _Optional[int] = ..., reason: _Optional[str] = ...) -> None: ...

class Stream(_message.Message):
    __slots__ = ("request_id", "epoch", "holders", "reason")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    HOLDERS_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    request_id: int
    epoch: int
    holders: _containers.RepeatedCompositeFieldContainer[HolderGrant]
    reason: str
    def __init__(self, request_id: _Optional[int] = ..., epoch: _Optional[int] = ..., holders: _Optional[_Iterable[_Union[HolderGrant, _Mapping]]] = ..., reason: _Optional[str] = ...) -> None: ...

class Renew(_message.Message):
    __slots__ = ("request_id", "epoch", "holders", "reason")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    HOLDERS_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    request_id: int
    epoch: int
    holders: _containers.RepeatedCompositeFieldContainer[HolderGrant]
    reason: str
    def __init__(self, request_id: _Optional[int] = ..., epoch: _Optional[int] = ..., holders: _Optional[_Iterable[_Union[HolderGrant, _Mapping]]] = ..., reason: _Optional[str] = ...) -> None: ...

class Release(_message.Message):
    __slots__ = ("request_id", "epoch", "reason")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    request_id: int
    epoch: int
    reason: str
    def __init__(self, request_id: _Optional[int] = ..., epoch: _Optional[int] = ..., reason: _Optional[str] = ...) -> None: ...

class AssistDraft(_message.Message):
    __slots__ = ("survivor_id", "survivor_address", "num_draft_tokens", "reason")
    SURVIVOR_ID_FIELD_NUMBER: _ClassVar[int]
    SURVIVOR_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    NUM_DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    survivor_id: int
    survivor_address: str
    num_draft_tokens: int
    reason: str
    def __init__(self, survivor_id: _Optional[int] = ..., survivor_address: _Optional[str] = ..., num_draft_tokens: _Optional[int] = ..., reason: _Optional[str] = ...) -> None: ...

class AssistVerify(_message.Message):
    __slots__ = ("assistant_id", "assistant_address", "num_draft_tokens", "reason")
    ASSISTANT_ID_FIELD_NUMBER: _ClassVar[int]
    ASSISTANT_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    NUM_DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    assistant_id: int
    assistant_address: str
    num_draft_tokens: int
    reason: str
    def __init__(self, assistant_id: _Optional[int] = ..., assistant_address: _Optional[str] = ..., num_draft_tokens: _Optional[int] = ..., reason: _Optional[str] = ...) -> None: ...

class AssistStop(_message.Message):
    __slots__ = ("peer_worker_id", "reason")
    PEER_WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    peer_worker_id: int
    reason: str
    def __init__(self, peer_worker_id: _Optional[int] = ..., reason: _Optional[str] = ...) -> None: ...

class Cancel(_message.Message):
    __slots__ = ("request_id", "reason")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    request_id: int
    reason: str
    def __init__(self, request_id: _Optional[int] = ..., reason: _Optional[str] = ...) -> None: ...

class Flush(_message.Message):
    __slots__ = ("reason",)
    REASON_FIELD_NUMBER: _ClassVar[int]
    reason: str
    def __init__(self, reason: _Optional[str] = ...) -> None: ...

class Stop(_message.Message):
    __slots__ = ("reason",)
    REASON_FIELD_NUMBER: _ClassVar[int]
    reason: str
    def __init__(self, reason: _Optional[str] = ...) -> None: ...

class Directive(_message.Message):
    __slots__ = ("sequence", "run", "resume", "hold", "stream", "release", "assist_draft", "assist_verify", "assist_stop", "cancel", "flush", "stop", "renew")
    SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    RUN_FIELD_NUMBER: _ClassVar[int]
    RESUME_FIELD_NUMBER: _ClassVar[int]
    HOLD_FIELD_NUMBER: _ClassVar[int]
    STREAM_FIELD_NUMBER: _ClassVar[int]
    RELEASE_FIELD_NUMBER: _ClassVar[int]
    ASSIST_DRAFT_FIELD_NUMBER: _ClassVar[int]
    ASSIST_VERIFY_FIELD_NUMBER: _ClassVar[int]
    ASSIST_STOP_FIELD_NUMBER: _ClassVar[int]
    CANCEL_FIELD_NUMBER: _ClassVar[int]
    FLUSH_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    RENEW_FIELD_NUMBER: _ClassVar[int]
    sequence: int
    run: Run
    resume: Resume
    hold: Hold
    stream: Stream
    release: Release
    assist_draft: AssistDraft
    assist_verify: AssistVerify
    assist_stop: AssistStop
    cancel: Cancel
    flush: Flush
    stop: Stop
    renew: Renew
    def __init__(self, sequence: _Optional[int] = ..., run: _Optional[_Union[Run, _Mapping]] = ..., resume: _Optional[_Union[Resume, _Mapping]] = ..., hold: _Optional[_Union[Hold, _Mapping]] = ..., stream: _Optional[_Union[Stream, _Mapping]] = ..., release: _Optional[_Union[Release, _Mapping]] = ..., assist_draft: _Optional[_Union[AssistDraft, _Mapping]] = ..., assist_verify: _Optional[_Union[AssistVerify, _Mapping]] = ..., assist_stop: _Optional[_Union[AssistStop, _Mapping]] = ..., cancel: _Optional[_Union[Cancel, _Mapping]] = ..., flush: _Optional[_Union[Flush, _Mapping]] = ..., stop: _Optional[_Union[Stop, _Mapping]] = ..., renew: _Optional[_Union[Renew, _Mapping]] = ...) -> None: ...

class RunningRequest(_message.Message):
    __slots__ = ("request_id", "epoch", "prompt_token_ids", "output_token_ids", "max_new_tokens", "expected_output_tokens")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    MAX_NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    EXPECTED_OUTPUT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    request_id: int
    epoch: int
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    output_token_ids: _containers.RepeatedScalarFieldContainer[int]
    max_new_tokens: int
    expected_output_tokens: int
    def __init__(self, request_id: _Optional[int] = ..., epoch: _Optional[int] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., output_token_ids: _Optional[_Iterable[int]] = ..., max_new_tokens: _Optional[int] = ..., expected_output_tokens: _Optional[int] = ...) -> None: ...

class HeldCheckpoint(_message.Message):
    __slots__ = ("request_id", "epoch", "durable_tokens")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    DURABLE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    request_id: int
    epoch: int
    durable_tokens: int
    def __init__(self, request_id: _Optional[int] = ..., epoch: _Optional[int] = ..., durable_tokens: _Optional[int] = ...) -> None: ...

class LostReplica(_message.Message):
    __slots__ = ("request_id", "holder_worker_id")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    HOLDER_WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: int
    holder_worker_id: int
    def __init__(self, request_id: _Optional[int] = ..., holder_worker_id: _Optional[int] = ...) -> None: ...

class RegisterRequest(_message.Message):
    __slots__ = ("worker_id", "state", "budget_bytes", "domain", "holder_address", "num_shards", "last_epoch", "running", "held", "exchange_public_key", "identity_public_key")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    BUDGET_BYTES_FIELD_NUMBER: _ClassVar[int]
    DOMAIN_FIELD_NUMBER: _ClassVar[int]
    HOLDER_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    NUM_SHARDS_FIELD_NUMBER: _ClassVar[int]
    LAST_EPOCH_FIELD_NUMBER: _ClassVar[int]
    RUNNING_FIELD_NUMBER: _ClassVar[int]
    HELD_FIELD_NUMBER: _ClassVar[int]
    EXCHANGE_PUBLIC_KEY_FIELD_NUMBER: _ClassVar[int]
    IDENTITY_PUBLIC_KEY_FIELD_NUMBER: _ClassVar[int]
    worker_id: int
    state: WorkerState
    budget_bytes: int
    domain: str
    holder_address: str
    num_shards: int
    last_epoch: int
    running: _containers.RepeatedCompositeFieldContainer[RunningRequest]
    held: _containers.RepeatedCompositeFieldContainer[HeldCheckpoint]
    exchange_public_key: bytes
    identity_public_key: bytes
    def __init__(self, worker_id: _Optional[int] = ..., state: _Optional[_Union[WorkerState, str]] = ..., budget_bytes: _Optional[int] = ..., domain: _Optional[str] = ..., holder_address: _Optional[str] = ..., num_shards: _Optional[int] = ..., last_epoch: _Optional[int] = ..., running: _Optional[_Iterable[_Union[RunningRequest, _Mapping]]] = ..., held: _Optional[_Iterable[_Union[HeldCheckpoint, _Mapping]]] = ..., exchange_public_key: _Optional[bytes] = ..., identity_public_key: _Optional[bytes] = ...) -> None: ...

class RegisterReply(_message.Message):
    __slots__ = ("epoch", "lease_s", "heartbeat_s", "directives", "wrapped_call_key", "call_key_salt", "issuer_public_key", "exchange_public_key", "credential")
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    LEASE_S_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_S_FIELD_NUMBER: _ClassVar[int]
    DIRECTIVES_FIELD_NUMBER: _ClassVar[int]
    WRAPPED_CALL_KEY_FIELD_NUMBER: _ClassVar[int]
    CALL_KEY_SALT_FIELD_NUMBER: _ClassVar[int]
    ISSUER_PUBLIC_KEY_FIELD_NUMBER: _ClassVar[int]
    EXCHANGE_PUBLIC_KEY_FIELD_NUMBER: _ClassVar[int]
    CREDENTIAL_FIELD_NUMBER: _ClassVar[int]
    epoch: int
    lease_s: float
    heartbeat_s: float
    directives: _containers.RepeatedCompositeFieldContainer[Directive]
    wrapped_call_key: bytes
    call_key_salt: bytes
    issuer_public_key: bytes
    exchange_public_key: bytes
    credential: bytes
    def __init__(self, epoch: _Optional[int] = ..., lease_s: _Optional[float] = ..., heartbeat_s: _Optional[float] = ..., directives: _Optional[_Iterable[_Union[Directive, _Mapping]]] = ..., wrapped_call_key: _Optional[bytes] = ..., call_key_salt: _Optional[bytes] = ..., issuer_public_key: _Optional[bytes] = ..., exchange_public_key: _Optional[bytes] = ..., credential: _Optional[bytes] = ...) -> None: ...

class HelloRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class HelloReply(_message.Message):
    __slots__ = ("instance_id",)
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    instance_id: str
    def __init__(self, instance_id: _Optional[str] = ...) -> None: ...

class WorkerReport(_message.Message):
    __slots__ = ("num_running", "num_waiting", "held_bytes", "held", "refused_request_ids", "evicted_request_ids", "assist_steps", "proposed_draft_tokens", "accepted_draft_tokens", "lost_replicas", "flushed", "streamed")
    NUM_RUNNING_FIELD_NUMBER: _ClassVar[int]
    NUM_WAITING_FIELD_NUMBER: _ClassVar[int]
    HELD_BYTES_FIELD_NUMBER: _ClassVar[int]
    HELD_FIELD_NUMBER: _ClassVar[int]
    REFUSED_REQUEST_IDS_FIELD_NUMBER: _ClassVar[int]
    EVICTED_REQUEST_IDS_FIELD_NUMBER: _ClassVar[int]
    ASSIST_STEPS_FIELD_NUMBER: _ClassVar[int]
    PROPOSED_DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    LOST_REPLICAS_FIELD_NUMBER: _ClassVar[int]
    FLUSHED_FIELD_NUMBER: _ClassVar[int]
    STREAMED_FIELD_NUMBER: _ClassVar[int]
    num_running: int
    num_waiting: int
    held_bytes: int
    held: _containers.RepeatedCompositeFieldContainer[HeldCheckpoint]
    refused_request_ids: _containers.RepeatedScalarFieldContainer[int]
    evicted_request_ids: _containers.RepeatedScalarFieldContainer[int]
    assist_steps: int
    proposed_draft_tokens: int
    accepted_draft_tokens: int
    lost_replicas: _containers.RepeatedCompositeFieldContainer[LostReplica]
    flushed: bool
    streamed: _containers.RepeatedCompositeFieldContainer[StreamedReplica]
    def __init__(self, num_running: _Optional[int] = ..., num_waiting: _Optional[int] = ..., held_bytes: _Optional[int] = ..., held: _Optional[_Iterable[_Union[HeldCheckpoint, _Mapping]]] = ..., refused_request_ids: _Optional[_Iterable[int]] = ..., evicted_request_ids: _Optional[_Iterable[int]] = ..., assist_steps: _Optional[int] = ..., proposed_draft_tokens: _Optional[int] = ..., accepted_draft_tokens: _Optional[int] = ..., lost_replicas: _Optional[_Iterable[_Union[LostReplica, _Mapping]]] = ..., flushed: _Optional[bool] = ..., streamed: _Optional[_Iterable[_Union[StreamedReplica, _Mapping]]] = ...) -> None: ...

class StreamedReplica(_message.Message):
    __slots__ = ("request_id", "epoch", "holder_worker_id", "durable_tokens")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    HOLDER_WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    DURABLE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    request_id: int
    epoch: int
    holder_worker_id: int
    durable_tokens: int
    def __init__(self, request_id: _Optional[int] = ..., epoch: _Optional[int] = ..., holder_worker_id: _Optional[int] = ..., durable_tokens: _Optional[int] = ...) -> None: ...

class HeartbeatRequest(_message.Message):
    __slots__ = ("worker_id", "epoch", "state", "report", "acked_sequence")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    REPORT_FIELD_NUMBER: _ClassVar[int]
    ACKED_SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    worker_id: int
    epoch: int
    state: WorkerState
    report: WorkerReport
    acked_sequence: int
    def __init__(self, worker_id: _Optional[int] = ..., epoch: _Optional[int] = ..., state: _Optional[_Union[WorkerState, str]] = ..., report: _Optional[_Union[WorkerReport, _Mapping]] = ..., acked_sequence: _Optional[int] = ...) -> None: ...

class HeartbeatReply(_message.Message):
    __slots__ = ("fenced", "reregister", "reason", "lease_s", "directives", "num_draft_tokens")
    FENCED_FIELD_NUMBER: _ClassVar[int]
    REREGISTER_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    LEASE_S_FIELD_NUMBER: _ClassVar[int]
    DIRECTIVES_FIELD_NUMBER: _ClassVar[int]
    NUM_DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    fenced: bool
    reregister: bool
    reason: str
    lease_s: float
    directives: _containers.RepeatedCompositeFieldContainer[Directive]
    num_draft_tokens: int
    def __init__(self, fenced: _Optional[bool] = ..., reregister: _Optional[bool] = ..., reason: _Optional[str] = ..., lease_s: _Optional[float] = ..., directives: _Optional[_Iterable[_Union[Directive, _Mapping]]] = ..., num_draft_tokens: _Optional[int] = ...) -> None: ...

class DirectivesRequest(_message.Message):
    __slots__ = ("worker_id", "epoch", "after_sequence")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    AFTER_SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    worker_id: int
    epoch: int
    after_sequence: int
    def __init__(self, worker_id: _Optional[int] = ..., epoch: _Optional[int] = ..., after_sequence: _Optional[int] = ...) -> None: ...

class RequestTokens(_message.Message):
    __slots__ = ("request_id", "epoch", "start_position", "token_ids", "finished", "error", "failed")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    START_POSITION_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    FINISHED_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    FAILED_FIELD_NUMBER: _ClassVar[int]
    request_id: int
    epoch: int
    start_position: int
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    finished: bool
    error: str
    failed: bool
    def __init__(self, request_id: _Optional[int] = ..., epoch: _Optional[int] = ..., start_position: _Optional[int] = ..., token_ids: _Optional[_Iterable[int]] = ..., finished: _Optional[bool] = ..., error: _Optional[str] = ..., failed: _Optional[bool] = ...) -> None: ...

class TokenReport(_message.Message):
    __slots__ = ("worker_id", "worker_epoch", "requests")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    WORKER_EPOCH_FIELD_NUMBER: _ClassVar[int]
    REQUESTS_FIELD_NUMBER: _ClassVar[int]
    worker_id: int
    worker_epoch: int
    requests: _containers.RepeatedCompositeFieldContainer[RequestTokens]
    def __init__(self, worker_id: _Optional[int] = ..., worker_epoch: _Optional[int] = ..., requests: _Optional[_Iterable[_Union[RequestTokens, _Mapping]]] = ...) -> None: ...

class TokenAck(_message.Message):
    __slots__ = ("request_id", "num_new", "num_conflicts", "next_position", "code", "details")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_NEW_FIELD_NUMBER: _ClassVar[int]
    NUM_CONFLICTS_FIELD_NUMBER: _ClassVar[int]
    NEXT_POSITION_FIELD_NUMBER: _ClassVar[int]
    CODE_FIELD_NUMBER: _ClassVar[int]
    DETAILS_FIELD_NUMBER: _ClassVar[int]
    request_id: int
    num_new: int
    num_conflicts: int
    next_position: int
    code: int
    details: str
    def __init__(self, request_id: _Optional[int] = ..., num_new: _Optional[int] = ..., num_conflicts: _Optional[int] = ..., next_position: _Optional[int] = ..., code: _Optional[int] = ..., details: _Optional[str] = ...) -> None: ...

class TokenAcks(_message.Message):
    __slots__ = ("acks",)
    ACKS_FIELD_NUMBER: _ClassVar[int]
    acks: _containers.RepeatedCompositeFieldContainer[TokenAck]
    def __init__(self, acks: _Optional[_Iterable[_Union[TokenAck, _Mapping]]] = ...) -> None: ...

class ExitReport(_message.Message):
    __slots__ = ("worker_id", "epoch", "reason")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    worker_id: int
    epoch: int
    reason: str
    def __init__(self, worker_id: _Optional[int] = ..., epoch: _Optional[int] = ..., reason: _Optional[str] = ...) -> None: ...

class ExitReply(_message.Message):
    __slots__ = ("failed",)
    FAILED_FIELD_NUMBER: _ClassVar[int]
    failed: bool
    def __init__(self, failed: _Optional[bool] = ...) -> None: ...

class ModelLoadedRequest(_message.Message):
    __slots__ = ("worker_id", "epoch", "budget_bytes", "domain")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    BUDGET_BYTES_FIELD_NUMBER: _ClassVar[int]
    DOMAIN_FIELD_NUMBER: _ClassVar[int]
    worker_id: int
    epoch: int
    budget_bytes: int
    domain: str
    def __init__(self, worker_id: _Optional[int] = ..., epoch: _Optional[int] = ..., budget_bytes: _Optional[int] = ..., domain: _Optional[str] = ...) -> None: ...

class ModelLoadedReply(_message.Message):
    __slots__ = ("freed_survivor_id",)
    FREED_SURVIVOR_ID_FIELD_NUMBER: _ClassVar[int]
    freed_survivor_id: int
    def __init__(self, freed_survivor_id: _Optional[int] = ...) -> None: ...

class SubmitRequest(_message.Message):
    __slots__ = ("prompt_token_ids", "max_new_tokens", "expected_output_tokens")
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    MAX_NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    EXPECTED_OUTPUT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    max_new_tokens: int
    expected_output_tokens: int
    def __init__(self, prompt_token_ids: _Optional[_Iterable[int]] = ..., max_new_tokens: _Optional[int] = ..., expected_output_tokens: _Optional[int] = ...) -> None: ...

class WatchRequest(_message.Message):
    __slots__ = ("request_id", "from_position")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    FROM_POSITION_FIELD_NUMBER: _ClassVar[int]
    request_id: int
    from_position: int
    def __init__(self, request_id: _Optional[int] = ..., from_position: _Optional[int] = ...) -> None: ...

class TokenChunk(_message.Message):
    __slots__ = ("request_id", "start_position", "token_ids", "finished")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    START_POSITION_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    FINISHED_FIELD_NUMBER: _ClassVar[int]
    request_id: int
    start_position: int
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    finished: bool
    def __init__(self, request_id: _Optional[int] = ..., start_position: _Optional[int] = ..., token_ids: _Optional[_Iterable[int]] = ..., finished: _Optional[bool] = ...) -> None: ...

class StatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class DrainRequest(_message.Message):
    __slots__ = ("worker_id", "deadline_s")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    DEADLINE_S_FIELD_NUMBER: _ClassVar[int]
    worker_id: int
    deadline_s: float
    def __init__(self, worker_id: _Optional[int] = ..., deadline_s: _Optional[float] = ...) -> None: ...

class DrainReply(_message.Message):
    __slots__ = ("worker_id", "state", "num_requests", "num_moved", "num_reprefilled", "started_s", "finished_s")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    NUM_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    NUM_MOVED_FIELD_NUMBER: _ClassVar[int]
    NUM_REPREFILLED_FIELD_NUMBER: _ClassVar[int]
    STARTED_S_FIELD_NUMBER: _ClassVar[int]
    FINISHED_S_FIELD_NUMBER: _ClassVar[int]
    worker_id: int
    state: str
    num_requests: int
    num_moved: int
    num_reprefilled: int
    started_s: float
    finished_s: float
    def __init__(self, worker_id: _Optional[int] = ..., state: _Optional[str] = ..., num_requests: _Optional[int] = ..., num_moved: _Optional[int] = ..., num_reprefilled: _Optional[int] = ..., started_s: _Optional[float] = ..., finished_s: _Optional[float] = ...) -> None: ...

class WorkerStatus(_message.Message):
    __slots__ = ("worker_id", "epoch", "state", "load", "queue_depth", "held_bytes")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    LOAD_FIELD_NUMBER: _ClassVar[int]
    QUEUE_DEPTH_FIELD_NUMBER: _ClassVar[int]
    HELD_BYTES_FIELD_NUMBER: _ClassVar[int]
    worker_id: int
    epoch: int
    state: str
    load: float
    queue_depth: int
    held_bytes: int
    def __init__(self, worker_id: _Optional[int] = ..., epoch: _Optional[int] = ..., state: _Optional[str] = ..., load: _Optional[float] = ..., queue_depth: _Optional[int] = ..., held_bytes: _Optional[int] = ...) -> None: ...

class StatusReply(_message.Message):
    __slots__ = ("policy", "workers", "num_requests", "num_finished", "num_failures")
    POLICY_FIELD_NUMBER: _ClassVar[int]
    WORKERS_FIELD_NUMBER: _ClassVar[int]
    NUM_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    NUM_FINISHED_FIELD_NUMBER: _ClassVar[int]
    NUM_FAILURES_FIELD_NUMBER: _ClassVar[int]
    policy: str
    workers: _containers.RepeatedCompositeFieldContainer[WorkerStatus]
    num_requests: int
    num_finished: int
    num_failures: int
    def __init__(self, policy: _Optional[str] = ..., workers: _Optional[_Iterable[_Union[WorkerStatus, _Mapping]]] = ..., num_requests: _Optional[int] = ..., num_finished: _Optional[int] = ..., num_failures: _Optional[int] = ...) -> None: ...
