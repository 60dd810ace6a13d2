"""The SSD tier: RocksDB through rocksdict (raw bytes keys and values).

Layout on disk:
- one column family per namespace (model version), named "ns:<namespace>", holding
  b"d" + page_hash -> page bytes (large: stored in blob files, so compaction does not rewrite them)
  b"m" + page_hash -> small JSON metadata (checksum algorithm, checksum, size, access sequence, owners)
  Dropping a namespace is one drop_column_family: no per-page deletes, the blob files go with it.
  A column family is created by the first page written to its namespace and may be dropped again
  once the namespace holds no page on this tier (the store decides when): every column family has
  its own memtables, so one kept per namespace ever seen (a new one per policy version) would grow
  RocksDB's memory and the DB's open/flush work without bound.
- the default column family holds the namespace registry: b"ns/" + name -> JSON record.

Memtables (unflushed writes, page bytes included: blob files are written at flush) are capped
across all column families by one db-wide write buffer (write_buffer_bytes): once they pass 7/8 of
it, the next write makes RocksDB flush the column family with the oldest memtable. Without it every
column family has its own budget (64 MiB, x2 while one flushes), and a deleted page stays in its
memtable (a delete is one more entry; it frees nothing) until that memtable flushes, which only its
own column family's writes trigger: an old version's released pages stayed in memory for good.

Data and metadata of a page are written in one WriteBatch, so after a crash a page either exists
with its metadata or not at all. Pages skip the write-ahead log by default (wal=False): a page is a
cache entry, so writing it twice (WAL + blob file) buys nothing; a crash loses at most the pages of
the unflushed memtable (misses: the worker recomputes), close() flushes everything. The namespace
registry always goes through the WAL. Callers serialize access (the store holds a lock).
"""

from __future__ import annotations

import gc
import os

from rocksdict import DBCompressionType, Options, Rdict, ReadOptions, WriteBatch, WriteOptions

_DATA = b"d"
_META = b"m"
_REGISTRY = b"ns/"
DEFAULT_WRITE_BUFFER_BYTES = 64 * 1024 * 1024  # RocksDB's default for one memtable, here for all


def _cf_name(namespace: str) -> str:
    return "ns:" + namespace


