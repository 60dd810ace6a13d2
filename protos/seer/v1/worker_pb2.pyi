from seer.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class RunChunkRequest(_message.Message):
    __slots__ = ("request_id", "batch_id", "group_id", "prompt_key", "seq", "prompt_token_ids", "output_token_ids", "max_new_tokens", "max_tokens", "sampling", "policy_version", "is_probe", "group_size", "fetch_kv", "dispatch_epoch", "submit_seq")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    BATCH_ID_FIELD_NUMBER: _ClassVar[int]
    GROUP_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_KEY_FIELD_NUMBER: _ClassVar[int]
    SEQ_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    MAX_NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    IS_PROBE_FIELD_NUMBER: _ClassVar[int]
    GROUP_SIZE_FIELD_NUMBER: _ClassVar[int]
    FETCH_KV_FIELD_NUMBER: _ClassVar[int]
    DISPATCH_EPOCH_FIELD_NUMBER: _ClassVar[int]
    SUBMIT_SEQ_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    batch_id: str
    group_id: str
    prompt_key: str
    seq: int
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    output_token_ids: _containers.RepeatedScalarFieldContainer[int]
    max_new_tokens: int
    max_tokens: int
    sampling: _common_pb2.SamplingParams
    policy_version: int
    is_probe: bool
    group_size: int
    fetch_kv: bool
    dispatch_epoch: int
    submit_seq: int
    def __init__(self, request_id: _Optional[str] = ..., batch_id: _Optional[str] = ..., group_id: _Optional[str] = ..., prompt_key: _Optional[str] = ..., seq: _Optional[int] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., output_token_ids: _Optional[_Iterable[int]] = ..., max_new_tokens: _Optional[int] = ..., max_tokens: _Optional[int] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., policy_version: _Optional[int] = ..., is_probe: _Optional[bool] = ..., group_size: _Optional[int] = ..., fetch_kv: _Optional[bool] = ..., dispatch_epoch: _Optional[int] = ..., submit_seq: _Optional[int] = ...) -> None: ...

class TokenDelta(_message.Message):
    __slots__ = ("token_ids", "logprobs")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    logprobs: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., logprobs: _Optional[_Iterable[float]] = ...) -> None: ...

class ChunkDone(_message.Message):
    __slots__ = ("finish_reason", "stats", "policy_version")
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    STATS_FIELD_NUMBER: _ClassVar[int]
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    finish_reason: _common_pb2.FinishReason
    stats: _common_pb2.ChunkStats
    policy_version: int
    def __init__(self, finish_reason: _Optional[_Union[_common_pb2.FinishReason, str]] = ..., stats: _Optional[_Union[_common_pb2.ChunkStats, _Mapping]] = ..., policy_version: _Optional[int] = ...) -> None: ...

class RunChunkResponse(_message.Message):
    __slots__ = ("tokens", "done")
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    DONE_FIELD_NUMBER: _ClassVar[int]
    tokens: TokenDelta
    done: ChunkDone
    def __init__(self, tokens: _Optional[_Union[TokenDelta, _Mapping]] = ..., done: _Optional[_Union[ChunkDone, _Mapping]] = ...) -> None: ...

class AbortRequest(_message.Message):
    __slots__ = ("request_id", "dispatch_epoch")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    DISPATCH_EPOCH_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    dispatch_epoch: int
    def __init__(self, request_id: _Optional[str] = ..., dispatch_epoch: _Optional[int] = ...) -> None: ...

class AbortResponse(_message.Message):
    __slots__ = ("found",)
    FOUND_FIELD_NUMBER: _ClassVar[int]
    found: bool
    def __init__(self, found: _Optional[bool] = ...) -> None: ...

class LoadWeightsRequest(_message.Message):
    __slots__ = ("version", "source")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    version: int
    source: str
    def __init__(self, version: _Optional[int] = ..., source: _Optional[str] = ...) -> None: ...

class LoadWeightsResponse(_message.Message):
    __slots__ = ("version", "seconds")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    version: int
    seconds: float
    def __init__(self, version: _Optional[int] = ..., seconds: _Optional[float] = ...) -> None: ...

class GetWorkerStatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetWorkerStatsResponse(_message.Message):
    __slots__ = ("worker_id", "total_kv_pages", "free_kv_pages", "page_size", "running", "waiting", "tokens_per_second", "policy_version", "accepted_per_position", "proposed_per_position", "prefill_tokens", "cached_tokens", "kv_loaded_tokens", "kv_recomputed_pages", "kv_refetches", "invalid_drafts", "kv_releases_dropped")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    TOTAL_KV_PAGES_FIELD_NUMBER: _ClassVar[int]
    FREE_KV_PAGES_FIELD_NUMBER: _ClassVar[int]
    PAGE_SIZE_FIELD_NUMBER: _ClassVar[int]
    RUNNING_FIELD_NUMBER: _ClassVar[int]
    WAITING_FIELD_NUMBER: _ClassVar[int]
    TOKENS_PER_SECOND_FIELD_NUMBER: _ClassVar[int]
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_PER_POSITION_FIELD_NUMBER: _ClassVar[int]
    PROPOSED_PER_POSITION_FIELD_NUMBER: _ClassVar[int]
    PREFILL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    KV_LOADED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    KV_RECOMPUTED_PAGES_FIELD_NUMBER: _ClassVar[int]
    KV_REFETCHES_FIELD_NUMBER: _ClassVar[int]
    INVALID_DRAFTS_FIELD_NUMBER: _ClassVar[int]
    KV_RELEASES_DROPPED_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    total_kv_pages: int
    free_kv_pages: int
    page_size: int
    running: int
    waiting: int
    tokens_per_second: float
    policy_version: int
    accepted_per_position: _containers.RepeatedScalarFieldContainer[int]
    proposed_per_position: _containers.RepeatedScalarFieldContainer[int]
    prefill_tokens: int
    cached_tokens: int
    kv_loaded_tokens: int
    kv_recomputed_pages: int
    kv_refetches: int
    invalid_drafts: int
    kv_releases_dropped: int
    def __init__(self, worker_id: _Optional[str] = ..., total_kv_pages: _Optional[int] = ..., free_kv_pages: _Optional[int] = ..., page_size: _Optional[int] = ..., running: _Optional[int] = ..., waiting: _Optional[int] = ..., tokens_per_second: _Optional[float] = ..., policy_version: _Optional[int] = ..., accepted_per_position: _Optional[_Iterable[int]] = ..., proposed_per_position: _Optional[_Iterable[int]] = ..., prefill_tokens: _Optional[int] = ..., cached_tokens: _Optional[int] = ..., kv_loaded_tokens: _Optional[int] = ..., kv_recomputed_pages: _Optional[int] = ..., kv_refetches: _Optional[int] = ..., invalid_drafts: _Optional[int] = ..., kv_releases_dropped: _Optional[int] = ...) -> None: ...
