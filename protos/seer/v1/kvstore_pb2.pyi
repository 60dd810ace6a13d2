from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class PageLayout(_message.Message):
    __slots__ = ("dtype", "page_size", "num_layers", "num_kv_heads", "head_dim", "layout")
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    PAGE_SIZE_FIELD_NUMBER: _ClassVar[int]
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_HEADS_FIELD_NUMBER: _ClassVar[int]
    HEAD_DIM_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    dtype: str
    page_size: int
    num_layers: int
    num_kv_heads: int
    head_dim: int
    layout: str
    def __init__(self, dtype: _Optional[str] = ..., page_size: _Optional[int] = ..., num_layers: _Optional[int] = ..., num_kv_heads: _Optional[int] = ..., head_dim: _Optional[int] = ..., layout: _Optional[str] = ...) -> None: ...

class PutRequest(_message.Message):
    __slots__ = ("namespace", "layout", "page_hash", "data", "request_id", "checksum")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    PAGE_HASH_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    CHECKSUM_FIELD_NUMBER: _ClassVar[int]
    namespace: str
    layout: PageLayout
    page_hash: bytes
    data: bytes
    request_id: str
    checksum: int
    def __init__(self, namespace: _Optional[str] = ..., layout: _Optional[_Union[PageLayout, _Mapping]] = ..., page_hash: _Optional[bytes] = ..., data: _Optional[bytes] = ..., request_id: _Optional[str] = ..., checksum: _Optional[int] = ...) -> None: ...

class PutResponse(_message.Message):
    __slots__ = ("stored_pages", "stored_bytes", "claimed_pages", "first_unclaimed")
    STORED_PAGES_FIELD_NUMBER: _ClassVar[int]
    STORED_BYTES_FIELD_NUMBER: _ClassVar[int]
    CLAIMED_PAGES_FIELD_NUMBER: _ClassVar[int]
    FIRST_UNCLAIMED_FIELD_NUMBER: _ClassVar[int]
    stored_pages: int
    stored_bytes: int
    claimed_pages: int
    first_unclaimed: int
    def __init__(self, stored_pages: _Optional[int] = ..., stored_bytes: _Optional[int] = ..., claimed_pages: _Optional[int] = ..., first_unclaimed: _Optional[int] = ...) -> None: ...

class GetRequest(_message.Message):
    __slots__ = ("namespace", "page_hashes", "layout")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    PAGE_HASHES_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    namespace: str
    page_hashes: _containers.RepeatedScalarFieldContainer[bytes]
    layout: PageLayout
    def __init__(self, namespace: _Optional[str] = ..., page_hashes: _Optional[_Iterable[bytes]] = ..., layout: _Optional[_Union[PageLayout, _Mapping]] = ...) -> None: ...

class GetResponse(_message.Message):
    __slots__ = ("page_hash", "data", "checksum", "missing")
    PAGE_HASH_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    CHECKSUM_FIELD_NUMBER: _ClassVar[int]
    MISSING_FIELD_NUMBER: _ClassVar[int]
    page_hash: bytes
    data: bytes
    checksum: int
    missing: bool
    def __init__(self, page_hash: _Optional[bytes] = ..., data: _Optional[bytes] = ..., checksum: _Optional[int] = ..., missing: _Optional[bool] = ...) -> None: ...

class ExistsRequest(_message.Message):
    __slots__ = ("namespace", "page_hashes")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    PAGE_HASHES_FIELD_NUMBER: _ClassVar[int]
    namespace: str
    page_hashes: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, namespace: _Optional[str] = ..., page_hashes: _Optional[_Iterable[bytes]] = ...) -> None: ...

class ExistsResponse(_message.Message):
    __slots__ = ("prefix_pages",)
    PREFIX_PAGES_FIELD_NUMBER: _ClassVar[int]
    prefix_pages: int
    def __init__(self, prefix_pages: _Optional[int] = ...) -> None: ...

class ReleaseRequest(_message.Message):
    __slots__ = ("namespace", "request_id", "page_hashes")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PAGE_HASHES_FIELD_NUMBER: _ClassVar[int]
    namespace: str
    request_id: str
    page_hashes: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, namespace: _Optional[str] = ..., request_id: _Optional[str] = ..., page_hashes: _Optional[_Iterable[bytes]] = ...) -> None: ...

class ReleaseResponse(_message.Message):
    __slots__ = ("released_pages",)
    RELEASED_PAGES_FIELD_NUMBER: _ClassVar[int]
    released_pages: int
    def __init__(self, released_pages: _Optional[int] = ...) -> None: ...

class GetKvStatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetKvStatsResponse(_message.Message):
    __slots__ = ("dram_bytes", "dram_capacity_bytes", "ssd_bytes", "ssd_capacity_bytes", "hits", "misses", "evictions", "namespaces", "pages", "dram_pages", "ssd_pages", "demotions", "promotions", "checksum_failures", "released_pages", "dropped_namespaces", "late_puts", "meta_write_failures", "refused_streams", "idle_put_streams_cancelled", "stalled_get_streams_cancelled", "column_families", "memtable_bytes", "flush_failures", "write_stalls", "write_stall_failures", "write_stall_seconds", "pending_ssd_records", "chain_links", "pending_ssd_bytes", "orphan_owner_records")
    DRAM_BYTES_FIELD_NUMBER: _ClassVar[int]
    DRAM_CAPACITY_BYTES_FIELD_NUMBER: _ClassVar[int]
    SSD_BYTES_FIELD_NUMBER: _ClassVar[int]
    SSD_CAPACITY_BYTES_FIELD_NUMBER: _ClassVar[int]
    HITS_FIELD_NUMBER: _ClassVar[int]
    MISSES_FIELD_NUMBER: _ClassVar[int]
    EVICTIONS_FIELD_NUMBER: _ClassVar[int]
    NAMESPACES_FIELD_NUMBER: _ClassVar[int]
    PAGES_FIELD_NUMBER: _ClassVar[int]
    DRAM_PAGES_FIELD_NUMBER: _ClassVar[int]
    SSD_PAGES_FIELD_NUMBER: _ClassVar[int]
    DEMOTIONS_FIELD_NUMBER: _ClassVar[int]
    PROMOTIONS_FIELD_NUMBER: _ClassVar[int]
    CHECKSUM_FAILURES_FIELD_NUMBER: _ClassVar[int]
    RELEASED_PAGES_FIELD_NUMBER: _ClassVar[int]
    DROPPED_NAMESPACES_FIELD_NUMBER: _ClassVar[int]
    LATE_PUTS_FIELD_NUMBER: _ClassVar[int]
    META_WRITE_FAILURES_FIELD_NUMBER: _ClassVar[int]
    REFUSED_STREAMS_FIELD_NUMBER: _ClassVar[int]
    IDLE_PUT_STREAMS_CANCELLED_FIELD_NUMBER: _ClassVar[int]
    STALLED_GET_STREAMS_CANCELLED_FIELD_NUMBER: _ClassVar[int]
    COLUMN_FAMILIES_FIELD_NUMBER: _ClassVar[int]
    MEMTABLE_BYTES_FIELD_NUMBER: _ClassVar[int]
    FLUSH_FAILURES_FIELD_NUMBER: _ClassVar[int]
    WRITE_STALLS_FIELD_NUMBER: _ClassVar[int]
    WRITE_STALL_FAILURES_FIELD_NUMBER: _ClassVar[int]
    WRITE_STALL_SECONDS_FIELD_NUMBER: _ClassVar[int]
    PENDING_SSD_RECORDS_FIELD_NUMBER: _ClassVar[int]
    CHAIN_LINKS_FIELD_NUMBER: _ClassVar[int]
    PENDING_SSD_BYTES_FIELD_NUMBER: _ClassVar[int]
    ORPHAN_OWNER_RECORDS_FIELD_NUMBER: _ClassVar[int]
    dram_bytes: int
    dram_capacity_bytes: int
    ssd_bytes: int
    ssd_capacity_bytes: int
    hits: int
    misses: int
    evictions: int
    namespaces: int
    pages: int
    dram_pages: int
    ssd_pages: int
    demotions: int
    promotions: int
    checksum_failures: int
    released_pages: int
    dropped_namespaces: int
    late_puts: int
    meta_write_failures: int
    refused_streams: int
    idle_put_streams_cancelled: int
    stalled_get_streams_cancelled: int
    column_families: int
    memtable_bytes: int
    flush_failures: int
    write_stalls: int
    write_stall_failures: int
    write_stall_seconds: float
    pending_ssd_records: int
    chain_links: int
    pending_ssd_bytes: int
    orphan_owner_records: int
    def __init__(self, dram_bytes: _Optional[int] = ..., dram_capacity_bytes: _Optional[int] = ..., ssd_bytes: _Optional[int] = ..., ssd_capacity_bytes: _Optional[int] = ..., hits: _Optional[int] = ..., misses: _Optional[int] = ..., evictions: _Optional[int] = ..., namespaces: _Optional[int] = ..., pages: _Optional[int] = ..., dram_pages: _Optional[int] = ..., ssd_pages: _Optional[int] = ..., demotions: _Optional[int] = ..., promotions: _Optional[int] = ..., checksum_failures: _Optional[int] = ..., released_pages: _Optional[int] = ..., dropped_namespaces: _Optional[int] = ..., late_puts: _Optional[int] = ..., meta_write_failures: _Optional[int] = ..., refused_streams: _Optional[int] = ..., idle_put_streams_cancelled: _Optional[int] = ..., stalled_get_streams_cancelled: _Optional[int] = ..., column_families: _Optional[int] = ..., memtable_bytes: _Optional[int] = ..., flush_failures: _Optional[int] = ..., write_stalls: _Optional[int] = ..., write_stall_failures: _Optional[int] = ..., write_stall_seconds: _Optional[float] = ..., pending_ssd_records: _Optional[int] = ..., chain_links: _Optional[int] = ..., pending_ssd_bytes: _Optional[int] = ..., orphan_owner_records: _Optional[int] = ...) -> None: ...
