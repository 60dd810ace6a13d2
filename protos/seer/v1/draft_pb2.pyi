from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class AppendRequest(_message.Message):
    __slots__ = ("group_id", "request_id", "offset", "token_ids", "finished", "truncate", "epoch", "incarnation")
    GROUP_ID_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    FINISHED_FIELD_NUMBER: _ClassVar[int]
    TRUNCATE_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    group_id: str
    request_id: str
    offset: int
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    finished: bool
    truncate: bool
    epoch: int
    incarnation: int
    def __init__(self, group_id: _Optional[str] = ..., request_id: _Optional[str] = ..., offset: _Optional[int] = ..., token_ids: _Optional[_Iterable[int]] = ..., finished: _Optional[bool] = ..., truncate: _Optional[bool] = ..., epoch: _Optional[int] = ..., incarnation: _Optional[int] = ...) -> None: ...

class AppendResponse(_message.Message):
    __slots__ = ("appended_tokens", "duplicate_tokens")
    APPENDED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    DUPLICATE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    appended_tokens: int
    duplicate_tokens: int
    def __init__(self, appended_tokens: _Optional[int] = ..., duplicate_tokens: _Optional[int] = ...) -> None: ...

class GroupWatermark(_message.Message):
    __slots__ = ("group_id", "watermark", "incarnation")
    GROUP_ID_FIELD_NUMBER: _ClassVar[int]
    WATERMARK_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    group_id: str
    watermark: int
    incarnation: int
    def __init__(self, group_id: _Optional[str] = ..., watermark: _Optional[int] = ..., incarnation: _Optional[int] = ...) -> None: ...

class SequenceDelta(_message.Message):
    __slots__ = ("request_id", "offset", "token_ids", "finished", "truncate")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    FINISHED_FIELD_NUMBER: _ClassVar[int]
    TRUNCATE_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    offset: int
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    finished: bool
    truncate: bool
    def __init__(self, request_id: _Optional[str] = ..., offset: _Optional[int] = ..., token_ids: _Optional[_Iterable[int]] = ..., finished: _Optional[bool] = ..., truncate: _Optional[bool] = ...) -> None: ...

class TokenSequence(_message.Message):
    __slots__ = ("token_ids",)
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class GroupDelta(_message.Message):
    __slots__ = ("group_id", "watermark", "appends", "prompt_token_ids", "history", "gone", "incarnation", "reset", "expired", "reused", "reused_epoch", "reused_submit_seq", "submit_seq")
    GROUP_ID_FIELD_NUMBER: _ClassVar[int]
    WATERMARK_FIELD_NUMBER: _ClassVar[int]
    APPENDS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    HISTORY_FIELD_NUMBER: _ClassVar[int]
    GONE_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    RESET_FIELD_NUMBER: _ClassVar[int]
    EXPIRED_FIELD_NUMBER: _ClassVar[int]
    REUSED_FIELD_NUMBER: _ClassVar[int]
    REUSED_EPOCH_FIELD_NUMBER: _ClassVar[int]
    REUSED_SUBMIT_SEQ_FIELD_NUMBER: _ClassVar[int]
    SUBMIT_SEQ_FIELD_NUMBER: _ClassVar[int]
    group_id: str
    watermark: int
    appends: _containers.RepeatedCompositeFieldContainer[SequenceDelta]
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    history: _containers.RepeatedCompositeFieldContainer[TokenSequence]
    gone: bool
    incarnation: int
    reset: bool
    expired: bool
    reused: bool
    reused_epoch: int
    reused_submit_seq: int
    submit_seq: int
    def __init__(self, group_id: _Optional[str] = ..., watermark: _Optional[int] = ..., appends: _Optional[_Iterable[_Union[SequenceDelta, _Mapping]]] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., history: _Optional[_Iterable[_Union[TokenSequence, _Mapping]]] = ..., gone: _Optional[bool] = ..., incarnation: _Optional[int] = ..., reset: _Optional[bool] = ..., expired: _Optional[bool] = ..., reused: _Optional[bool] = ..., reused_epoch: _Optional[int] = ..., reused_submit_seq: _Optional[int] = ..., submit_seq: _Optional[int] = ...) -> None: ...

class SyncRequest(_message.Message):
    __slots__ = ("groups",)
    GROUPS_FIELD_NUMBER: _ClassVar[int]
    groups: _containers.RepeatedCompositeFieldContainer[GroupWatermark]
    def __init__(self, groups: _Optional[_Iterable[_Union[GroupWatermark, _Mapping]]] = ...) -> None: ...

