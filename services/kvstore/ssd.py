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
it, the next write makes RocksDB flush the column family with the oldest memtable. That cap is soft
(the flush runs in the background while writes go on), so each column family also has a hard one:
MAX_WRITE_BUFFERS memtables of a quarter of the budget, after which its writes wait for the flush. Without it every
column family has its own budget (64 MiB, x2 while one flushes), and a deleted page stays in its
memtable (a delete is one more entry; it frees nothing) until that memtable flushes, which only its
own column family's writes trigger: an old version's released pages stayed in memory for good.

Data and metadata of a page are written in one WriteBatch, so after a crash a page either exists
with its metadata or not at all. Pages skip the write-ahead log by default (wal=False): a page is a
cache entry, so writing it twice (WAL + blob file) buys nothing; a crash loses at most the pages of
the unflushed memtable (misses: the worker recomputes), close() flushes everything. The namespace
registry always goes through the WAL, and so do page deletes and owner-record rewrites (put_meta):
those are not cache fills but the index's ownership state, and a WAL-less one sat in the memtable
after the store had counted it done, so a crash (SIGKILL) lost it and a released page came back
owned by the request that had released it (review of session 27). They are small records, so the
WAL costs little (see _logged_write). A page put whose key has a delete or owner rewrite pending
goes through the WAL too (put(logged=True)): the store resolves the pending record once the put
returns, so a WAL-less put lost at a crash would bring back the old record (review of session 27).