class SsdTier:
    def __init__(
        self,
        path: str,
        *,
        min_blob_bytes: int = 64 * 1024,
        wal: bool = False,
        verify_page_reads: bool = True,
        write_buffer_bytes: int = DEFAULT_WRITE_BUFFER_BYTES,
    ) -> None:
        if write_buffer_bytes <= 0:
            raise ValueError(f"write_buffer_bytes: must be > 0, got {write_buffer_bytes}")
        os.makedirs(path, exist_ok=True)
        self.path = path
        self._open = False  # RocksDB refuses every call once closed (DbClosedError)
        self._page_write = WriteOptions()
        self._page_write.disable_wal = not wal  # type: ignore[method-assign,assignment]  # a property at runtime
        # RocksDB's own checksums of page reads (crc32c of the blob record): the rocksdict build
        # computes crc32c in software here (~1 GB/s, a 5x slower page read than without). A caller
        # that checks every page against its own checksum (the store does by default) turns them off.
        self._page_read = ReadOptions()
        self._page_read.set_verify_checksums(verify_page_reads)
        self._opts = Options(raw_mode=True)
        self._opts.create_if_missing(True)
        self._opts.create_missing_column_families(True)
        # Pages (~0.7 MiB for SmolLM2 in float32) live in blob files: the LSM tree only holds
        # pointers, so compactions stay cheap however many pages are stored.
        self._opts.set_enable_blob_files(True)
        self._opts.set_min_blob_size(min_blob_bytes)
        self._opts.set_enable_blob_gc(True)
        # KV pages are incompressible floats: compressing them is pure CPU cost.
        self._opts.set_compression_type(DBCompressionType.none())
        # One memtable budget for the whole DB, however many column families are open (see above).
        self._opts.set_db_write_buffer_size(write_buffer_bytes)
        existing = Rdict.list_cf(path, self._opts) if os.path.exists(os.path.join(path, "CURRENT")) else []
        self._db = Rdict(path, self._opts, column_families={name: self._opts for name in existing})
        self._open = True
        self._cfs: dict[str, Rdict] = {}
        try:
            for name in existing:
                if name.startswith("ns:"):
                    self._cfs[name[3:]] = self._db.get_column_family(name)
        except BaseException:
            self.close()  # else the LOCK stays held by this process: a retry could not open it
            raise

    # Namespace registry (default column family).
    def registry(self) -> dict[str, bytes]:
        out: dict[str, bytes] = {}
        it = self._db.iter()
        it.seek(_REGISTRY)
        while it.valid():
            key = it.key()
            if not key.startswith(_REGISTRY):
                break
            out[key[len(_REGISTRY) :].decode("utf-8")] = it.value()
            it.next()
        del it
        return out

    def put_registry(self, namespace: str, record: bytes) -> None:
        self._db.put(_REGISTRY + namespace.encode("utf-8"), record)

    def delete_registry(self, namespace: str) -> None:
        self._db.delete(_REGISTRY + namespace.encode("utf-8"))

    # Namespaces (column families).
    def ensure_namespace(self, namespace: str) -> None:
        if namespace not in self._cfs:
            self._cfs[namespace] = self._db.create_column_family(_cf_name(namespace), self._opts)

    def drop_namespace(self, namespace: str) -> None:
        """Drops a namespace's column family, pages and all (no-op when it has none). Its memtables
        are freed once no handle to it is alive: the tier's own is let go first."""
        cf = self._cfs.pop(namespace, None)
        if cf is None:
            return
        del cf
        try:
            self._db.drop_column_family(_cf_name(namespace))
        except BaseException:
            # Still in RocksDB: keep a handle so it stays usable (a later drop retries); without one
            # the next put would try to create it again and fail on the existing name.
            self._cfs[namespace] = self._db.get_column_family(_cf_name(namespace))
            raise

    def namespaces(self) -> list[str]:
        return list(self._cfs)

    def memtable_bytes(self) -> int:
        """Bytes RocksDB holds in memtables (rocksdb.cur-size-all-mem-tables: unflushed and
        flushing ones), summed over the open column families, the registry's default one included;
        0 once closed. The property is per column family, read from memory (~2 us each), and only
        namespaces with SSD pages (plus a few idle ones) have a column family, so this stays cheap
        enough for every stats call."""
        if not self._open:
            return 0
        prop = "rocksdb.cur-size-all-mem-tables"
        total = self._db.property_int_value(prop) or 0
        for cf in self._cfs.values():
            total += cf.property_int_value(prop) or 0
        return total

    # Pages.
    def put(self, namespace: str, page_hash: bytes, data: bytes | memoryview, meta: bytes) -> None:
        self.ensure_namespace(namespace)
        wb = WriteBatch(raw_mode=True)
        wb.set_default_column_family(self._db.get_column_family_handle(_cf_name(namespace)))
        wb.put(_DATA + page_hash, data if isinstance(data, bytes) else bytes(data))  # rocksdict takes bytes only
        wb.put(_META + page_hash, meta)
        self._db.write(wb, self._page_write)

    def put_meta(self, namespace: str, page_hash: bytes, meta: bytes) -> None:
        """Rewrites a stored page's metadata (KeyError when its namespace has no column family: the
        page is not on this tier, and a record without its page must not be created)."""
        self._cfs[namespace].put(_META + page_hash, meta, self._page_write)

    def get(self, namespace: str, page_hash: bytes) -> bytes | None:
        cf = self._cfs.get(namespace)
        if cf is None:
            return None
        value = cf.get(_DATA + page_hash, read_opt=self._page_read)
        return None if value is None else bytes(value)

    def delete(self, namespace: str, page_hash: bytes) -> None:
        cf = self._cfs.get(namespace)
        if cf is None:
            return
        wb = WriteBatch(raw_mode=True)
        wb.set_default_column_family(self._db.get_column_family_handle(_cf_name(namespace)))
        wb.delete(_DATA + page_hash)
        wb.delete(_META + page_hash)
        self._db.write(wb, self._page_write)

    def iter_meta(self, namespace: str) -> list[tuple[bytes, bytes]]:
        """(page_hash, metadata) of every page of a namespace (reads only the small meta values).

        A list, not a generator: a generator suspended in a failed recovery would keep its
        column-family handle (and so the DB's LOCK) alive in the exception's traceback."""
        cf = self._cfs.get(namespace)
        if cf is None:
            return []
        out: list[tuple[bytes, bytes]] = []
        it = cf.iter()
        try:
            it.seek(_META)
            while it.valid():
                key = it.key()
                if not key.startswith(_META):
                    break
                out.append((key[len(_META) :], it.value()))
                it.next()
        finally:
            del it
        return out

    def raw_column_family(self, namespace: str) -> Rdict | None:
        """The namespace's column family (tests use it to corrupt a page on disk)."""
        return self._cfs.get(namespace)

    def flush(self) -> None:
        """Makes every written page durable (memtables to SST/blob files)."""
        for cf in self._cfs.values():
            cf.flush(True)
        self._db.flush(True)
        self._db.flush_wal(True)

    def close(self) -> None:
        # rocksdict releases the DB lock only when no column-family handle is alive.
        self._open = False
        self._cfs.clear()
        try:
            self._db.close()
        finally:
            gc.collect()
