from seer.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class BatchState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    BATCH_STATE_UNSPECIFIED: _ClassVar[BatchState]
    BATCH_STATE_RUNNING: _ClassVar[BatchState]
    BATCH_STATE_COMPLETED: _ClassVar[BatchState]
    BATCH_STATE_CANCELLED: _ClassVar[BatchState]

class RequestState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    REQUEST_STATE_UNSPECIFIED: _ClassVar[RequestState]
    REQUEST_STATE_PENDING: _ClassVar[RequestState]
    REQUEST_STATE_RUNNING: _ClassVar[RequestState]
    REQUEST_STATE_FINISHED: _ClassVar[RequestState]
    REQUEST_STATE_CANCELLED: _ClassVar[RequestState]
BATCH_STATE_UNSPECIFIED: BatchState
BATCH_STATE_RUNNING: BatchState
BATCH_STATE_COMPLETED: BatchState
BATCH_STATE_CANCELLED: BatchState
REQUEST_STATE_UNSPECIFIED: RequestState
REQUEST_STATE_PENDING: RequestState
REQUEST_STATE_RUNNING: RequestState
REQUEST_STATE_FINISHED: RequestState
REQUEST_STATE_CANCELLED: RequestState

class PromptGroup(_message.Message):
    __slots__ = ("prompt_key", "prompt_token_ids", "prompt_text", "group_size", "max_tokens", "sampling", "labels")
    class LabelsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    PROMPT_KEY_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TEXT_FIELD_NUMBER: _ClassVar[int]
    GROUP_SIZE_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    LABELS_FIELD_NUMBER: _ClassVar[int]
    prompt_key: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    prompt_text: str
    group_size: int
    max_tokens: int
    sampling: _common_pb2.SamplingParams
    labels: _containers.ScalarMap[str, str]
    def __init__(self, prompt_key: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., prompt_text: _Optional[str] = ..., group_size: _Optional[int] = ..., max_tokens: _Optional[int] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., labels: _Optional[_Mapping[str, str]] = ...) -> None: ...

class SubmitBatchRequest(_message.Message):
    __slots__ = ("batch_id", "groups", "seed_scope", "submission_token")
    BATCH_ID_FIELD_NUMBER: _ClassVar[int]
    GROUPS_FIELD_NUMBER: _ClassVar[int]
    SEED_SCOPE_FIELD_NUMBER: _ClassVar[int]
    SUBMISSION_TOKEN_FIELD_NUMBER: _ClassVar[int]
    batch_id: str
    groups: _containers.RepeatedCompositeFieldContainer[PromptGroup]
    seed_scope: str
    submission_token: str
    def __init__(self, batch_id: _Optional[str] = ..., groups: _Optional[_Iterable[_Union[PromptGroup, _Mapping]]] = ..., seed_scope: _Optional[str] = ..., submission_token: _Optional[str] = ...) -> None: ...

class SubmitBatchResponse(_message.Message):
    __slots__ = ("batch_id", "num_requests", "already_submitted", "policy_version", "submission_id")
    BATCH_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    ALREADY_SUBMITTED_FIELD_NUMBER: _ClassVar[int]
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    SUBMISSION_ID_FIELD_NUMBER: _ClassVar[int]
    batch_id: str
    num_requests: int
    already_submitted: bool
    policy_version: int
    submission_id: int
    def __init__(self, batch_id: _Optional[str] = ..., num_requests: _Optional[int] = ..., already_submitted: _Optional[bool] = ..., policy_version: _Optional[int] = ..., submission_id: _Optional[int] = ...) -> None: ...

class StreamResultsRequest(_message.Message):
    __slots__ = ("batch_id", "cursor", "submission_id")
    BATCH_ID_FIELD_NUMBER: _ClassVar[int]
    CURSOR_FIELD_NUMBER: _ClassVar[int]
    SUBMISSION_ID_FIELD_NUMBER: _ClassVar[int]
    batch_id: str
    cursor: int
    submission_id: int
    def __init__(self, batch_id: _Optional[str] = ..., cursor: _Optional[int] = ..., submission_id: _Optional[int] = ...) -> None: ...

class StreamResultsResponse(_message.Message):
    __slots__ = ("cursor", "result", "submission_id")
    CURSOR_FIELD_NUMBER: _ClassVar[int]
    RESULT_FIELD_NUMBER: _ClassVar[int]
    SUBMISSION_ID_FIELD_NUMBER: _ClassVar[int]
    cursor: int
    result: RolloutResult
    submission_id: int
    def __init__(self, cursor: _Optional[int] = ..., result: _Optional[_Union[RolloutResult, _Mapping]] = ..., submission_id: _Optional[int] = ...) -> None: ...

