from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class WorkerCapacity(_message.Message):
    __slots__ = ("total_kv_pages", "page_size", "max_batch_size", "max_context")
    TOTAL_KV_PAGES_FIELD_NUMBER: _ClassVar[int]
    PAGE_SIZE_FIELD_NUMBER: _ClassVar[int]
    MAX_BATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    MAX_CONTEXT_FIELD_NUMBER: _ClassVar[int]
    total_kv_pages: int
    page_size: int
    max_batch_size: int
    max_context: int
    def __init__(self, total_kv_pages: _Optional[int] = ..., page_size: _Optional[int] = ..., max_batch_size: _Optional[int] = ..., max_context: _Optional[int] = ...) -> None: ...

class RegisterWorkerRequest(_message.Message):
    __slots__ = ("worker_id", "address", "capacity", "engine", "policy_version", "incarnation", "engine_broken")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_FIELD_NUMBER: _ClassVar[int]
    ENGINE_FIELD_NUMBER: _ClassVar[int]
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    ENGINE_BROKEN_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    address: str
    capacity: WorkerCapacity
    engine: str
    policy_version: int
    incarnation: str
    engine_broken: str
    def __init__(self, worker_id: _Optional[str] = ..., address: _Optional[str] = ..., capacity: _Optional[_Union[WorkerCapacity, _Mapping]] = ..., engine: _Optional[str] = ..., policy_version: _Optional[int] = ..., incarnation: _Optional[str] = ..., engine_broken: _Optional[str] = ...) -> None: ...

class RegisterWorkerResponse(_message.Message):
    __slots__ = ("heartbeat_interval_seconds",)
    HEARTBEAT_INTERVAL_SECONDS_FIELD_NUMBER: _ClassVar[int]
    heartbeat_interval_seconds: float
    def __init__(self, heartbeat_interval_seconds: _Optional[float] = ...) -> None: ...

class WorkerTelemetry(_message.Message):
    __slots__ = ("free_kv_pages", "used_kv_pages", "running", "waiting", "tokens_per_second", "policy_version", "accepted_per_position", "proposed_per_position")
    FREE_KV_PAGES_FIELD_NUMBER: _ClassVar[int]
    USED_KV_PAGES_FIELD_NUMBER: _ClassVar[int]
    RUNNING_FIELD_NUMBER: _ClassVar[int]
    WAITING_FIELD_NUMBER: _ClassVar[int]
    TOKENS_PER_SECOND_FIELD_NUMBER: _ClassVar[int]
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_PER_POSITION_FIELD_NUMBER: _ClassVar[int]
    PROPOSED_PER_POSITION_FIELD_NUMBER: _ClassVar[int]
    free_kv_pages: int
    used_kv_pages: int
    running: int
    waiting: int
    tokens_per_second: float
    policy_version: int
    accepted_per_position: _containers.RepeatedScalarFieldContainer[int]
    proposed_per_position: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, free_kv_pages: _Optional[int] = ..., used_kv_pages: _Optional[int] = ..., running: _Optional[int] = ..., waiting: _Optional[int] = ..., tokens_per_second: _Optional[float] = ..., policy_version: _Optional[int] = ..., accepted_per_position: _Optional[_Iterable[int]] = ..., proposed_per_position: _Optional[_Iterable[int]] = ...) -> None: ...

class HeartbeatRequest(_message.Message):
    __slots__ = ("worker_id", "telemetry", "draining", "incarnation", "engine_broken", "engine_failing")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    TELEMETRY_FIELD_NUMBER: _ClassVar[int]
    DRAINING_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    ENGINE_BROKEN_FIELD_NUMBER: _ClassVar[int]
    ENGINE_FAILING_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    telemetry: WorkerTelemetry
    draining: bool
    incarnation: str
    engine_broken: str
    engine_failing: str
    def __init__(self, worker_id: _Optional[str] = ..., telemetry: _Optional[_Union[WorkerTelemetry, _Mapping]] = ..., draining: _Optional[bool] = ..., incarnation: _Optional[str] = ..., engine_broken: _Optional[str] = ..., engine_failing: _Optional[str] = ...) -> None: ...

class HeartbeatResponse(_message.Message):
    __slots__ = ("known",)
    KNOWN_FIELD_NUMBER: _ClassVar[int]
    known: bool
    def __init__(self, known: _Optional[bool] = ...) -> None: ...

class SwitchWeightsRequest(_message.Message):
    __slots__ = ("version", "source")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    version: int
    source: str
    def __init__(self, version: _Optional[int] = ..., source: _Optional[str] = ...) -> None: ...

class SwitchWeightsResponse(_message.Message):
    __slots__ = ("num_workers", "seconds")
    NUM_WORKERS_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    num_workers: int
    seconds: float
    def __init__(self, num_workers: _Optional[int] = ..., seconds: _Optional[float] = ...) -> None: ...

class GetSchedulerStatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class WorkerInfo(_message.Message):
    __slots__ = ("worker_id", "address", "healthy", "quarantined", "in_flight_chunks", "telemetry", "draining", "quarantine_reason", "engine_broken", "engine_failing")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    HEALTHY_FIELD_NUMBER: _ClassVar[int]
    QUARANTINED_FIELD_NUMBER: _ClassVar[int]
    IN_FLIGHT_CHUNKS_FIELD_NUMBER: _ClassVar[int]
    TELEMETRY_FIELD_NUMBER: _ClassVar[int]
    DRAINING_FIELD_NUMBER: _ClassVar[int]
    QUARANTINE_REASON_FIELD_NUMBER: _ClassVar[int]
    ENGINE_BROKEN_FIELD_NUMBER: _ClassVar[int]
    ENGINE_FAILING_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    address: str
    healthy: bool
    quarantined: bool
    in_flight_chunks: int
    telemetry: WorkerTelemetry
    draining: bool
    quarantine_reason: str
    engine_broken: str
    engine_failing: str
    def __init__(self, worker_id: _Optional[str] = ..., address: _Optional[str] = ..., healthy: _Optional[bool] = ..., quarantined: _Optional[bool] = ..., in_flight_chunks: _Optional[int] = ..., telemetry: _Optional[_Union[WorkerTelemetry, _Mapping]] = ..., draining: _Optional[bool] = ..., quarantine_reason: _Optional[str] = ..., engine_broken: _Optional[str] = ..., engine_failing: _Optional[str] = ...) -> None: ...

class GetSchedulerStatsResponse(_message.Message):
    __slots__ = ("policy", "pending_requests", "in_flight_chunks", "dispatched_chunks", "redispatched_chunks", "workers", "policy_version")
    POLICY_FIELD_NUMBER: _ClassVar[int]
    PENDING_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    IN_FLIGHT_CHUNKS_FIELD_NUMBER: _ClassVar[int]
    DISPATCHED_CHUNKS_FIELD_NUMBER: _ClassVar[int]
    REDISPATCHED_CHUNKS_FIELD_NUMBER: _ClassVar[int]
    WORKERS_FIELD_NUMBER: _ClassVar[int]
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    policy: str
    pending_requests: int
    in_flight_chunks: int
    dispatched_chunks: int
    redispatched_chunks: int
    workers: _containers.RepeatedCompositeFieldContainer[WorkerInfo]
    policy_version: int
    def __init__(self, policy: _Optional[str] = ..., pending_requests: _Optional[int] = ..., in_flight_chunks: _Optional[int] = ..., dispatched_chunks: _Optional[int] = ..., redispatched_chunks: _Optional[int] = ..., workers: _Optional[_Iterable[_Union[WorkerInfo, _Mapping]]] = ..., policy_version: _Optional[int] = ...) -> None: ...