class SyncResponse(_message.Message):
    __slots__ = ("groups",)
    GROUPS_FIELD_NUMBER: _ClassVar[int]
    groups: _containers.RepeatedCompositeFieldContainer[GroupDelta]
    def __init__(self, groups: _Optional[_Iterable[_Union[GroupDelta, _Mapping]]] = ...) -> None: ...

class SeedHistoryRequest(_message.Message):
    __slots__ = ("prompt_key", "iteration", "responses")
    PROMPT_KEY_FIELD_NUMBER: _ClassVar[int]
    ITERATION_FIELD_NUMBER: _ClassVar[int]
    RESPONSES_FIELD_NUMBER: _ClassVar[int]
    prompt_key: str
    iteration: int
    responses: _containers.RepeatedCompositeFieldContainer[TokenSequence]
    def __init__(self, prompt_key: _Optional[str] = ..., iteration: _Optional[int] = ..., responses: _Optional[_Iterable[_Union[TokenSequence, _Mapping]]] = ...) -> None: ...

class SeedHistoryResponse(_message.Message):
    __slots__ = ("num_responses",)
    NUM_RESPONSES_FIELD_NUMBER: _ClassVar[int]
    num_responses: int
    def __init__(self, num_responses: _Optional[int] = ...) -> None: ...

class RegisterGroupRequest(_message.Message):
    __slots__ = ("group_id", "prompt_key", "prompt_token_ids", "ttl_seconds", "group_size", "epoch", "submit_seq", "policy_version")
    GROUP_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_KEY_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TTL_SECONDS_FIELD_NUMBER: _ClassVar[int]
    GROUP_SIZE_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    SUBMIT_SEQ_FIELD_NUMBER: _ClassVar[int]
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    group_id: str
    prompt_key: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    ttl_seconds: int
    group_size: int
    epoch: int
    submit_seq: int
    policy_version: int
    def __init__(self, group_id: _Optional[str] = ..., prompt_key: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., ttl_seconds: _Optional[int] = ..., group_size: _Optional[int] = ..., epoch: _Optional[int] = ..., submit_seq: _Optional[int] = ..., policy_version: _Optional[int] = ...) -> None: ...

class RegisterGroupResponse(_message.Message):
    __slots__ = ("created", "history_responses", "incarnation", "submit_seq")
    CREATED_FIELD_NUMBER: _ClassVar[int]
    HISTORY_RESPONSES_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    SUBMIT_SEQ_FIELD_NUMBER: _ClassVar[int]
    created: bool
    history_responses: int
    incarnation: int
    submit_seq: int
    def __init__(self, created: _Optional[bool] = ..., history_responses: _Optional[int] = ..., incarnation: _Optional[int] = ..., submit_seq: _Optional[int] = ...) -> None: ...

class GetDraftStatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetDraftStatsResponse(_message.Message):
    __slots__ = ("groups", "history_keys", "indexed_tokens", "memory_bytes", "memory_budget_bytes", "bytes_per_token", "evicted_history", "expired_groups", "evicted_groups", "remembered_ids_bytes")
    GROUPS_FIELD_NUMBER: _ClassVar[int]
    HISTORY_KEYS_FIELD_NUMBER: _ClassVar[int]
    INDEXED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MEMORY_BYTES_FIELD_NUMBER: _ClassVar[int]
    MEMORY_BUDGET_BYTES_FIELD_NUMBER: _ClassVar[int]
    BYTES_PER_TOKEN_FIELD_NUMBER: _ClassVar[int]
    EVICTED_HISTORY_FIELD_NUMBER: _ClassVar[int]
    EXPIRED_GROUPS_FIELD_NUMBER: _ClassVar[int]
    EVICTED_GROUPS_FIELD_NUMBER: _ClassVar[int]
    REMEMBERED_IDS_BYTES_FIELD_NUMBER: _ClassVar[int]
    groups: int
    history_keys: int
    indexed_tokens: int
    memory_bytes: int
    memory_budget_bytes: int
    bytes_per_token: float
    evicted_history: int
    expired_groups: int
    evicted_groups: int
    remembered_ids_bytes: int
    def __init__(self, groups: _Optional[int] = ..., history_keys: _Optional[int] = ..., indexed_tokens: _Optional[int] = ..., memory_bytes: _Optional[int] = ..., memory_budget_bytes: _Optional[int] = ..., bytes_per_token: _Optional[float] = ..., evicted_history: _Optional[int] = ..., expired_groups: _Optional[int] = ..., evicted_groups: _Optional[int] = ..., remembered_ids_bytes: _Optional[int] = ...) -> None: ...
