"""Configuration of the KV store service (CLI flags, SEER_KVSTORE_* env vars, --config JSON)."""

from __future__ import annotations

from dataclasses import dataclass, field

from services.common.config import ServiceConfig
from services.common.streams import check_stream_limit
from services.kvstore.ssd import DEFAULT_WRITE_BUFFER_BYTES, wal_bytes_cap

GiB = 1024**3


@dataclass(frozen=True)
class KvStoreConfig(ServiceConfig):
    data_dir: str = field(default="./data/kvstore", metadata={"help": "RocksDB directory (the SSD tier)"})
    dram_bytes: int = field(default=2 * GiB, metadata={"help": "DRAM tier capacity in bytes (0 = SSD only)"})
    ssd_bytes: int = field(
        default=32 * GiB,
        metadata={
            "help": "SSD tier capacity in bytes; RocksDB's WAL cap (max(32 MiB, ssd_write_buffer_bytes / 2)) is "
            "reserved out of it, the rest is the page budget"
        },
    )
    keep_versions: int = field(
        default=1,
        metadata={"help": "namespaces kept per model family ('name@version'); a newer one drops older ones"},
    )
    verify_checksums: bool = field(
        default=True, metadata={"help": "verify the checksum of pages read from the SSD tier"}
    )
    verify_put_checksums: bool = field(
        default=True,
        metadata={
            "help": "verify every Put page's checksum (off: trust the writer's checksum; readers verify end to end)"
        },
    )
    ssd_wal: bool = field(
        default=False,
        metadata={"help": "write pages through RocksDB's WAL too (off: a crash loses only unflushed pages)"},
    )
    min_blob_bytes: int = field(
        default=64 * 1024, metadata={"help": "values at least this large go to RocksDB blob files"}
    )
    ssd_write_buffer_bytes: int = field(
        default=DEFAULT_WRITE_BUFFER_BYTES,
        metadata={
            "help": "RocksDB memtable memory (unflushed pages) for all namespaces together; "
            "past 7/8 of it the oldest memtable is flushed"
        },
    )
    max_page_message_bytes: int = field(
        default=4 * 1024 * 1024, metadata={"help": "largest page (one Put/Get message) accepted"}
    )
    tune_malloc: bool = field(
        default=True,
        metadata={"help": "raise glibc's mmap/trim thresholds: page buffers are reused (services/common/memtune.py)"},
    )
    malloc_arenas: int = field(
        default=1,
        metadata={"help": "with tune_malloc: glibc malloc arenas (1: freed page memory is reused by every thread)"},
    )
    malloc_trim_bytes: int = field(
        default=512 * 1024 * 1024,
        metadata={"help": "with tune_malloc: freed memory kept for reuse before glibc returns it to the OS"},
    )
    max_page_streams: int = field(
        default=0,
        metadata={
            "help": "Put+Get streams served at once, more are refused with RESOURCE_EXHAUSTED "
            "(0 = max_workers minus max(2, max_workers // 8), kept for Exists/Release/GetKvStats)"
        },
    )
    put_idle_timeout_seconds: float = field(
        default=30.0, metadata={"help": "cancel a Put stream that sends no message for this long (0 = never)"}
    )
    get_stall_timeout_seconds: float = field(
        default=30.0,
        metadata={"help": "cancel a Get stream whose client takes no message for this long (0 = never)"},
    )
    release_tombstone_seconds: float = field(
        default=600.0,
        metadata={"help": "after a request's Release, refuse its late Puts for this long (0 = off)"},
    )
    port_file: str = field(default="", metadata={"help": "write the bound port to this file"})

    def page_stream_limit(self) -> int:
        """The effective max_page_streams: each open stream holds a handler thread."""
        if self.max_page_streams:
            return self.max_page_streams
        return max(1, self.max_workers - max(2, self.max_workers // 8))

    def ssd_page_bytes(self) -> int:
        """The SSD tier's page budget (the store's ssd_bytes): ssd_bytes less the WAL's cap
        (ssd.wal_bytes_cap, RocksDB's max_total_wal_size). ValueError naming ssd_bytes when nothing
        would be left.

        Reserved, not measured: the WAL (owner records, deletes, the registry; pages too with
        ssd_wal) was outside --ssd-bytes (review of session 29). Counting its live size instead would
        list the DB directory under the store's lock on every capacity check, and evict pages for
        bytes that evicting does not free: each eviction's delete is one more WAL record, and only
        RocksDB's flush at the cap frees WAL files. The cap is what RocksDB holds the WAL to (it
        flushes the column families keeping the oldest WAL file once the total passes it), so
        reserving it keeps pages + WAL within ssd_bytes at a fixed cost, with no per-write work.
        Here, at the service's edge, and not in KvStore: a store built directly (tests, benches)
        keeps ssd_bytes as its page budget."""
        reserve = wal_bytes_cap(self.ssd_write_buffer_bytes)
        if self.ssd_bytes <= reserve:
            raise ValueError(
                f"ssd_bytes: must be > {reserve}, the WAL cap reserved out of it "
                f"(max(32 MiB, ssd_write_buffer_bytes / 2)), got {self.ssd_bytes}"
            )
        return self.ssd_bytes - reserve

    def check_largest_page_fits(self) -> None:
        """ValueError naming ssd_bytes when the largest page a Put may carry (max_page_message_bytes)
        fits neither tier: not the SSD page budget (ssd_page_bytes) and not the DRAM tier. Such a
        page goes straight to SSD and is refused there (RESOURCE_EXHAUSTED naming data, at every Put
        of it: storing it would evict the whole tier and still not fit), so a store with no DRAM and
        a budget below the model's page refused every Put, found only at the first one. The model's
        page size is known only from that first Put's layout, so the check is against the largest
        page accepted; a smaller model fits by lowering max_page_message_bytes.

        A page budget below that page beside a DRAM tier that holds it is valid: a store run on DRAM
        (--ssd-bytes just above the WAL cap, as the Helm chart test loads it), its larger pages
        evicted when they leave DRAM instead of demoted; open_store says so at the start."""
        budget = self.ssd_page_bytes()
        largest = self.max_page_message_bytes
        if max(budget, self.dram_bytes) >= largest:
            return
        reserve = self.ssd_bytes - budget
        raise ValueError(
            f"ssd_bytes: its page budget ({budget} bytes: {self.ssd_bytes} less the WAL cap {reserve}) holds no page "
            f"of max_page_message_bytes ({largest}), the largest a Put may carry, and neither does dram_bytes "
            f"({self.dram_bytes}): every Put of a page larger than both would be refused. Raise ssd_bytes to at "
            f"least {reserve + largest} or dram_bytes to at least {largest}, or lower max_page_message_bytes to "
            "the model's page size"
        )

    def validate(self) -> None:
        super().validate()
        if not self.data_dir:
            raise ValueError("data_dir: must not be empty")
        if self.dram_bytes < 0:
            raise ValueError(f"dram_bytes: must be >= 0, got {self.dram_bytes}")
        if self.ssd_bytes <= 0:
            raise ValueError(f"ssd_bytes: must be > 0, got {self.ssd_bytes}")
        if self.keep_versions < 1:
            raise ValueError(f"keep_versions: must be >= 1, got {self.keep_versions}")
        if self.min_blob_bytes < 0:
            raise ValueError(f"min_blob_bytes: must be >= 0, got {self.min_blob_bytes}")
        if self.ssd_write_buffer_bytes <= 0:
            raise ValueError(f"ssd_write_buffer_bytes: must be > 0, got {self.ssd_write_buffer_bytes}")
        if self.max_page_message_bytes <= 0:
            raise ValueError(f"max_page_message_bytes: must be > 0, got {self.max_page_message_bytes}")
        self.check_largest_page_fits()
        if self.malloc_arenas < 1:
            raise ValueError(f"malloc_arenas: must be >= 1, got {self.malloc_arenas}")
        if not 0 < self.malloc_trim_bytes < 2**31:  # glibc's M_TRIM_THRESHOLD is an int
            raise ValueError(f"malloc_trim_bytes: must be in (0, 2**31), got {self.malloc_trim_bytes}")
        check_stream_limit("max_page_streams", self.max_page_streams, self.max_workers, "Exists and Release")
        for name in ("put_idle_timeout_seconds", "get_stall_timeout_seconds", "release_tombstone_seconds"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name}: must be >= 0, got {getattr(self, name)}")
