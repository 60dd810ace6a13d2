from seer.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class WorkItem(_message.Message):
    __slots__ = ("request_id", "batch_id", "group_id", "group_index", "sample_index", "group_size", "prompt_key", "prompt_token_ids", "output_token_ids", "max_tokens", "sampling", "policy_version", "next_seq", "trace_context", "submit_seq")
    class TraceContextEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    BATCH_ID_FIELD_NUMBER: _ClassVar[int]
    GROUP_ID_FIELD_NUMBER: _ClassVar[int]
    GROUP_INDEX_FIELD_NUMBER: _ClassVar[int]
    SAMPLE_INDEX_FIELD_NUMBER: _ClassVar[int]
    GROUP_SIZE_FIELD_NUMBER: _ClassVar[int]
    PROMPT_KEY_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    NEXT_SEQ_FIELD_NUMBER: _ClassVar[int]
    TRACE_CONTEXT_FIELD_NUMBER: _ClassVar[int]
    SUBMIT_SEQ_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    batch_id: str
    group_id: str
    group_index: int
    sample_index: int
    group_size: int
    prompt_key: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    output_token_ids: _containers.RepeatedScalarFieldContainer[int]
    max_tokens: int
    sampling: _common_pb2.SamplingParams
    policy_version: int
    next_seq: int
    trace_context: _containers.ScalarMap[str, str]
    submit_seq: int
    def __init__(self, request_id: _Optional[str] = ..., batch_id: _Optional[str] = ..., group_id: _Optional[str] = ..., group_index: _Optional[int] = ..., sample_index: _Optional[int] = ..., group_size: _Optional[int] = ..., prompt_key: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., output_token_ids: _Optional[_Iterable[int]] = ..., max_tokens: _Optional[int] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., policy_version: _Optional[int] = ..., next_seq: _Optional[int] = ..., trace_context: _Optional[_Mapping[str, str]] = ..., submit_seq: _Optional[int] = ...) -> None: ...

class WatchWorkRequest(_message.Message):
    __slots__ = ("watcher_id",)
    WATCHER_ID_FIELD_NUMBER: _ClassVar[int]
    watcher_id: str
    def __init__(self, watcher_id: _Optional[str] = ...) -> None: ...

class WorkItemBatch(_message.Message):
    __slots__ = ("items",)
    ITEMS_FIELD_NUMBER: _ClassVar[int]
    items: _containers.RepeatedCompositeFieldContainer[WorkItem]
    def __init__(self, items: _Optional[_Iterable[_Union[WorkItem, _Mapping]]] = ...) -> None: ...

class WatchWorkResponse(_message.Message):
    __slots__ = ("added", "cancelled_request_id", "snapshot_done", "policy")
    ADDED_FIELD_NUMBER: _ClassVar[int]
    CANCELLED_REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    SNAPSHOT_DONE_FIELD_NUMBER: _ClassVar[int]
    POLICY_FIELD_NUMBER: _ClassVar[int]
    added: WorkItemBatch
    cancelled_request_id: str
    snapshot_done: bool
    policy: PolicyState
    def __init__(self, added: _Optional[_Union[WorkItemBatch, _Mapping]] = ..., cancelled_request_id: _Optional[str] = ..., snapshot_done: _Optional[bool] = ..., policy: _Optional[_Union[PolicyState, _Mapping]] = ...) -> None: ...

class PolicyState(_message.Message):
    __slots__ = ("version", "source")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    version: int
    source: str
    def __init__(self, version: _Optional[int] = ..., source: _Optional[str] = ...) -> None: ...

class CommitChunkRequest(_message.Message):
    __slots__ = ("request_id", "seq", "token_ids", "logprobs", "finish_reason", "policy_version", "worker_id", "stats", "submit_seq")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    SEQ_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    STATS_FIELD_NUMBER: _ClassVar[int]
    SUBMIT_SEQ_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    seq: int
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    logprobs: _containers.RepeatedScalarFieldContainer[float]
    finish_reason: _common_pb2.FinishReason
    policy_version: int
    worker_id: str
    stats: _common_pb2.ChunkStats
    submit_seq: int
    def __init__(self, request_id: _Optional[str] = ..., seq: _Optional[int] = ..., token_ids: _Optional[_Iterable[int]] = ..., logprobs: _Optional[_Iterable[float]] = ..., finish_reason: _Optional[_Union[_common_pb2.FinishReason, str]] = ..., policy_version: _Optional[int] = ..., worker_id: _Optional[str] = ..., stats: _Optional[_Union[_common_pb2.ChunkStats, _Mapping]] = ..., submit_seq: _Optional[int] = ...) -> None: ...

class CommitChunkResponse(_message.Message):
    __slots__ = ("duplicate", "next_seq", "generated_tokens", "request_finished", "accepted")
    DUPLICATE_FIELD_NUMBER: _ClassVar[int]
    NEXT_SEQ_FIELD_NUMBER: _ClassVar[int]
    GENERATED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    REQUEST_FINISHED_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    duplicate: bool
    next_seq: int
    generated_tokens: int
    request_finished: bool
    accepted: bool
    def __init__(self, duplicate: _Optional[bool] = ..., next_seq: _Optional[int] = ..., generated_tokens: _Optional[int] = ..., request_finished: _Optional[bool] = ..., accepted: _Optional[bool] = ...) -> None: ...

class GetHistoryRequest(_message.Message):
    __slots__ = ("prompt_keys", "include_tokens")
    PROMPT_KEYS_FIELD_NUMBER: _ClassVar[int]
    INCLUDE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    prompt_keys: _containers.RepeatedScalarFieldContainer[str]
    include_tokens: bool
    def __init__(self, prompt_keys: _Optional[_Iterable[str]] = ..., include_tokens: _Optional[bool] = ...) -> None: ...

class TokenIds(_message.Message):
    __slots__ = ("token_ids",)
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class PromptHistory(_message.Message):
    __slots__ = ("prompt_key", "lengths", "policy_version", "responses")
    PROMPT_KEY_FIELD_NUMBER: _ClassVar[int]
    LENGTHS_FIELD_NUMBER: _ClassVar[int]
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    RESPONSES_FIELD_NUMBER: _ClassVar[int]
    prompt_key: str
    lengths: _containers.RepeatedScalarFieldContainer[int]
    policy_version: int
    responses: _containers.RepeatedCompositeFieldContainer[TokenIds]
    def __init__(self, prompt_key: _Optional[str] = ..., lengths: _Optional[_Iterable[int]] = ..., policy_version: _Optional[int] = ..., responses: _Optional[_Iterable[_Union[TokenIds, _Mapping]]] = ...) -> None: ...

class GetHistoryResponse(_message.Message):
    __slots__ = ("histories", "omitted_prompt_keys")
    HISTORIES_FIELD_NUMBER: _ClassVar[int]
    OMITTED_PROMPT_KEYS_FIELD_NUMBER: _ClassVar[int]
    histories: _containers.RepeatedCompositeFieldContainer[PromptHistory]
    omitted_prompt_keys: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, histories: _Optional[_Iterable[_Union[PromptHistory, _Mapping]]] = ..., omitted_prompt_keys: _Optional[_Iterable[str]] = ...) -> None: ...