class RolloutResult(_message.Message):
    __slots__ = ("request_id", "batch_id", "group_index", "sample_index", "prompt_key", "token_ids", "logprobs", "finish_reason", "policy_version", "stats", "num_chunks", "latency_seconds", "labels", "text")
    class LabelsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    BATCH_ID_FIELD_NUMBER: _ClassVar[int]
    GROUP_INDEX_FIELD_NUMBER: _ClassVar[int]
    SAMPLE_INDEX_FIELD_NUMBER: _ClassVar[int]
    PROMPT_KEY_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    STATS_FIELD_NUMBER: _ClassVar[int]
    NUM_CHUNKS_FIELD_NUMBER: _ClassVar[int]
    LATENCY_SECONDS_FIELD_NUMBER: _ClassVar[int]
    LABELS_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    batch_id: str
    group_index: int
    sample_index: int
    prompt_key: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    logprobs: _containers.RepeatedScalarFieldContainer[float]
    finish_reason: _common_pb2.FinishReason
    policy_version: int
    stats: _common_pb2.ChunkStats
    num_chunks: int
    latency_seconds: float
    labels: _containers.ScalarMap[str, str]
    text: str
    def __init__(self, request_id: _Optional[str] = ..., batch_id: _Optional[str] = ..., group_index: _Optional[int] = ..., sample_index: _Optional[int] = ..., prompt_key: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., logprobs: _Optional[_Iterable[float]] = ..., finish_reason: _Optional[_Union[_common_pb2.FinishReason, str]] = ..., policy_version: _Optional[int] = ..., stats: _Optional[_Union[_common_pb2.ChunkStats, _Mapping]] = ..., num_chunks: _Optional[int] = ..., latency_seconds: _Optional[float] = ..., labels: _Optional[_Mapping[str, str]] = ..., text: _Optional[str] = ...) -> None: ...

class GetBatchRequest(_message.Message):
    __slots__ = ("batch_id", "include_requests")
    BATCH_ID_FIELD_NUMBER: _ClassVar[int]
    INCLUDE_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    batch_id: str
    include_requests: bool
    def __init__(self, batch_id: _Optional[str] = ..., include_requests: _Optional[bool] = ...) -> None: ...

class RequestStatus(_message.Message):
    __slots__ = ("request_id", "state", "generated_tokens", "num_chunks", "finish_reason")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    GENERATED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_CHUNKS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    state: RequestState
    generated_tokens: int
    num_chunks: int
    finish_reason: _common_pb2.FinishReason
    def __init__(self, request_id: _Optional[str] = ..., state: _Optional[_Union[RequestState, str]] = ..., generated_tokens: _Optional[int] = ..., num_chunks: _Optional[int] = ..., finish_reason: _Optional[_Union[_common_pb2.FinishReason, str]] = ...) -> None: ...

class GetBatchResponse(_message.Message):
    __slots__ = ("batch_id", "state", "num_requests", "num_finished", "num_cancelled", "generated_tokens", "policy_version", "requests", "submission_id", "unreadable_requests")
    BATCH_ID_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    NUM_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    NUM_FINISHED_FIELD_NUMBER: _ClassVar[int]
    NUM_CANCELLED_FIELD_NUMBER: _ClassVar[int]
    GENERATED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    REQUESTS_FIELD_NUMBER: _ClassVar[int]
    SUBMISSION_ID_FIELD_NUMBER: _ClassVar[int]
    UNREADABLE_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    batch_id: str
    state: BatchState
    num_requests: int
    num_finished: int
    num_cancelled: int
    generated_tokens: int
    policy_version: int
    requests: _containers.RepeatedCompositeFieldContainer[RequestStatus]
    submission_id: int
    unreadable_requests: str
    def __init__(self, batch_id: _Optional[str] = ..., state: _Optional[_Union[BatchState, str]] = ..., num_requests: _Optional[int] = ..., num_finished: _Optional[int] = ..., num_cancelled: _Optional[int] = ..., generated_tokens: _Optional[int] = ..., policy_version: _Optional[int] = ..., requests: _Optional[_Iterable[_Union[RequestStatus, _Mapping]]] = ..., submission_id: _Optional[int] = ..., unreadable_requests: _Optional[str] = ...) -> None: ...

class CancelBatchRequest(_message.Message):
    __slots__ = ("batch_id", "submission_token")
    BATCH_ID_FIELD_NUMBER: _ClassVar[int]
    SUBMISSION_TOKEN_FIELD_NUMBER: _ClassVar[int]
    batch_id: str
    submission_token: str
    def __init__(self, batch_id: _Optional[str] = ..., submission_token: _Optional[str] = ...) -> None: ...

class CancelBatchResponse(_message.Message):
    __slots__ = ("state", "num_cancelled")
    STATE_FIELD_NUMBER: _ClassVar[int]
    NUM_CANCELLED_FIELD_NUMBER: _ClassVar[int]
    state: BatchState
    num_cancelled: int
    def __init__(self, state: _Optional[_Union[BatchState, str]] = ..., num_cancelled: _Optional[int] = ...) -> None: ...

class UpdateWeightsRequest(_message.Message):
    __slots__ = ("version", "source")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    version: int
    source: str
    def __init__(self, version: _Optional[int] = ..., source: _Optional[str] = ...) -> None: ...

class UpdateWeightsResponse(_message.Message):
    __slots__ = ("version", "num_workers", "seconds")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    NUM_WORKERS_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    version: int
    num_workers: int
    seconds: float
    def __init__(self, version: _Optional[int] = ..., num_workers: _Optional[int] = ..., seconds: _Optional[float] = ...) -> None: ...