The WAL is capped (max_total_wal_size, wal_bytes_cap): a WAL file is kept while any column family
has unflushed writes in it, and the default column family (the registry) is written only when a
namespace is made or dropped, so its one unflushed registry record kept every later WAL file: with
RocksDB's default cap (4x the memtables' maximum, per column family) owner records alone grew the
WAL to about 400 MB, outside --ssd-bytes. Past the cap RocksDB flushes the column families that
hold the oldest WAL file, and it is deleted. The service reserves the cap out of --ssd-bytes
(KvStoreConfig.ssd_page_bytes). Callers serialize access (the store holds a lock).
"""

from __future__ import annotations

import gc
import os
import time
from collections.abc import Callable

from rocksdict import DBCompressionType, Options, Rdict, ReadOptions, WriteBatch, WriteOptions

from services.common.log import get_logger, kv

log = get_logger(__name__)

_DATA = b"d"
_META = b"m"
_REGISTRY = b"ns/"
DEFAULT_WRITE_BUFFER_BYTES = 64 * 1024 * 1024  # RocksDB's default for one memtable, here for all
MAX_WRITE_BUFFERS = 2  # memtables per column family: one written while one flushes (RocksDB's minimum)
L0_STOP_WRITES_TRIGGER = 36  # RocksDB's default: L0 files at which writes stop until compaction
_MIN_MEMTABLE_BYTES = 64 * 1024  # RocksDB raises smaller write_buffer_size values to this
MIN_WAL_BYTES = 32 * 1024 * 1024  # the WAL cap's floor (see wal_bytes_cap)


# How long a write waits, retrying, for RocksDB to take it while its memtables are full (a flush under
# way). Past it the write fails (the store answers UNAVAILABLE / evicts the demoted page): a flush
# that cannot finish (disk full) must not hang the writer, and with it the store's lock, for good.
WRITE_STALL_TIMEOUT_S = 10.0
# How long a write waits instead while the tier is stalled (a write stalled out, and the stop that
# did it is still on: see SsdTier.stalled).
STALLED_TRY_S = 0.05
# How often a deferrable write is tried anyway while the tier is stalled (SsdTier.may_try).
STALLED_PROBE_S = 1.0


# What a write stop is, for the error a caller passes on: RocksDB stops writes (no_slowdown: the
# "Write stall" status) while a column family's memtables are all full and flushing, or while its L0
# holds L0_STOP_WRITES_TRIGGER files awaiting compaction.
STALL_CAUSE = (
    "RocksDB write stop: memtables full with a flush not finishing, "
    f"or {L0_STOP_WRITES_TRIGGER} L0 files awaiting compaction"
)


class WriteStalled(Exception):
    """RocksDB took no write for write_stall_timeout_s (a write stop, STALL_CAUSE); or, while the tier
    is stalled (a write stalled out and RocksDB has not lifted that stop since), for STALLED_TRY_S."""


def _is_stall(exc: Exception) -> bool:
    # Status::Incomplete("Write stall"), what a no_slowdown write gets instead of blocking.
    return "write stall" in str(exc).lower()


def per_cf_write_buffer_bytes(write_buffer_bytes: int) -> int:
    """One memtable of a column family: a quarter of the db-wide budget, so a column family holds at
    most half of it (MAX_WRITE_BUFFERS of them) and two written at once (a version change) all of it."""
    return max(_MIN_MEMTABLE_BYTES, write_buffer_bytes // 4)


def wal_bytes_cap(write_buffer_bytes: int) -> int:
    """The WAL's cap (max_total_wal_size): past it RocksDB flushes the column families holding the
    oldest WAL file, so it can be deleted. Half the memtable budget: the logged records of one
    column family (a namespace's owner records and deletes) fill at most its MAX_WRITE_BUFFERS
    memtables, half the budget (per_cf_write_buffer_bytes), and a record's WAL entry is no larger
    than its memtable entry, so the live WAL of the usual single written namespace stays under the
    cap and forces no early flush; only files kept by a column family written rarely (the registry's)
    or not lately are flushed out. At least MIN_WAL_BYTES: with a small budget (tests, tiny
    stores) a cap of a few MiB would flush every few hundred records, each flush an L0 file."""
    return max(MIN_WAL_BYTES, write_buffer_bytes // 2)


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
        # A write that finds the memtables full fails at once instead of blocking in RocksDB, which
        # holds the GIL (every thread of the process stops) and, should the flush never finish
        # (disk full), never returns: _write retries it for a bounded time instead.
        self._page_write.no_slowdown = True  # type: ignore[method-assign,assignment]
        # Writes that must survive a process crash once they return: the namespace registry, page
        # deletes and owner-record rewrites (see the module doc). Through the WAL (written, not
        # fsynced: a process crash keeps it, a power loss may not), and no_slowdown like the pages.
        # Their records are tens to hundreds of bytes, so the WAL adds little: measured here (2000
        # pages, session 27) a put_meta 1.2 -> 2.6 us, a delete 2-4 -> 3.6-6 us; a Release costs
        # far more in Python.
        # A page's own put stays WAL-less, so after a crash a logged owner record may be replayed
        # while the put it rewrote is lost: a record without its page. Recovery indexes it (telling
        # would mean reading every page: an iterator loads blob values) and the first Get of it
        # finds no data and drops it, a miss (KvStore.get_page).
        self._logged_write = WriteOptions()
        self._logged_write.no_slowdown = True  # type: ignore[method-assign,assignment]
        self.write_stall_timeout_s = WRITE_STALL_TIMEOUT_S
        # Write-stop accounting (GetKvStats): writes that met a stop and waited, writes that failed
        # on one (WriteStalled), seconds spent waiting. _stalled: a write stalled out and RocksDB
        # has reported no lift of that stop since (see the stalled property); then a write waits
        # STALLED_TRY_S only (see _write).
        self.write_stalls = 0
        self.write_stall_failures = 0
        self.write_stall_seconds = 0.0
        self._stalled = False
        self._last_probe = 0.0  # may_try's last probe of a stalled tier
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
        # And a hard one per column family: at most MAX_WRITE_BUFFERS memtables of a quarter of the
        # budget each; a write finding them all full waits for a flush (RocksDB's write stop, which
        # returns the error when the flush fails, e.g. disk full). The db-wide budget alone is soft:
        # it switches the mutable memtable past 7/8 of it, but a burst then fills the next one up to
        # RocksDB's per column family default of 64 MiB (x2) while the flush runs: a burst of 720 KiB
        # pages peaked at 130 MiB in memtables with a 64 MiB budget, 130 MiB (8x) with 16 MiB, and
        # 16x with 8 namespaces written at once; now 0.5x, 1x with two namespaces (a version change),
        # n/2 x with n. Not WriteBufferManager(allow_stall=True), which is hard for the whole DB: its
        # stalled writers wait until a flush frees memory, so a flush that cannot (disk full) would
        # hang every write, under the store's lock, for good.
        self._opts.set_write_buffer_size(per_cf_write_buffer_bytes(write_buffer_bytes))
        self._opts.set_max_write_buffer_number(MAX_WRITE_BUFFERS)
        # Write stops only, never delays. RocksDB delays writes (throttles them to a rate) when L0
        # passes its slowdown trigger or pending compaction its soft limit, and a delayed write
        # sleeps inside RocksDB with the GIL held (rocksdict keeps it through the call) and the
        # store's lock taken: every thread of the process, health checks included, starved for the
        # delay, and a delay that turned into a stop meanwhile hung it (review, session 25). A
        # no_slowdown write is refused at once under either, and retried (_write) sleeping in
        # Python; refused under a delay, each try booked its delay again and a burst crawled (0.5
        # pages/s). So the slowdown trigger is the stop trigger (the stop is checked first) and the
        # soft limit is off (0); with MAX_WRITE_BUFFERS 2 the memtable count never delays either.
        self._opts.set_level_zero_slowdown_writes_trigger(L0_STOP_WRITES_TRIGGER)
        self._opts.set_level_zero_stop_writes_trigger(L0_STOP_WRITES_TRIGGER)
        self._opts.set_soft_pending_compaction_bytes_limit(0)
        # The WAL on disk is capped (see the module doc and wal_bytes_cap); the service reserves the
        # cap out of --ssd-bytes (KvStoreConfig.ssd_page_bytes).
        self._opts.set_max_total_wal_size(wal_bytes_cap(write_buffer_bytes))
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
        key = _REGISTRY + namespace.encode("utf-8")
        self._write(lambda opts: self._db.put(key, record, opts), self._logged_write)

    def delete_registry(self, namespace: str) -> None:
        key = _REGISTRY + namespace.encode("utf-8")
        self._write(lambda opts: self._db.delete(key, opts), self._logged_write)

    def _write(self, write: Callable[[WriteOptions], None], opts: WriteOptions) -> None:
        """Runs a no_slowdown write (with `opts`), retrying it while RocksDB reports a write stop
        (memtables full, a flush under way: the per column family cap at work; L0 at its stop
        trigger), sleeping between tries so the flush and compaction threads and every other Python
        thread run; WriteStalled after write_stall_timeout_s. (RocksDB is configured never to delay
        writes, only to stop them: see __init__.)

        Once a write has stalled out, the tier counts as stalled while that stop lasts (see
        stalled): each write meanwhile is retried for STALLED_TRY_S only (long enough for a memtable
        switch), then fails (WriteStalled). The caller holds the store's lock: waiting out the
        timeout again for every demoted page, page delete and owner record of a sustained stop (a
        compaction that cannot keep up, a full disk) kept every Get and Exists, DRAM hits included,
        waiting on that lock for 10 s per write. A write that finds the stop lifted, at its start
        or between two tries (a refusal after that is a new stop), waits the whole timeout like any
        write of a healthy tier: a short stop after a stall (one slow flush or compaction) is
        waited out, not refused."""
        start = time.monotonic()
        fast = self.stalled
        wait = min(STALLED_TRY_S, self.write_stall_timeout_s) if fast else self.write_stall_timeout_s
        deadline = start + wait
        pause = 0.001
        stopped = False
        while True:
            try:
                write(opts)
            except Exception as exc:
                if not _is_stall(exc):
                    raise
                if not stopped:
                    stopped = True
                    self.write_stalls += 1
                if fast and not self.stalled:
                    # The stop this write was failing fast on lifted; it is refused again: another
                    # stop, which a healthy tier waits out.
                    fast = False
                    wait = self.write_stall_timeout_s
                    deadline = start + wait
                now = time.monotonic()
                if now >= deadline:
                    self.write_stall_seconds += now - start
                    self.write_stall_failures += 1
                    since = "since an earlier write stalled out on this stop, " if fast else ""
                    if not self._stalled:
                        log.warning("RocksDB write stop outlasted the write timeout; writes fail fast while it lasts",
                                    extra=kv(path=self.path, waited_s=round(now - start, 3)))
                    self._stalled = True
                    raise WriteStalled(f"{STALL_CAUSE}; no write taken {since}for {wait:g} s ({exc})") from exc
            else:
                if stopped:
                    self.write_stall_seconds += time.monotonic() - start
                self._unstall()
                return
            time.sleep(pause)
            pause = min(pause * 2, 0.05)

    @property
    def stalled(self) -> bool:
        """Whether a write stalled out and the stop that did it is still on. RocksDB's own view of
        the stop (rocksdb.is-write-stopped, and a write delay should one ever be configured: a
        no_slowdown write is refused under both) ends it: read from memory, ~2 us. Until session 27
        only a write of ours that went through ended it, so after a stall that RocksDB had long
        lifted, a later short stop (one slow flush or compaction, > STALLED_TRY_S) failed every
        write meeting it, and deferrable writes waited for the next probe (may_try)."""
        if self._stalled and not self._refusing_writes():
            self._unstall()
        return self._stalled

    def _unstall(self) -> None:
        if self._stalled:
            self._stalled = False
            log.info("RocksDB takes writes again", extra=kv(path=self.path))

    def _refusing_writes(self) -> bool:
        """Whether RocksDB refuses no_slowdown writes now (a stop or a delay). True when it cannot
        say (closed, the property failed): the tier then stays as it was."""
        if not self._open:
            return True
        try:
            stopped = self._db.property_int_value("rocksdb.is-write-stopped")
            delayed = self._db.property_int_value("rocksdb.actual-delayed-write-rate")
        except Exception:
            return True
        return bool(stopped) or bool(delayed)

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
    def put(
        self, namespace: str, page_hash: bytes, data: bytes | memoryview, meta: bytes, *, logged: bool = False
    ) -> None:
        """Writes a page and its record in one batch, WAL-less unless `logged` (or the tier was
        opened with wal=True): logged when the put replaces a record the caller had pending (a
        delete or an owner rewrite, see the module doc), since the caller then forgets that record."""
        self.ensure_namespace(namespace)
        value = data if isinstance(data, bytes) else bytes(data)  # rocksdict takes bytes only

        def write(opts: WriteOptions) -> None:  # a batch is consumed by a write, failed or not: one per try
            wb = WriteBatch(raw_mode=True)
            wb.set_default_column_family(self._db.get_column_family_handle(_cf_name(namespace)))
            wb.put(_DATA + page_hash, value)
            wb.put(_META + page_hash, meta)
            self._db.write(wb, opts)

        self._write(write, self._logged_write if logged else self._page_write)

    def put_meta(self, namespace: str, page_hash: bytes, meta: bytes) -> None:
        """Rewrites a stored page's metadata (KeyError when its namespace has no column family: the
        page is not on this tier, and a record without its page must not be created)."""
        if namespace not in self._cfs:
            raise KeyError(namespace)
        # The handle is looked up inside the write, not held in a local: a failed write's traceback
        # (kept by a log record, e.g. a test's log capture) would keep the handle alive past
        # close(), and rocksdict releases the DB lock only when no handle is alive.
        self._write(lambda opts: self._cfs[namespace].put(_META + page_hash, meta, opts), self._logged_write)

    def may_try(self) -> bool:
        """Whether a deferrable write (an owner rewrite, a delete) should be tried now: always unless
        the tier is stalled; then once per STALLED_PROBE_S, so a tier whose only writes are
        deferrable ones still learns that RocksDB takes writes again."""
        if not self.stalled:
            return True
        now = time.monotonic()
        if now - self._last_probe < STALLED_PROBE_S:
            return False
        self._last_probe = now
        return True

    def get(self, namespace: str, page_hash: bytes) -> bytes | None:
        cf = self._cfs.get(namespace)
        if cf is None:
            return None
        value = cf.get(_DATA + page_hash, read_opt=self._page_read)
        return None if value is None else bytes(value)

    def get_meta(self, namespace: str, page_hash: bytes) -> bytes | None:
        """A page's record on disk (None when there is none): a small read, taken during a write stop."""
        cf = self._cfs.get(namespace)
        if cf is None:
            return None
        value = cf.get(_META + page_hash)
        return None if value is None else bytes(value)

    def delete(self, namespace: str, page_hash: bytes) -> None:
        if namespace not in self._cfs:
            return

        def write(opts: WriteOptions) -> None:  # one batch per try (see put)
            wb = WriteBatch(raw_mode=True)
            wb.set_default_column_family(self._db.get_column_family_handle(_cf_name(namespace)))
            wb.delete(_DATA + page_hash)
            wb.delete(_META + page_hash)
            self._db.write(wb, opts)

        self._write(write, self._logged_write)  # logged: see the module doc

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
