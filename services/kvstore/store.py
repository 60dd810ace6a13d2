"""The tiered KV page store: the core of the kvstore service (no gRPC here).

Pages are keyed by (namespace, page hash). The namespace is the model version
("smollm2-135m@v3"); the hash is services.common.pagehash's chained page hash, which already
covers the version and the whole token prefix, so a page of version v can never answer a lookup
of version v+1 (different namespace and different hash).

Tiers (DESIGN.md sections 2 and 4; Seer builds its pool on Mooncake's DRAM + SSD):
- DRAM: byte-bounded LRU of page bytes. New pages land here (write-back).
- SSD: RocksDB. Pages evicted from DRAM are demoted here; SSD hits are promoted back to DRAM
  (and stay on SSD, so demoting them again is free). When the SSD tier is full its least recently
  used pages are evicted for good. On a graceful stop the DRAM-only pages are flushed to SSD, so a
  restart keeps them; a crash loses only DRAM-only pages (a cache: the worker recomputes).

Ownership: every Put names its request; a page shared by several requests (a group's common
prompt) is deleted by Release only when its last owner releases it. Pages put without a request
are evicted by capacity only, and stay so when requests claim them later: such a page is marked
anonymous (persisted with its owners), and the release of its last named owner leaves it in place
instead of deleting it out from under its anonymous writer.

Versions: a namespace "family@v<N>" supersedes the lower versions of the same family (ordered by
N; names without a "v<N>" tail by creation order, below numbered ones): when a Put creates a new
one, all but the highest `keep_versions` of that family are dropped (one drop_column_family) and
tombstoned, so a straggling worker on old weights cannot recreate them; a Put that would create a
version lower than the family's highest is refused, so it cannot drop a newer one.
`drop_namespace` does the same explicitly. Namespaces without "@" are never dropped implicitly. A
drop RocksDB refuses (or one a crash cut off) is retried at later Puts (with a backoff, 1 s growing
to 30 s) and at the next open, which replays each family's creations from the registry
(_superseded); a numbered version with keep_versions numbered versions above it that hold pages is
dropped too, so keep_versions lowered between runs takes effect at the open.

Capacity: a page larger than the SSD page budget that does not fit DRAM either is refused
(RESOURCE_EXHAUSTED naming data): written to SSD it would evict every page on the tier and still
not fit. One DRAM holds is stored there; its later demotion evicts that page alone.

Late offloads: a Release of a whole request (no page hashes: the request finished) leaves a
tombstone of (namespace, request_id) for `release_tombstone_s`: a Put or claim by that request
arriving later (an offload still queued on a worker the request left) is refused with
FAILED_PRECONDITION naming request_id instead of re-creating pages no one will ever release. Other
requests' Puts of the same pages are not affected (the tombstone names the request, not the pages).

SSD write failures of a Put: disk full is RESOURCE_EXHAUSTED, any other RocksDB error UNAVAILABLE,
both naming `data` (the replica cannot take the page now; the client counts a failed offload).

Column families: a namespace's RocksDB column family exists only while the namespace has pages on
the SSD tier (created by its first SSD write, dropped when its last SSD page goes, and at
recovery when it has none), except that the _IDLE_COLUMN_FAMILIES namespaces most recently written
to SSD keep theirs: every column family costs memtables, and an RL run makes a new namespace per
policy version, so keeping one per namespace ever seen grew RocksDB's memory without bound. The
namespace itself (layout, registry record) stays until _IDLE_NAMESPACES others were emptied after
it; then it is forgotten too (a Put re-creates it), and a family keeps only its highest tombstone,
so the metadata does not grow by a record per policy version either.

Checksums: the XXH3-64 of every page (services.kvstore.checksum) is checked on
Put (unless verify_put_checksums is off) and on every read from the SSD tier; a page that fails is
deleted and reported as missing (counted in checksum_failures), never served. An owner record
found without its page (a kill kept the logged record, lost the WAL-less page) is dropped the same
way, counted in orphan_owner_records.
"""

from __future__ import annotations

import errno
import itertools
import json
import re
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from typing import cast

from services.common.errors import FailedPrecondition, InvalidArgument, ResourceExhausted, SeerError, Unavailable
from services.common.kvlayout import KVLayout
from services.common.log import get_logger, kv
from services.common.pagehash import HASH_BYTES
from services.kvstore.checksum import ALGORITHM, page_checksum
from services.kvstore.dram import Buffer, DramLru
from services.kvstore.pending import PendingJournal
from services.kvstore.ssd import DEFAULT_WRITE_BUFFER_BYTES, SsdTier, WriteStalled

log = get_logger(__name__)

Key = tuple[str, bytes]  # (namespace, page hash)

# Namespaces most recently written to the SSD tier that keep their column family while empty. A
# drop and a re-create cost ~6 ms of MANIFEST writes, under the store lock: the live version, whose
# SSD pages may all leave (released, promoted and evicted) just before more are demoted, would pay
# that on each such swing. Two: a version change has the old and the new version live at once.
_IDLE_COLUMN_FAMILIES = 2

# Namespaces without pages whose records are kept: the ones emptied most recently. An RL run makes a
# namespace per policy version (a family per loaded checkpoint, services.worker.core.version_name),
# and each one's record (layout, creation order: in memory and in the registry) stayed for good after
# its pages had all gone (released, evicted), so the metadata grew by one per iteration. Past this
# many, the one emptied longest ago is forgotten: a Put re-creates it like a new namespace (refused
# as a straggler when its family knows a newer version). Several: a live version whose pages
# momentarily all left does not pay a re-creation.
_IDLE_NAMESPACES = 8

# Backoff of the retry of a superseded version's drop that RocksDB refused (_retry_superseded): the
# first retry this long after the failure, each failed one doubling the wait up to the cap. Without
# it a refusal that is no stall (a full disk) was tried, and logged with its traceback, at every Put.
_DROP_RETRY_FIRST_S = 1.0
_DROP_RETRY_MAX_S = 30.0


@dataclass(frozen=True)
class KvStats:
    dram_bytes: int
    dram_capacity_bytes: int
    ssd_bytes: int
    ssd_capacity_bytes: int
    hits: int
    misses: int
    evictions: int
    namespaces: int
    pages: int
    dram_pages: int = 0
    ssd_pages: int = 0
    demotions: int = 0
    promotions: int = 0
    checksum_failures: int = 0
    released_pages: int = 0
    dropped_namespaces: int = 0
    late_puts: int = 0  # Puts / claims refused: their request was released whole just before
    meta_write_failures: int = 0  # SSD owner-record writes that failed (logged, not raised)
    # RocksDB column families open: one per namespace with SSD pages, plus at most
    # _IDLE_COLUMN_FAMILIES recently written empty ones (the default one not counted).
    column_families: int = 0
    memtable_bytes: int = 0  # rocksdb.cur-size-all-mem-tables over all column families, default included
    flush_failures: int = 0  # DRAM pages flush_to_ssd (a graceful stop) could not write to SSD
    # RocksDB write stops (SsdTier): writes that met one and waited, writes that failed on one
    # (WriteStalled: a Put answered UNAVAILABLE, a demotion evicted, a delete left pending), seconds waited.
    write_stalls: int = 0
    write_stall_failures: int = 0
    write_stall_seconds: float = 0.0
    # Pages whose SSD record RocksDB refused to delete or rewrite (a write stop, a full disk): the
    # index in memory is right, the disk catches up when a later try goes through.
    pending_ssd_records: int = 0
    # Bytes of the pages of those refused deletes: still on disk, so counted in ssd_bytes too (and
    # against ssd_capacity_bytes) until the delete goes through.
    pending_ssd_bytes: int = 0
    # Pages that know their predecessor in the chain the last Exists found (_Entry.prev): at most one
    # per page, so Exists cannot grow memory beyond the pages stored.
    chain_links: int = 0
    # SSD owner records found without their page at a read (a kill lost the WAL-less page put, not
    # the logged record rewrite after it): dropped, a miss. Not checksum failures: nothing was corrupt.
    orphan_owner_records: int = 0


@dataclass
class _Entry:
    size: int
    checksum: int
    owners: set[str]
    on_ssd: bool = False
    seq: int = 0  # last access, for the SSD tier's LRU order after a restart
    # Put (or claimed) without a request id at least once: its writer expects it kept until capacity
    # evicts it, so releasing its named owners never deletes it. Never cleared: no Release names it.
    anonymous: bool = False
    # The page before this one in the chain the last Exists found it in (None: first page, or no
    # Exists yet): a Get in several parts (one per client stream) touches the pages before its part
    # too (touch_tail_first), whichever part ends last, by following these links. One link per page:
    # a page hash names its whole prefix, so its predecessor is one page whatever chain asked. (It
    # was the whole chain as a tuple shared by its entries: a page kept the tuple of the last Exists
    # through it, so chains that overlap, every request of a group through the shared prompt, or one
    # client asking ever shorter prefixes, held the chain again each, O(n^2) hashes for n pages, in
    # no budget.) Not persisted: only LRU order depends on it.
    prev: bytes | None = None


@dataclass
class _Namespace:
    name: str
    layout: KVLayout
    seq: int  # creation order: orders the versions of a family whose names carry no "v<N>"
    entries: dict[bytes, _Entry] = field(default_factory=dict)
    by_owner: dict[str, set[bytes]] = field(default_factory=dict)
    ssd_pages: int = 0  # entries on the SSD tier: its column family is needed only while > 0
    # Pages evicted at demotion as larger than the SSD page budget: the first one is warned about,
    # the rest logged at debug (one warning per namespace, not one per page).
    oversized_evictions: int = 0


_VERSION_RE = re.compile(r"v(\d{1,18})")


def family_of(namespace: str) -> str | None:
    """'smollm2-135m@v3' -> 'smollm2-135m'; None when the name carries no version. Everything before
    the last "@" is the family: a worker puts its weights identity there
    ('smollm2-135m@3f9a0c2e1b7d@v3', services.worker.core.version_name), so versions of other weights
    never supersede each other."""
    return namespace.rsplit("@", 1)[0] if "@" in namespace else None


def version_of(namespace: str) -> int | None:
    """The N of a 'family@v<N>' name; None when the name has no such suffix (ordered by creation)."""
    if "@" not in namespace:
        return None
    m = _VERSION_RE.fullmatch(namespace.rsplit("@", 1)[1])
    return int(m.group(1)) if m else None


# Bytes a page's buffer may pin beyond the page itself and still be kept as it is in DRAM (a Put
# frame's header: namespace and request_id are capped by MAX_NAME_BYTES, the rest is small).
MAX_FRAME_OVERHEAD = 4096
MAX_NAME_BYTES = 256  # namespace / request_id: they become RocksDB names and are held per page


def _version_order(ns: _Namespace) -> tuple[int, int]:
    """A namespace's rank in its family: by version number, names without one by creation order
    below every numbered one."""
    v = version_of(ns.name)
    return (0, ns.seq) if v is None else (1, v)


def _check_name(value: str, field_name: str, *, required: bool = True) -> None:
    """A namespace or request id is a short printable name: it becomes a column family name and
    metadata, and an unbounded one would let a Put's header outweigh its page in the DRAM budget."""
    if not value:
        if required:
            raise InvalidArgument("must not be empty", field=field_name)
        return
    size = len(value.encode("utf-8"))
    if size > MAX_NAME_BYTES:
        raise InvalidArgument(f"{size} bytes, at most {MAX_NAME_BYTES}", field=field_name)
    if any(ord(c) < 0x20 or ord(c) == 0x7F for c in value):
        raise InvalidArgument("must not contain NUL or control characters", field=field_name)


# RocksDB statuses (rocksdict raises them as plain Exceptions carrying RocksDB's message) and OS
# errors that mean the disk is full rather than failing.
_DISK_FULL = ("no space left on device", "space limit reached", "disk quota exceeded")


def ssd_write_error(exc: BaseException, field: str) -> SeerError:
    """A failed SSD tier write as the store's typed error: disk full -> ResourceExhausted (frees up
    as pages are released or evicted), any other storage error -> Unavailable (this replica cannot
    store now; another attempt or replica may). Both are a miss for the client, never a rejection
    of the page itself."""
    message = str(exc) or type(exc).__name__
    full = (isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT)) or any(
        m in message.lower() for m in _DISK_FULL
    )
    if full:
        return ResourceExhausted(f"SSD tier is full: {message}", field=field)
    return Unavailable(f"SSD tier write failed: {message}", field=field)


def _encode_meta(e: _Entry) -> bytes:
    return json.dumps([ALGORITHM, e.checksum, e.size, e.seq, sorted(e.owners), e.anonymous]).encode("utf-8")


def _decode_meta(raw: bytes) -> _Entry | None:
    """The entry, or None for a record that cannot be used: one whose checksum is of another
    algorithm (an earlier release wrote [crc32, size, seq, owners]), so its page cannot be
    verified, or one that does not parse. Such pages are dropped rather than stopping recovery.

    Records before the anonymous flag ([algorithm, checksum, size, seq, owners], up to session 23)
    are read too. Their empty owner list can only be an anonymous page never claimed (a named
    page's record is deleted with it when its last owner releases it, never rewritten empty), so
    it stays anonymous; one with owners may have been put anonymously too, but the record cannot
    say, so it keeps the old contract: deleted when its last owner releases it. Whatever the
    format, a page without owners is anonymous: nothing could ever release it."""
    try:
        rec = json.loads(raw)
        if not isinstance(rec, list) or len(rec) not in (5, 6) or rec[0] != ALGORITHM:
            return None
        _algorithm, checksum, size, seq, owners = rec[:5]
        anonymous = rec[5] if len(rec) == 6 else False
        if not isinstance(owners, list) or not all(isinstance(o, str) for o in owners):
            return None
        if not isinstance(anonymous, bool):
            return None
        return _Entry(
            size=int(size),
            checksum=int(checksum),
            owners=set(owners),
            on_ssd=True,
            seq=int(seq),
            anonymous=anonymous or not owners,
        )
    except (ValueError, TypeError):
        return None


def _copy_ok(data: Buffer | None, entry: _Entry) -> bool:
    """Whether a page's stored bytes (None: unreadable) match its size and checksum."""
    return data is not None and len(data) == entry.size and page_checksum(data) == entry.checksum


def _unindex_owners(ns: _Namespace, page_hash: bytes, owners: set[str]) -> None:
    """Takes page_hash out of the by_owner sets of `owners` (a set left empty goes)."""
    for owner in owners:
        pages = ns.by_owner.get(owner)
        if pages is not None:
            pages.discard(page_hash)
            if not pages:
                del ns.by_owner[owner]


class KvStore:
    def __init__(
        self,
        data_dir: str,
        *,
        dram_bytes: int,
        ssd_bytes: int,
        keep_versions: int = 1,
        verify_checksums: bool = True,
        verify_put_checksums: bool = True,
        min_blob_bytes: int = 64 * 1024,
        ssd_wal: bool = False,
        ssd_write_buffer_bytes: int = DEFAULT_WRITE_BUFFER_BYTES,
        release_tombstone_s: float = 600.0,
        max_release_tombstones: int = 100_000,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if ssd_bytes <= 0:
            raise InvalidArgument(f"must be > 0, got {ssd_bytes}", field="ssd_bytes")
        if keep_versions < 1:
            raise InvalidArgument(f"must be >= 1, got {keep_versions}", field="keep_versions")
        if release_tombstone_s < 0:
            raise InvalidArgument(f"must be >= 0, got {release_tombstone_s}", field="release_tombstone_s")
        if max_release_tombstones < 0:
            raise InvalidArgument(f"must be >= 0, got {max_release_tombstones}", field="max_release_tombstones")
        if min_blob_bytes < 0:
            raise InvalidArgument(f"must be >= 0, got {min_blob_bytes}", field="min_blob_bytes")
        if ssd_write_buffer_bytes <= 0:
            raise InvalidArgument(f"must be > 0, got {ssd_write_buffer_bytes}", field="ssd_write_buffer_bytes")
        self._lock = threading.RLock()
        self._dram = DramLru(dram_bytes)
        # The store checks every SSD read against the page's checksum (verify_checksums): RocksDB's own
        # (slower) check of the same bytes is then redundant.
        self._ssd = SsdTier(
            data_dir,
            min_blob_bytes=min_blob_bytes,
            wal=ssd_wal,
            verify_page_reads=not verify_checksums,
            write_buffer_bytes=ssd_write_buffer_bytes,
        )
        self.ssd_capacity_bytes = ssd_bytes
        self.keep_versions = keep_versions
        self.verify_checksums = verify_checksums
        self.verify_put_checksums = verify_put_checksums
        self._ssd_lru: OrderedDict[Key, int] = OrderedDict()  # pages on SSD -> size, LRU first
        self._ssd_bytes = 0
        # Namespaces written to SSD lately, oldest first (at most _IDLE_COLUMN_FAMILIES): their
        # column families are kept while empty.
        self._ssd_recent: OrderedDict[str, None] = OrderedDict()
        self._namespaces: dict[str, _Namespace] = {}
        # Namespaces without pages, emptied longest ago first (at most _IDLE_NAMESPACES; see there).
        self._idle: OrderedDict[str, None] = OrderedDict()
        # Dropped namespaces: Puts into them are refused. Per family only the highest numbered one
        # is kept (_compact_tombstones): it refuses every lower version as older than the newest.
        self._tombstones: set[str] = set()
        # Families with a superseded version whose drop RocksDB refused: retried (_retry_superseded)
        # at the first Put from _drop_retry_at on, each failed retry doubling the wait (capped).
        self._undropped: set[str] = set()
        self._drop_retry_delay = _DROP_RETRY_FIRST_S
        self._drop_retry_at = 0.0
        self._seq = itertools.count(1)
        self._hits = self._misses = self._evictions = 0
        self._demotions = self._promotions = self._checksum_failures = self._orphan_records = 0
        self._released = self._dropped = self._meta_write_failures = 0
        # (namespace, request_id) of requests released whole -> when the tombstone expires; oldest
        # first. Bounded in time (a late offload comes within its client's queue and RPC timeouts)
        # and in count (memory); an expired or pushed-out one only lets a late Put through again.
        self.release_tombstone_s = release_tombstone_s
        self.max_release_tombstones = max_release_tombstones
        self._clock = clock
        self._released_requests: OrderedDict[tuple[str, str], float] = OrderedDict()
        self._late_puts = 0
        self._flush_failures = 0  # DRAM pages flush_to_ssd could not write (logged)
        # Pages whose SSD record (page and metadata) disagrees with the index because RocksDB refused
        # the delete or the owner-record rewrite (a write stop, a full disk); oldest first. Retried
        # (_reconcile_ssd) on every Release, flush and close: left alone, a released page's record
        # kept naming its released owner, and recovery brought the page back owned by a request
        # that would never release it again (and while running, its bytes were on disk uncounted).
        # Each maps to the page bytes the disk holds beyond the index: a refused delete's page size
        # (counted in ssd_bytes and against the capacity: _pending_bytes), 0 for an owner rewrite
        # (the page is on SSD, counted there). Journaled (services/kvstore/pending.py) so a crash
        # does not lose them: the next open applies them.
        self._pending_ssd: OrderedDict[Key, int] = OrderedDict()
        self._pending_bytes = 0
        # The checksum of the copy on disk of each pending delete (its record's): the page may be
        # indexed again meanwhile (stored again into DRAM) with other bytes, and the journal line of
        # such a page must describe the copy recovery keeps, not the bytes in DRAM (_journaled_meta).
        self._pending_copies: dict[Key, int] = {}
        self._journal = PendingJournal(data_dir)
        self._journal_failures = 0
        self._chain_links = 0
        self._closed = False
        try:
            self._recover()
        except BaseException:
            # Whatever failed (a record that does not parse, an I/O error), RocksDB is open and holds
            # its LOCK for this process until every handle is gone; the exception's traceback keeps
            # this half-built store alive, so a retry of the open in this process would fail on the
            # lock instead of the real error. Close it now.
            self._ssd.close()
            self._journal.close()
            self._closed = True
            raise

    # ---------------------------------------------------------------- recovery
    def _recover(self) -> None:
        """Rebuilds the in-memory index from the SSD tier's registry and page metadata."""
        max_seq = stale = 0
        pages: list[tuple[int, Key, _Entry]] = []
        for name, raw in self._ssd.registry().items():
            try:
                rec = json.loads(raw)
                seq = int(rec["seq"])
                layout = None if rec.get("dropped") else KVLayout.from_json(rec["layout"])
            except (ValueError, KeyError, TypeError) as exc:
                # One unreadable record (corrupt, or written by another version) must not keep the
                # whole store from opening: its namespace is unusable without its layout, so it goes
                # like an orphan column family (dropped below). Only a cache is lost.
                log.warning("dropped a namespace whose registry record does not parse",
                            extra=kv(namespace=name, error=str(exc)))
                self._ssd.delete_registry(name)
                continue
            max_seq = max(max_seq, seq)
            if layout is None:
                # Its column family, should a crash or a refused drop have left it, goes with the
                # orphans below.
                self._tombstones.add(name)
                continue
            ns = _Namespace(name, layout, seq)
            self._namespaces[name] = ns
            for page_hash, meta in self._ssd.iter_meta(name):
                e = _decode_meta(meta)
                if e is None:
                    stale += 1
                    self._ssd.delete(name, page_hash)
                    continue
                ns.entries[page_hash] = e
                for owner in e.owners:
                    ns.by_owner.setdefault(owner, set()).add(page_hash)
                pages.append((e.seq, (name, page_hash), e))
                max_seq = max(max_seq, e.seq)
        for orphan in set(self._ssd.namespaces()) - set(self._namespaces):
            # A column family whose registry record never landed (crash in between): unusable; or
            # a dropped version's whose drop did not happen (a crash or a refusal after its tombstone).
            try:
                self._ssd.drop_namespace(orphan)
            except Exception:
                # Left open (uncounted; it holds no indexed page) and tried again at the next start:
                # a refused drop must not keep the store from opening.
                log.warning("dropping an orphan column family failed; tried again at the next start",
                            exc_info=True, extra=kv(namespace=orphan))
        for _seq, key, entry in sorted(pages, key=lambda p: p[0]):
            self._index_ssd_copy(key, entry, record_current=True)  # the record just read describes it
        self._seq = itertools.count(max_seq + 1)
        self._replay_pending()
        # Versions whose drop was due and did not happen (RocksDB refused the tombstone record, or
        # the process stopped before it), and those a lowered keep_versions drops: their pages would
        # hold the budget until LRU evicted them, since only a creation dropped versions. After the
        # pending records (the pages released before the stop do not count as held), before the
        # capacity check, so they go first.
        for versioned in sorted({f for n in self._namespaces if (f := family_of(n)) is not None}):
            self._drop_superseded(versioned)
        if self._namespaces:
            log.info(
                "recovered SSD tier",
                extra=kv(namespaces=len(self._namespaces), pages=len(pages), ssd_bytes=self._ssd_bytes,
                         pending_ssd_records=len(self._pending_ssd)),
            )
        if stale:
            log.warning(
                "dropped SSD pages with unusable metadata (another checksum algorithm, or corrupt)",
                extra=kv(pages=stale, want=ALGORITHM),
            )
        self._evict_oversized()
        self._enforce_ssd_capacity()
        # Namespaces left without pages (all released, evicted or stale before the stop: a store
        # from before column families were dropped kept one per version it ever saw) give theirs
        # up now; nothing is recent yet. The namespaces themselves stay (layouts, version order).
        for name in self._ssd.namespaces():
            self._drop_idle_column_family(name)
        # Namespaces left without pages, in creation order (the last ones are the likeliest to be
        # written again): all but the newest _IDLE_NAMESPACES are forgotten, and so are the
        # tombstones a higher one of their family covers (a store from before kept every record).
        for ns in sorted((n for n in self._namespaces.values() if not n.entries), key=lambda n: n.seq):
            self._note_empty(ns.name)
        for family in {family_of(t) for t in self._tombstones}:
            if family is not None:
                self._compact_tombstones(family)

    def _evict_oversized(self) -> None:
        """Evicts the recovered pages larger than the SSD page budget (a restart with a lower
        --ssd-bytes), before the capacity check: left to it, each one evicted every page less
        recently used than itself and then went too, emptying the tier. Lock not needed (open)."""
        oversized = [key for key, size in self._ssd_lru.items() if size > self.ssd_capacity_bytes]
        if not oversized:
            return
        for key in oversized:
            self._remove(key)
            self._evictions += 1
        log.warning(
            "evicted recovered pages larger than the SSD page budget; their Puts are refused until --ssd-bytes "
            "is raised",
            extra=kv(pages=len(oversized), namespaces=sorted({k[0] for k in oversized}),
                     ssd_capacity_bytes=self.ssd_capacity_bytes),
        )

    def _replay_pending(self) -> None:
        """Applies the SSD records left pending before the last stop (journaled: a crash, or a close
        RocksDB still refused) to the index just rebuilt from the records on disk, which lag them: a
        page journaled as gone is removed (its record deleted now, or pending again), one journaled
        with an owner record gets those owners (the record is rewritten now, or pending again): a
        page that lived on in DRAM while its SSD copy's delete was pending is journaled so
        (_journaled_meta), and comes back from that copy. A page or namespace no longer on disk is
        skipped: its record went after all (the journal line saying so was lost), or went with its
        column family. Then the journal is rewritten to what is pending now. Before session 27 they
        were lost with the process, and the released pages came back owned by the requests that had
        released them."""
        try:
            journaled = self._journal.load()
        except OSError as exc:
            log.warning("pending SSD records journal unreadable; the records on disk are taken as they are",
                        extra=kv(path=self._journal.path, error=str(exc)))
            return
        deleted = rewritten = undecodable = 0
        for key, meta in journaled.items():
            ns = self._namespaces.get(key[0])
            entry = ns.entries.get(key[1]) if ns is not None else None
            if ns is None or entry is None:
                continue
            want = None if meta is None else _decode_meta(meta)
            if meta is not None and want is None:
                # A rewrite whose record does not parse (corrupt, or another format): the record on
                # disk stands. Taken as a delete until session 27, which removed a live page.
                undecodable += 1
                continue
            if want is None or (not want.owners and not want.anonymous):
                deleted += 1
                self._remove(key)  # deletes the record, or leaves it pending (and journaled) again
                continue
            rewritten += 1
            _unindex_owners(ns, key[1], entry.owners - want.owners)
            for owner in want.owners - entry.owners:
                ns.by_owner.setdefault(owner, set()).add(key[1])
            entry.owners = set(want.owners)
            entry.anonymous = want.anonymous
            self._write_meta(key[0], key[1], entry)
        self._journal_op(self._rewrite_journal)
        if deleted or rewritten:
            log.info("applied SSD records pending before the stop",
                     extra=kv(deleted=deleted, rewritten=rewritten, still_pending=len(self._pending_ssd)))
        if undecodable:
            log.warning("skipped pending owner records that do not parse; the records on disk stand",
                        extra=kv(path=self._journal.path, records=undecodable))

    # ---------------------------------------------------------------- namespaces
    def _check_put_target(self, name: str, layout: KVLayout) -> _Namespace | None:
        """The namespace a Put goes to (None: a new one), after checking the stated layout against
        it. Creates nothing, so a rejected Put leaves no trace."""
        _check_name(name, "namespace")
        if name in self._tombstones:
            raise FailedPrecondition(f"{name!r} was superseded by a newer model version and dropped", field="namespace")
        ns = self._namespaces.get(name)
        if ns is not None:
            ns.layout.check_same(layout)
        else:
            newest = self._newest_version(name)
            version = version_of(name)
            if newest is not None and version is not None and version < newest and not self._still_kept(name, version,
                                                                                                          newest):
                # A straggler still on older weights: creating its namespace would make it the
                # family's newest by creation order and drop the live one, so refuse it instead.
                raise FailedPrecondition(
                    f"{name!r} is older than the family's newest version v{newest}", field="namespace"
                )
            layout.validate()
        return ns

    def _still_kept(self, name: str, version: int, newest: int) -> bool:
        """Whether an older version, not held (never created, or forgotten once it was empty), is one
        its family keeps (keep_versions): then a Put re-creates it. A kept version that empties and
        is forgotten (_IDLE_NAMESPACES others emptied after it) was refused as a straggler from then
        on, though it would be kept were it still held (review, session 25). Kept: within
        keep_versions of the family's newest version (a tombstone's too), with fewer than
        keep_versions newer versions of the family held, and not below a tombstone (checked by the
        caller: a tombstoned name is refused first; a lower one than a family's tombstone is below
        a dropped version, so it would have been dropped too)."""
        if version <= newest - self.keep_versions:
            return False
        family = family_of(name)
        if any(family_of(t) == family and (v := version_of(t)) is not None and v > version for t in self._tombstones):
            return False
        newer = sum(1 for n in self._namespaces if family_of(n) == family and (v := version_of(n)) is not None
                    and v > version)
        return newer < self.keep_versions

    def _newest_version(self, name: str) -> int | None:
        """The highest parsed version among the live and dropped namespaces of name's family."""
        family = family_of(name)
        if family is None:
            return None
        versions = [
            v
            for n in itertools.chain(self._namespaces, self._tombstones)
            if family_of(n) == family and (v := version_of(n)) is not None
        ]
        return max(versions, default=None)

    def _create_namespace(self, name: str, layout: KVLayout) -> _Namespace:
        ns = _Namespace(name, layout, next(self._seq))
        # No column family yet: the first page written to SSD creates it (SsdTier.put), so a
        # namespace whose pages never leave DRAM never costs one.
        self._ssd.put_registry(name, json.dumps({"layout": layout.to_json(), "seq": ns.seq}).encode())
        self._namespaces[name] = ns
        # Idle until its first page is indexed (in the same Put): one whose SSD write fails leaves
        # it empty, and it is then forgotten in turn like any other. No trim: it would count
        # against the idle ones for the moment until its page lands.
        self._note_empty(name, trim=False)
        log.info("namespace created", extra=kv(namespace=name, page_bytes=layout.page_bytes))
        family = family_of(name)
        if family is not None:
            self._drop_superseded(family)
        return ns

    def _superseded(self, family: str) -> list[str]:
        """The family's live namespaces its version rule drops: each namespace, when created, drops
        the family's versions below it past the highest keep_versions. Newest = highest version
        number (names that do not parse sort by creation order, below every parsed one); only
        versions below the one created are dropped, so a late namespace can never take a newer one
        down with it. Computed by replaying the creations (registry seq order) over the live
        namespaces, so it names exactly the drops that were due and did not happen (a refused
        tombstone record, a crash before it), whenever it runs: at a creation, at a retry, at
        recovery. A replay over the live ones drops no version that its creations kept: with fewer
        namespaces beside it, a version ranks no lower than it did then.

        Also every numbered version with keep_versions numbered versions above it that hold pages:
        the replay keeps a version created below others (m@v3, m@v2, m@v1 under a larger
        keep_versions), so a keep_versions lowered between runs left them all live, a state the
        running store never allows. It cannot drop what a running store with the same keep_versions
        kept: such a store creates a version below the newest only with fewer than keep_versions
        live numbered versions above it (_still_kept), and only a creation of a higher one, which
        the replay covers, adds one above; versions holding pages are among the live ones. Empty
        ones do not count: at an open, an empty namespace may be one the running store had
        forgotten though its registry record stayed (a refused delete, by a store before session 33:
        _forget now keeps a namespace known until its record is deleted). Lock held."""
        members = sorted((n for n in self._namespaces.values() if family_of(n.name) == family), key=lambda n: n.seq)
        live: list[_Namespace] = []
        out: list[str] = []
        for ns in members:
            live.append(ns)
            ranked = sorted(live, key=_version_order)
            for old in ranked[: max(0, len(ranked) - self.keep_versions)]:
                if _version_order(old) < _version_order(ns):
                    live.remove(old)
                    out.append(old.name)
        held = sorted((v for n in live if n.entries and (v := version_of(n.name)) is not None), reverse=True)
        if len(held) > self.keep_versions:
            lowest_kept = held[self.keep_versions - 1]
            out += [n.name for n in live if (v := version_of(n.name)) is not None and v < lowest_kept]
        return out

    def _drop_superseded(self, family: str) -> None:
        """Drops the family's superseded versions (_superseded). A drop RocksDB refuses (its tombstone
        record: a write stop, a full disk) changes nothing: the version stays live, the family is
        retried at a later Put (_retry_superseded) and at the next open, which replays the family's
        creations from the registry. Until session 32 only the next version created in the family
        dropped it: after a restart nothing did, and its pages held SSD budget until LRU evicted
        them. A failure episode (from the family's first refused drop until one succeeds) is warned
        about and counted (meta_write_failures) once; its retries' failures are logged at debug.
        Lock held."""
        repeat = family in self._undropped
        failed = False
        for name in self._superseded(family):
            try:
                self._drop_locked(name)
            except Exception as exc:
                failed = True
                if repeat:
                    log.debug("dropping a superseded version failed again", extra=kv(
                        namespace=name, family=family, error=str(exc), next_retry_in_s=self._drop_retry_delay))
                    continue
                self._meta_write_failures += 1
                log.warning("dropping a superseded version failed; retried at a later Put (1 s, then up to every "
                            f"{_DROP_RETRY_MAX_S:g} s) and at the next start", exc_info=True,
                            extra=kv(namespace=name, family=family))
        if failed:
            if not self._undropped:  # the first family in trouble: its first retry a backoff from now
                self._drop_retry_delay = _DROP_RETRY_FIRST_S
                self._drop_retry_at = self._clock() + self._drop_retry_delay
            self._undropped.add(family)
        elif repeat:
            self._undropped.discard(family)
            log.info("superseded versions dropped after an earlier failure", extra=kv(family=family))

    def _retry_superseded(self) -> None:
        """Retries the families whose superseded versions' drops failed (lock held): at a Put once the
        backoff has passed (_DROP_RETRY_FIRST_S doubling per failed retry up to _DROP_RETRY_MAX_S: a
        refusal that is no stall, a full disk, was tried at every Put), and only while RocksDB may
        take a write (SsdTier.may_try: a probe a second while stalled)."""
        if not self._undropped or self._clock() < self._drop_retry_at or not self._ssd.may_try():
            return
        for family in list(self._undropped):
            self._drop_superseded(family)
        if self._undropped:
            self._drop_retry_delay = min(self._drop_retry_delay * 2, _DROP_RETRY_MAX_S)
            self._drop_retry_at = self._clock() + self._drop_retry_delay

    def drop_namespace(self, name: str) -> int:
        """Drops a namespace (a weight version that no worker uses any more); returns its page count.

        The name is tombstoned: later Puts into it are refused (FAILED_PRECONDITION)."""
        with self._lock:
            return self._drop_locked(name)

    def _drop_locked(self, name: str) -> int:
        """Raises (nothing changed) when RocksDB refuses the tombstone record; a failed column
        family drop after it is logged: recovery drops the column family of a tombstoned name."""
        ns = self._namespaces.get(name)
        seq = ns.seq if ns is not None else next(self._seq)
        # The record first: a refused one leaves the namespace as it was. (Written after the pages
        # had left the accounting, a refusal left them in DRAM and the SSD LRU under a namespace
        # no longer indexed.)
        self._ssd.put_registry(name, json.dumps({"seq": seq, "dropped": True}).encode())
        self._namespaces.pop(name, None)
        self._tombstones.add(name)
        self._ssd_recent.pop(name, None)
        self._idle.pop(name, None)
        family = family_of(name)
        if family is not None:
            self._compact_tombstones(family)
        # Every pending record of the namespace goes with its column family, those of pages no longer
        # indexed (a pending delete) too: until session 27 only indexed pages were unpended, and a
        # pending delete's bytes kept counting in ssd_bytes and against the capacity for good. (A
        # column family not dropped below is dropped by recovery, as the name is tombstoned.)
        self._unpend_namespace(name)
        if ns is None:
            return 0
        for page_hash, entry in ns.entries.items():
            key = (name, page_hash)
            self._dram.pop(key)
            if entry.prev is not None:
                self._chain_links -= 1
            size = self._ssd_lru.pop(key, None)
            if size is not None:
                self._ssd_bytes -= size
        try:
            self._ssd.drop_namespace(name)
        except Exception:
            log.warning("dropping a dropped version's column family failed; recovery drops it", exc_info=True,
                        extra=kv(namespace=name))
        self._dropped += 1
        log.info("namespace dropped", extra=kv(namespace=name, pages=len(ns.entries)))
        return len(ns.entries)

    def _compact_tombstones(self, family: str) -> None:
        """Forgets the tombstones of family's numbered versions below its highest tombstoned one:
        a Put into such a version is refused anyway, as older than the family's newest (live or
        dropped), so one record per family keeps every straggler out (a tombstone per superseded
        version grew the registry by one per policy version). Names without a version tail keep
        theirs: nothing else orders them."""
        numbered = [(v, t) for t in self._tombstones if family_of(t) == family and (v := version_of(t)) is not None]
        if len(numbered) < 2:
            return
        top = max(numbered)[0]
        for v, name in numbered:
            if v < top:
                self._tombstones.discard(name)
                self._delete_registry(name)

    def _note_empty(self, name: str, *, trim: bool = True) -> None:
        """Marks a namespace as holding no page now; forgets the one emptied longest ago when more
        than _IDLE_NAMESPACES are. Lock held."""
        self._idle[name] = None
        self._idle.move_to_end(name)
        while trim and len(self._idle) > _IDLE_NAMESPACES:
            old = next(iter(self._idle))
            if not self._forget(old):
                # Its registry record stays, so it stays known, the oldest idle one: tried again
                # when the next namespace empties (a rare event, so no backoff of its own).
                break
            del self._idle[old]

    def _forget(self, name: str) -> bool:
        """Forgets a namespace without pages: its record (registry and memory) and column family.
        Not a drop: no tombstone, a Put may create it again. False (nothing forgotten) when RocksDB
        refuses the registry delete: the record would outlive the namespace in memory, and the next
        open would replay the family's creations with it, dropping a version the running store had
        kept after forgetting this one (created since, or whose own refused drop was then no longer
        due). Until session 33 it was forgotten in memory anyway. Lock held."""
        ns = self._namespaces.get(name)
        if ns is None or ns.entries:
            return True  # not empty after all: _index takes it out of _idle, this is only a guard
        if not self._delete_registry(name, keeps="the namespace stays known until it is deleted"):
            return False
        del self._namespaces[name]
        self._ssd_recent.pop(name, None)
        self._drop_idle_column_family(name)
        log.debug("empty namespace forgotten", extra=kv(namespace=name))
        return True

    def _delete_registry(self, name: str, *, keeps: str = "forgotten in memory") -> bool:
        """Deletes a namespace's registry record; a failed delete (a full disk) is logged and counted,
        not raised (False): `keeps` says what the caller does about it (a covered tombstone is
        forgotten in memory: it only refuses versions that a higher tombstone refuses too)."""
        try:
            self._ssd.delete_registry(name)
        except Exception:
            self._meta_write_failures += 1
            log.warning(f"registry record delete failed; {keeps}", exc_info=True,
                        extra=kv(namespace=name, failures=self._meta_write_failures))
            return False
        return True

    # ---------------------------------------------------------------- writes
    def put(
        self,
        namespace: str,
        layout: KVLayout,
        page_hash: bytes,
        data: Buffer,
        checksum: int,
        request_id: str = "",
    ) -> bool:
        """Stores one page (or adds request_id as an owner of the stored one). True when new."""
        if len(page_hash) != HASH_BYTES:
            raise InvalidArgument(f"must be {HASH_BYTES} bytes, got {len(page_hash)}", field="page_hash")
        _check_name(request_id, "request_id", required=False)
        frame = data.obj if isinstance(data, memoryview) else None
        if isinstance(frame, bytes | bytearray) and len(frame) - len(data) > MAX_FRAME_OVERHEAD:
            # The DRAM tier keeps `data` as a view (wire.decode_put), which pins the whole received
            # frame: one padded with large fields would hold far more memory than the page counts
            # for in the DRAM budget. Keep a copy of the page alone (it is then not echoed).
            data = bytes(data)
        # The expensive part, outside the lock. Without put verification the writer's checksum is
        # stored as is: a page whose bytes do not match it is never used, since every reader (the
        # SSD tier, the client) checks it before use.
        actual = page_checksum(data) if self.verify_put_checksums else checksum
        with self._lock:
            self._retry_superseded()
            found = self._check_put_target(namespace, layout)
            self._check_not_released(namespace, request_id)
            if len(data) != layout.page_bytes:
                raise InvalidArgument(
                    f"{len(data)} bytes, but a page of layout {layout} is {layout.page_bytes} bytes", field="data"
                )
            if actual != checksum:
                raise InvalidArgument(
                    f"{ALGORITHM} of data is {actual:#018x}, message says {checksum:#018x}", field="checksum"
                )
            # Before anything is created, stored or evicted: a page that must go straight to SSD (it
            # does not fit DRAM) and that the SSD tier cannot hold (a --ssd-bytes too small for the
            # model) evicted every other page and then itself, emptying the tier on each such Put.
            # Refused like a page over the message limit: the client degrades it to a failed
            # offload. One DRAM holds is stored (a deployment mostly on DRAM keeps its --ssd-bytes
            # small); its demotion evicts it alone (_demote). Session 32 refused it too, and such a
            # store refused every Put of the model.
            if not self._dram.fits(len(data)):
                self._check_fits_ssd(layout.page_bytes)
            if found is None:
                try:
                    found = self._create_namespace(namespace, layout)
                except Exception as exc:  # RocksDB refused the registry record: nothing created
                    raise ssd_write_error(exc, "namespace") from exc
            ns = found
            key: Key = (namespace, page_hash)
            owners = {request_id} if request_id else set()
            anonymous = not request_id
            entry = ns.entries.get(page_hash)
            stored, orphan = self._stored_copy(key, entry) if entry is not None else (None, False)
            if entry is not None and orphan:
                # An owner record without its page (lost at a kill): the Put stores the page anew,
                # as after a Get that dropped the record. Adding the owner to the record instead
                # left the page missing for good (with or without put verification).
                self._drop_orphan(key)
                entry = None
            if entry is not None:
                if self.verify_put_checksums or _copy_ok(stored, entry) or page_checksum(data) != checksum:
                    self._add_owner(ns, page_hash, entry, request_id)
                    return False
                # Unverified Puts can store a page whose bytes do not match its checksum (and the
                # DRAM tier never checks): every reader would reject it until capacity evicts it.
                # A good copy arriving for it replaces it, keeping its owners (and its anonymity).
                self._checksum_failures += 1
                log.warning(
                    "stored page failed its checksum; replaced by the new Put",
                    extra=kv(namespace=namespace, page=page_hash.hex()),
                )
                owners |= entry.owners
                anonymous = anonymous or entry.anonymous
                self._remove(key)
            entry = _Entry(size=len(data), checksum=actual, owners=owners, seq=next(self._seq), anonymous=anonymous)
            # Indexed only once a tier holds the page: a failed SSD write leaves no entry behind.
            if self._dram.fits(len(data)):
                evicted_pages = self._dram.put(key, data)
                self._index(ns, page_hash, entry)
                for evicted_key, evicted in evicted_pages:
                    self._demote(evicted_key, evicted)  # type: ignore[arg-type]
            else:
                try:
                    self._write_ssd(key, entry, data)
                except Exception as exc:
                    raise ssd_write_error(exc, "data") from exc
                self._index(ns, page_hash, entry)
            self._enforce_ssd_capacity()
            return True

    def _check_fits_ssd(self, size: int) -> None:
        """ResourceExhausted naming data when a page of `size` bytes is larger than the SSD tier's
        page budget: storing it would evict every page on the tier and it would still not fit."""
        if size > self.ssd_capacity_bytes:
            raise ResourceExhausted(
                f"a page of {size} bytes does not fit the SSD tier's page budget of {self.ssd_capacity_bytes} "
                "bytes (--ssd-bytes less the WAL cap): raise --ssd-bytes",
                field="data",
            )

    def _check_not_released(self, namespace: str, request_id: str) -> None:
        """Refuses a Put or claim of a request released whole a moment ago (lock held): it is an
        offload that was still under way on a worker the request already left, and the pages it
        would (re)create or own would have no owner left to release them."""
        if not request_id or not self._released_requests:
            return
        now = self._clock()
        while self._released_requests:  # expire the oldest first
            oldest, expires = next(iter(self._released_requests.items()))
            if expires > now:
                break
            del self._released_requests[oldest]
        until = self._released_requests.get((namespace, request_id))
        if until is None:
            return
        self._late_puts += 1
        raise FailedPrecondition(
            f"request {request_id!r} was released {self.release_tombstone_s - (until - now):.1f} s ago; "
            "a late offload cannot store or own its pages",
            field="request_id",
        )

    def _tombstone_request(self, namespace: str, request_id: str) -> None:
        if self.release_tombstone_s <= 0 or self.max_release_tombstones <= 0:
            return
        key = (namespace, request_id)
        self._released_requests.pop(key, None)
        self._released_requests[key] = self._clock() + self.release_tombstone_s
        while len(self._released_requests) > self.max_release_tombstones:
            self._released_requests.popitem(last=False)

    def _index(self, ns: _Namespace, page_hash: bytes, entry: _Entry) -> None:
        ns.entries[page_hash] = entry
        self._idle.pop(ns.name, None)
        for owner in entry.owners:
            ns.by_owner.setdefault(owner, set()).add(page_hash)
        if (ns.name, page_hash) in self._pending_ssd:
            # Stored again into DRAM over its copy's pending delete (a put to SSD resolved it):
            # the journal line goes from "delete" to this page's owner record (_journaled_meta).
            self._rejournal((ns.name, page_hash))

    def _stored_copy(self, key: Key, entry: _Entry) -> tuple[Buffer | None, bool]:
        """(the stored bytes of a page, or None when unreadable; whether its record is an orphan: the
        index has it on SSD, RocksDB has no page). Read for a Put over a stored page: an unverified
        Put may have stored bad bytes, and an orphan record must not take the new page's owner."""
        data = self._dram.get(key)
        if data is not None or not entry.on_ssd:
            return data, False
        try:
            data = self._ssd.get(*key)
        except Exception:  # RocksDB reports on-disk corruption as an error: a bad copy, not an orphan
            return None, False
        return data, data is None

    def _drop_orphan(self, key: Key) -> None:
        """Drops an owner record found without its page: the page's put skips the WAL, a later owner
        rewrite does not, and a kill before the memtable flush kept only the record (see SsdTier).
        Found by a read (Get, or a Put over it), not at open: finding them there means reading every
        page (the data keys' iterator loads each blob value; rocksdict cannot skip it). Lock held."""
        self._orphan_records += 1
        log.warning("owner record without its page (lost at a kill); dropped",
                    extra=kv(namespace=key[0], page=key[1].hex()))
        self._remove(key)

    def claim(self, namespace: str, page_hash: bytes, request_id: str) -> bool:
        """Makes request_id an owner of an already stored page without its bytes being sent again
        (a chunk-end offload re-offers the context's earlier pages). False when not stored. A claim
        without a request id makes the page anonymous, as a Put without one would."""
        if len(page_hash) != HASH_BYTES:
            raise InvalidArgument(f"must be {HASH_BYTES} bytes, got {len(page_hash)}", field="page_hash")
        _check_name(request_id, "request_id", required=False)
        with self._lock:
            self._check_not_released(namespace, request_id)
            ns = self._namespaces.get(namespace)
            entry = ns.entries.get(page_hash) if ns is not None else None
            if ns is None or entry is None:
                return False
            self._add_owner(ns, page_hash, entry, request_id)
            return True

    def _add_owner(self, ns: _Namespace, page_hash: bytes, entry: _Entry, request_id: str) -> None:
        """Adds request_id as an owner of a stored page; no request id marks it anonymous instead:
        its writer (whose client claims rather than resends a page it found stored) expects it kept
        until capacity evicts it, whoever else owns it now."""
        self._touch((ns.name, page_hash), entry)
        if not request_id:
            changed = not entry.anonymous
            entry.anonymous = True
        elif request_id not in entry.owners:
            changed = True
            entry.owners.add(request_id)
            ns.by_owner.setdefault(request_id, set()).add(page_hash)
        else:
            changed = False
        if changed:
            self._owners_changed(ns.name, page_hash, entry)

    def _owners_changed(self, namespace: str, page_hash: bytes, entry: _Entry) -> None:
        """Persists a changed owner list: the SSD record of a page on SSD (_write_meta); the journal
        line of a page only in DRAM whose old copy's delete is pending (_journaled_meta: recovery
        keeps that copy with these owners)."""
        if entry.on_ssd:
            self._write_meta(namespace, page_hash, entry)
        elif (namespace, page_hash) in self._pending_ssd:
            self._rejournal((namespace, page_hash))

    def _write_meta(self, namespace: str, page_hash: bytes, entry: _Entry) -> None:
        """Persists a page's owner list. The in-memory index is the truth while the store runs; the
        record only matters at the next recovery, where a stale one costs a page kept too long or
        dropped too early (a cache miss). So a failed write (disk full, I/O error) is logged, not
        raised: raising would fail a claim or a Release half done, as INTERNAL."""
        if not self._ssd.may_try():  # as in _delete_ssd
            self._pend_ssd((namespace, page_hash), 0)
            return
        try:
            self._ssd.put_meta(namespace, page_hash, _encode_meta(entry))
        except Exception:
            self._meta_write_failures += 1
            self._pend_ssd((namespace, page_hash), 0)  # _reconcile_ssd writes it again
            log.warning("SSD owner record write failed; the index in memory stays correct, retried later",
                        exc_info=True,
                        extra=kv(namespace=namespace, page=page_hash.hex(), failures=self._meta_write_failures))
            return
        self._unpend((namespace, page_hash))

    def _demote(self, key: Key, data: Buffer) -> None:
        entry = self._entry(key)
        if entry is None or entry.on_ssd:
            return  # dropped meanwhile, or already on SSD (a promoted page): nothing to write
        if entry.size > self.ssd_capacity_bytes:
            self._evict_oversized_demotion(key, entry)
            return
        try:
            self._write_ssd(key, entry, data)
        except Exception:
            if self._keep_pending_copy(key, entry):
                log.warning("demotion to SSD failed; the page's copy on disk (its delete pending) kept instead",
                            exc_info=True, extra=kv(namespace=key[0], page=key[1].hex()))
                return
            # RocksDB refused the write (disk full, I/O error). The page already left DRAM, so no
            # tier holds it: drop it from the index too, or Exists and claims would report a ghost.
            log.warning(
                "demotion to SSD failed; page evicted", exc_info=True, extra=kv(namespace=key[0], page=key[1].hex())
            )
            self._remove(key)
            self._evictions += 1
            return
        self._demotions += 1

    def _evict_oversized_demotion(self, key: Key, entry: _Entry) -> None:
        """Evicts a page leaving DRAM that is larger than the SSD page budget (stored in DRAM by a Put,
        or the budget lowered under it): written, it would evict every page on the SSD tier and still
        not fit, and a copy of it on disk (its delete pending) is no better. Expected in a deployment
        that runs on DRAM with a small --ssd-bytes, so no traceback and one warning per namespace; the
        rest at debug, counted in evictions. Lock held."""
        ns = self._namespaces[key[0]]
        ns.oversized_evictions += 1
        fields = kv(namespace=key[0], page_bytes=entry.size, ssd_capacity_bytes=self.ssd_capacity_bytes,
                    evicted_so_far=ns.oversized_evictions)
        if ns.oversized_evictions == 1:
            log.warning("a page larger than the SSD page budget left DRAM and is evicted, not demoted; so are the "
                        "namespace's next ones (logged at debug): raise --ssd-bytes to keep them", extra=fields)
        else:
            log.debug("a page larger than the SSD page budget left DRAM; evicted", extra=fields)
        self._remove(key)
        self._evictions += 1

    def _keep_pending_copy(self, key: Key, entry: _Entry) -> bool:
        """For a page whose demotion RocksDB refused: when its SSD copy is still on disk, its delete
        pending (the page stored again into DRAM over it, or hot while capacity dropped the copy),
        cancels that delete and indexes the copy instead of evicting a page the disk holds (before,
        the page was evicted and its copy deleted later). The copy takes its own record's checksum:
        a page stored again may have other bytes (KV computed in another batch need not match bit
        for bit). Its record's owners may be older ones: left pending as an owner rewrite, journaled
        and written by _reconcile_ssd. True when kept. Lock held."""
        size = self._pending_ssd.get(key)
        if not size or size != entry.size:
            return False  # no copy on disk (an owner rewrite pending, or none), or not this page's size
        try:
            raw = self._ssd.get_meta(*key)
        except Exception:  # a read error: evict as before
            return False
        copy = _decode_meta(raw) if raw is not None else None
        if copy is None or copy.size != size:
            return False
        entry.checksum = copy.checksum
        # Its record may name older owners: an owner rewrite stays pending.
        self._index_ssd_copy(key, entry, record_current=False)
        return True

    def _write_ssd(self, key: Key, entry: _Entry, data: Buffer) -> None:
        # A page larger than the budget is refused like a failed write, not written and then evicted
        # together with every other page (a demotion evicts it before getting here: _demote; a
        # flush counts it as not written).
        self._check_fits_ssd(entry.size)
        # Recent before the write: a write that fails may still have created the column family,
        # which is then dropped like any idle one once the namespace stops being recent.
        self._note_ssd_write(key[0])
        # A put replacing a pending record (the page released during a stop, then stored again)
        # resolves it, dropping its journal line: through the WAL then, or a crash before the
        # memtable flush lost the put with no delete ever written, and the old record came back
        # owned by the request that had released it (review of session 27). Rare: other puts
        # stay WAL-less (see SsdTier).
        self._ssd.put(key[0], key[1], data, _encode_meta(entry), logged=key in self._pending_ssd)
        self._index_ssd_copy(key, entry, record_current=True)  # the page and its record are written whole

    def _index_ssd_copy(self, key: Key, entry: _Entry, *, record_current: bool) -> None:
        """Counts entry's copy on the SSD tier: marks it on SSD, puts it last (most recent) in the SSD
        LRU, adds its bytes to ssd_bytes and its namespace's SSD page count. The one place of this
        accounting (a page written, a copy kept over its pending delete, a page recovered), so the
        three cannot drift; _forget_ssd_copy undoes it.

        record_current: the record on disk describes entry (written with the page, or just read at
        recovery), so a record of key left pending is resolved. Else (a copy kept over its pending
        delete, its record naming the owners it had then) the record stays pending as an owner
        rewrite: the copy's bytes move from the pending deletes to the tier, ssd_bytes (tier and
        pending together) unchanged. Lock held."""
        entry.on_ssd = True
        self._ssd_lru[key] = entry.size
        self._ssd_bytes += entry.size
        self._namespaces[key[0]].ssd_pages += 1
        if record_current:
            self._unpend(key)
        else:
            self._pend_ssd(key, 0)

    def _note_ssd_write(self, name: str) -> None:
        """Marks name as written to SSD now; a namespace this pushes out of the recent ones loses
        its column family if it has no SSD pages left."""
        self._ssd_recent[name] = None
        self._ssd_recent.move_to_end(name)
        while len(self._ssd_recent) > _IDLE_COLUMN_FAMILIES:
            old, _ = self._ssd_recent.popitem(last=False)
            self._drop_idle_column_family(old)

    def _forget_ssd_copy(self, key: Key) -> bool:
        """Takes a page out of the SSD tier's accounting (LRU, bytes, its namespace's count); True
        when it was on SSD. The caller deletes the copy on disk."""
        size = self._ssd_lru.pop(key, None)
        if size is None:
            return False
        self._ssd_bytes -= size
        ns = self._namespaces.get(key[0])
        if ns is not None:
            ns.ssd_pages -= 1
        return True

    def _drop_idle_column_family(self, name: str) -> None:
        """Drops name's column family when it holds no page and name is not one of the namespaces
        written to SSD lately. Lock held: a Put that later writes to the namespace re-creates it
        (SsdTier.put), and no read can be under way in between. A failed drop (RocksDB writes its
        MANIFEST: a full disk refuses it) is logged, not raised: the column family stays usable,
        and the next time the namespace empties, or the next start, tries again."""
        ns = self._namespaces.get(name)
        if (ns is not None and ns.ssd_pages > 0) or name in self._ssd_recent:
            return
        try:
            self._ssd.drop_namespace(name)
        except Exception:
            log.warning("dropping an idle column family failed; it is kept", exc_info=True,
                        extra=kv(namespace=name))
            return
        # Its pending deletes went with it (their pages are off the disk); until session 27 their
        # bytes kept counting in ssd_bytes and against the capacity.
        self._unpend_namespace(name)
        log.debug("idle column family dropped", extra=kv(namespace=name))

    def _unpend_namespace(self, name: str) -> None:
        """Resolves every pending record of namespace name: its column family is gone (or goes at
        recovery), records and pages with it. O(pending records): column families drop rarely."""
        for key in [k for k in self._pending_ssd if k[0] == name]:
            self._unpend(key)

    def _enforce_ssd_capacity(self) -> None:
        """Evicts the SSD tier's least recently used pages while the disk holds more than its budget:
        the pages indexed on SSD plus those of pending deletes, which RocksDB still holds (until
        session 27 they were not counted: usage reported too low, and the disk went past its budget
        by them). An eviction frees space only when its delete goes through: while RocksDB refuses
        writes (the tier stalled, or the delete just refused: left pending) evicting more would only
        move pages from the index to the pending deletes, so it stops there; the budget is met again
        as the pending deletes go through (tried here first)."""
        if self._pending_bytes and self._over_ssd_capacity() and self._ssd.may_try():
            self._reconcile_ssd()
        while self._over_ssd_capacity() and self._ssd_lru and not self._ssd.stalled:
            key, size = next(iter(self._ssd_lru.items()))
            pending_before = self._pending_bytes
            if key in self._dram:
                # Still hot in DRAM: free its SSD copy only; it is demoted again if it cools.
                self._forget_ssd_copy(key)
                entry = self._entry(key)
                if entry is not None:
                    entry.on_ssd = False
                self._delete_ssd(key, size, entry.checksum if entry is not None else None)
                self._drop_idle_column_family(key[0])
            else:
                self._remove(key)
                self._evictions += 1
            if self._pending_bytes > pending_before:
                break  # its delete was refused: the disk did not shrink

    def _over_ssd_capacity(self) -> bool:
        return self._ssd_bytes + self._pending_bytes > self.ssd_capacity_bytes

    def _remove(self, key: Key) -> None:
        """Deletes a page from every tier and from the ownership index."""
        ns = self._namespaces.get(key[0])
        entry = ns.entries.pop(key[1], None) if ns is not None else None
        self._dram.pop(key)
        was_on_ssd = self._forget_ssd_copy(key)
        if entry is not None and entry.prev is not None:
            self._chain_links -= 1
        if ns is not None and entry is not None:
            _unindex_owners(ns, key[1], entry.owners)
        # Last: the index is whole whether or not the disk takes the delete.
        if entry is not None and entry.on_ssd:
            self._delete_ssd(key, entry.size, entry.checksum)
        elif entry is not None and key in self._pending_ssd:
            # A page whose SSD copy's delete is pending (dropped for capacity while hot in DRAM, or
            # released and stored again): its journal line kept the copy for recovery while the
            # page was indexed; now it is gone, and the copy too.
            self._rejournal(key)
        if was_on_ssd:
            self._drop_idle_column_family(key[0])
        if ns is not None and entry is not None and not ns.entries:
            self._note_empty(ns.name)

    def _delete_ssd(self, key: Key, size: int, checksum: int | None) -> None:
        """Deletes a page's SSD copy. A failed delete (a write stop, a full disk: RocksDB then
        refuses every write, deletes included) is logged and counted, not raised: the index and the
        accounting in memory are already right, and raising would fail the Put or Release that freed
        the page half done (a Release could then never make room on a full disk). The page is left
        pending (_reconcile_ssd retries the delete): its record still names the owners it had, and
        a restart would bring it back owned by requests that released it. `size`: the page's bytes,
        which stay on disk (counted in ssd_bytes) while the delete is pending; `checksum`: theirs
        (the copy's record's; None: not known), what the journal says of the copy should the page be
        indexed again before the delete goes through (_journaled_meta)."""
        if not self._ssd.may_try():
            # Stalled: not tried (each try costs STALLED_TRY_S under the store lock; a probe a
            # second, SsdTier.may_try), left pending without a warning per page.
            self._pend_ssd(key, size, copy_checksum=checksum)
            return
        try:
            self._ssd.delete(*key)
        except Exception:
            self._meta_write_failures += 1
            self._pend_ssd(key, size, copy_checksum=checksum)
            log.warning("SSD page delete failed; the index in memory stays correct, retried later", exc_info=True,
                        extra=kv(namespace=key[0], page=key[1].hex(), failures=self._meta_write_failures))
            return
        self._unpend(key)

    def _pend_ssd(self, key: Key, size: int, *, copy_checksum: int | None = None) -> None:
        """Leaves key's SSD record pending (newest last). size: the page bytes the disk holds beyond
        the index (a delete: the page's; an owner rewrite: 0); copy_checksum: a delete's copy's
        checksum (None: not known, or kept from when the delete was first left pending). Journaled
        when the intent is new or changed (a delete pending again is the same intent; an owner
        rewrite names new owners)."""
        if size == 0:
            self._pending_copies.pop(key, None)  # no copy beyond the index: the page is indexed on SSD
        elif copy_checksum is not None:
            self._pending_copies[key] = copy_checksum
        old = self._pending_ssd.pop(key, None)
        self._pending_ssd[key] = size
        self._pending_bytes += size - (old or 0)
        if old is None or size == 0 or old == 0:
            self._rejournal(key)

    def _rejournal(self, key: Key) -> None:
        """Journals what recovery should make of pending key's record now (_journaled_meta): on a
        new or changed intent, and whenever the index entry of a page whose copy's delete is pending
        changes (stored again, its owners changed, removed), as its journal line follows the index.
        Each owner change of a page whose rewrite is pending appends its whole owner list again:
        compacted here too, not only when a record resolves (_unpend), or a stop long enough grew
        the journal without bound (3000 claims of one page: 189 MB)."""
        self._journal_change(lambda: self._journal.pend(key, self._journaled_meta(key)))

    def _unpend(self, key: Key) -> None:
        """key's SSD record agrees with the index again (written, deleted, or gone with its column
        family); no-op when it was not pending."""
        size = self._pending_ssd.pop(key, None)
        self._pending_copies.pop(key, None)
        if size is None:
            return
        self._pending_bytes -= size
        # Nothing pending: the journal goes (a rewrite with no records).
        self._journal_change(lambda: self._journal.resolve(key), compact=not self._pending_ssd)

    def _entry(self, key: Key) -> _Entry | None:
        """key's index entry; None when its namespace or page is not indexed."""
        ns = self._namespaces.get(key[0])
        return ns.entries.get(key[1]) if ns is not None else None

    def _intended_meta(self, key: Key) -> bytes | None:
        """The record key should have on SSD while the store runs (_reconcile_ssd writes it): its
        owner record when the page is indexed on SSD, else none (None: deleted; a page hot in DRAM
        whose SSD copy capacity dropped gives up the copy's bytes)."""
        entry = self._entry(key)
        return _encode_meta(entry) if entry is not None and entry.on_ssd else None

    def _journaled_meta(self, key: Key) -> bytes | None:
        """The record recovery should make of key's copy on disk should the process stop now (the
        journal's line): its owner record while the page is indexed, on SSD or not, else none.
        A page only in DRAM whose copy's delete is pending (capacity dropped the copy while the page
        was hot, or the page was released and stored again) loses its DRAM copy at a crash; the
        copy on disk is then its only one (its owners' page under the same hash), and it is still
        owned. Until session 30 the journal said "delete" for it, the intent of the running store,
        and recovery removed a page its owners had not released (a miss), owners and all.

        The line describes the copy on disk: the page's owners with the copy's own checksum and
        size (_pending_copies), not those of the bytes stored again into DRAM, which need not match
        bit for bit (KV computed in another batch). Until now it carried the DRAM bytes' checksum:
        recovery takes only the owners from a line (the checksum from the record on disk), so no
        Get failed by it, but the line said the copy was bytes it was not, for any reader that
        trusted it."""
        entry = self._entry(key)
        if entry is None:
            return None
        copy = self._pending_copies.get(key)
        if entry.on_ssd or copy is None:
            return _encode_meta(entry)
        return _encode_meta(replace(entry, checksum=copy, size=self._pending_ssd.get(key, entry.size)))

    def _rewrite_journal(self) -> None:
        self._journal.rewrite([(k, self._journaled_meta(k)) for k in self._pending_ssd])

    def _journal_change(self, append: Callable[[], None], *, compact: bool = False) -> None:
        """Journals one change of the pending records: by rewriting the journal whole when `compact`
        or when it is due (PendingJournal.needs_rewrite), else by `append`. A failed rewrite (a full
        disk: the temp file is as large as the journal) leaves the old journal whole and backs off
        until the journal doubles, and the change is appended instead: until session 27 it was
        dropped, and every later change retried the rewrite, never appending (a rewrite failing
        for good journaled nothing more: 399 pending deletes lost at a crash)."""
        if compact or self._journal.needs_rewrite(len(self._pending_ssd)):
            try:
                self._rewrite_journal()
                return
            except OSError as exc:
                self._journal_failures += 1
                log.warning("pending SSD records journal compaction failed; appending, retried once it doubles",
                            extra=kv(path=self._journal.path, error=str(exc), failures=self._journal_failures))
        self._journal_op(append)

    def _journal_op(self, op: Callable[[], None]) -> None:
        """Runs a journal write; a failure (a full disk) is logged, not raised: the record stays
        pending in memory, only a crash before it goes through loses it (as before the journal)."""
        try:
            op()
        except OSError as exc:
            self._journal_failures += 1
            if self._journal_failures == 1 or self._journal_failures % 1000 == 0:
                log.warning("pending SSD records journal write failed; a crash would lose the pending records",
                            extra=kv(path=self._journal.path, error=str(exc), failures=self._journal_failures))

    def _reconcile_ssd(self, limit: int = 256) -> int:
        """Retries the SSD records RocksDB refused to delete or rewrite (oldest first, at most
        `limit`), making each agree with the index: a page no tier indexes on SSD any more is
        deleted, one still on SSD gets its current owner record. Stops at the first failure: the
        disk still refuses writes (while the tier is stalled, each try costs STALLED_TRY_S: callers ask
        SsdTier.may_try first, except flush and close, which must try).
        Idempotent: a record already right is written again to the same effect. Returns how many
        are still pending. Lock held."""
        for _ in range(min(limit, len(self._pending_ssd))):
            key = next(iter(self._pending_ssd))
            meta = self._intended_meta(key)
            try:
                if meta is not None:
                    self._ssd.put_meta(key[0], key[1], meta)
                else:
                    self._ssd.delete(*key)
            except Exception as exc:
                self._pending_ssd.move_to_end(key)
                log.debug("SSD record still refused", extra=kv(namespace=key[0], page=key[1].hex(), error=str(exc)))
                break
            self._unpend(key)
        return len(self._pending_ssd)

    def _touch(self, key: Key, entry: _Entry) -> None:
        entry.seq = next(self._seq)
        if key in self._ssd_lru:
            self._ssd_lru.move_to_end(key)
        self._dram.get(key)

    def touch_tail_first(self, namespace: str, page_hashes: Sequence[bytes], *, with_head: bool = False) -> None:
        """Marks a prefix chain's pages used from its last page to its first, after a Get or a Put
        stream went through them head first. Left in that order, page 0 was the least recently used
        of its chain, and evicting it made every later page unreachable (a fetch stops at the first
        missing page) while they kept their capacity: now a chain loses its tail first, as the
        engine's own prefix cache does.

        with_head (a Get): page_hashes may be one part of a chain the client fetches in several
        concurrent streams, each a contiguous run. The part that ends last would leave its pages the
        most recently used, and when that is a later part, the chain's head goes before its tail
        again. So the pages before the part's first one in the chain the last Exists found (the
        client asks Exists for the whole chain before it fetches; _Entry.prev) are touched after it,
        tail first: whichever part ends last, the chain ends up ordered head most recent. The walk
        stops at a page no longer stored, and at a page it already went through (links set by
        Exists calls naming hashes in other orders can form a cycle)."""
        with self._lock:
            ns = self._namespaces.get(namespace)
            if ns is None:
                return
            for page_hash in reversed(page_hashes):
                entry = ns.entries.get(page_hash)
                if entry is not None:
                    self._touch((namespace, page_hash), entry)
            first = ns.entries.get(page_hashes[0]) if with_head and page_hashes else None
            if first is None:
                return
            seen = {page_hashes[0]}
            prev = first.prev
            while prev is not None and prev not in seen:
                entry = ns.entries.get(prev)
                if entry is None:
                    break
                seen.add(prev)
                self._touch((namespace, prev), entry)
                prev = entry.prev

    # ---------------------------------------------------------------- reads
    def get_page(self, namespace: str, page_hash: bytes) -> tuple[Buffer, int] | None:
        """(data, checksum) of a page, or None when missing (or corrupt on disk: then it is deleted)."""
        with self._lock:
            ns = self._namespaces.get(namespace)
            entry = ns.entries.get(page_hash) if ns is not None else None
            if entry is None:
                self._misses += 1
                return None
            key: Key = (namespace, page_hash)
            self._touch(key, entry)
            data = self._dram.get(key)
            if data is not None:
                self._hits += 1
                return data, entry.checksum
            try:
                data = self._ssd.get(namespace, page_hash)
            except Exception:  # RocksDB reports on-disk corruption (blob/block checksum) as an error
                log.warning("SSD read failed", exc_info=True, extra=kv(namespace=namespace, page=page_hash.hex()))
                data = b""
            if data is None:
                self._misses += 1
                self._drop_orphan(key)
                return None
            if len(data) != entry.size or (self.verify_checksums and page_checksum(data) != entry.checksum):
                self._checksum_failures += 1
                self._misses += 1
                log.warning("page failed its checksum; deleted", extra=kv(namespace=namespace, page=page_hash.hex()))
                self._remove(key)
                return None
            self._hits += 1
            if self._dram.fits(len(data)) and self._may_promote(len(data)):
                self._promotions += 1
                for evicted_key, evicted in self._dram.put(key, data):
                    self._demote(evicted_key, evicted)  # type: ignore[arg-type]
                self._enforce_ssd_capacity()
            return data, entry.checksum

    def _may_promote(self, size: int) -> bool:
        """Whether an SSD hit of `size` bytes is copied into DRAM. Always while the SSD tier takes
        writes; while it is stalled (a write stop outlasted the timeout) only when that evicts no
        DRAM-only page: such a page's demotion is refused (after STALLED_TRY_S under the lock) and
        the page is lost, for a copy of a page the SSD tier already holds and serves as it is. Until
        now every SSD hit during a stall evicted DRAM-only pages for good. Lock held."""
        if not self._ssd.stalled:
            return True
        for key in self._dram.victims(size):
            entry = self._entry(cast(Key, key))
            if entry is not None and not entry.on_ssd:
                return False
        return True

    def get(
        self, namespace: str, page_hashes: Sequence[bytes], layout: KVLayout | None = None
    ) -> Iterator[tuple[bytes, Buffer | None, int]]:
        """(hash, data or None, checksum) per asked hash, in order. A stated layout must match."""
        self.check_layout(namespace, layout)
        for i, page_hash in enumerate(page_hashes):
            if len(page_hash) != HASH_BYTES:
                raise InvalidArgument(f"must be {HASH_BYTES} bytes, got {len(page_hash)}", field=f"page_hashes[{i}]")
        for page_hash in page_hashes:
            found = self.get_page(namespace, page_hash)
            yield (page_hash, None, 0) if found is None else (page_hash, found[0], found[1])
        self.touch_tail_first(namespace, page_hashes, with_head=True)

    def check_layout(self, namespace: str, layout: KVLayout | None) -> None:
        if layout is None:
            return
        with self._lock:
            ns = self._namespaces.get(namespace)
            if ns is not None:
                ns.layout.check_same(layout)

    def exists(self, namespace: str, page_hashes: Sequence[bytes]) -> int:
        """Length of the longest prefix of page_hashes that is stored. That prefix counts as used,
        tail first (touch_tail_first): a client that put or fetched a chain in concurrent streams
        asks once more at the end to leave the chain's head the most recently used."""
        with self._lock:
            ns = self._namespaces.get(namespace)
            if ns is None:
                return 0
            found: list[_Entry] = []
            for page_hash in page_hashes:
                entry = ns.entries.get(page_hash)
                if entry is None:
                    break
                found.append(entry)
            n = len(found)
            # One link per page (_Entry.prev), replaced by a later Exists through it.
            for pos in range(1, n):
                entry = found[pos]
                if entry.prev is None:
                    self._chain_links += 1
                entry.prev = page_hashes[pos - 1]
            self.touch_tail_first(namespace, page_hashes[:n])
            return n

    # ---------------------------------------------------------------- release
    def release(self, namespace: str, request_id: str, page_hashes: Sequence[bytes] = ()) -> int:
        """Drops request_id's ownership of its pages (all of them when page_hashes is empty); pages
        left without owners are deleted, but for anonymous ones (put without a request id at some
        point): they go back to being evicted by capacity only. Returns the number of pages the
        request released."""
        # A whole release keeps a tombstone keyed by both names (release_tombstone_seconds): an
        # unchecked name of up to the message limit each would make them gigabytes.
        _check_name(namespace, "namespace")
        _check_name(request_id, "request_id")
        with self._lock:
            # SSD records an earlier refusal left disagreeing with the index (a retried Release too).
            if self._pending_ssd and self._ssd.may_try():  # stalled: a try a second, not one per Release
                self._reconcile_ssd()
            if not page_hashes:
                # The request is over (a whole release): refuse its offloads still in flight. Also
                # where it owns nothing here: its late offload may be the first to reach this replica.
                self._tombstone_request(namespace, request_id)
            ns = self._namespaces.get(namespace)
            if ns is None:
                return 0
            owned = ns.by_owner.get(request_id, set())
            # dict.fromkeys: a hash listed twice is released once (the second would find it gone).
            targets = list(owned) if not page_hashes else [h for h in dict.fromkeys(page_hashes) if h in owned]
            for page_hash in targets:
                entry = ns.entries[page_hash]
                entry.owners.discard(request_id)
                owned.discard(page_hash)
                if not entry.owners and not entry.anonymous:
                    self._remove((namespace, page_hash))
                else:
                    self._owners_changed(namespace, page_hash, entry)
            if not owned:
                ns.by_owner.pop(request_id, None)
            self._released += len(targets)
            return len(targets)

    # ---------------------------------------------------------------- stats / lifecycle
    def stats(self) -> KvStats:
        with self._lock:
            return KvStats(
                dram_bytes=self._dram.bytes,
                dram_capacity_bytes=self._dram.capacity_bytes,
                ssd_bytes=self._ssd_bytes + self._pending_bytes,
                ssd_capacity_bytes=self.ssd_capacity_bytes,
                hits=self._hits,
                misses=self._misses,
                evictions=self._evictions,
                namespaces=len(self._namespaces),
                pages=sum(len(ns.entries) for ns in self._namespaces.values()),
                dram_pages=len(self._dram),
                ssd_pages=len(self._ssd_lru),
                demotions=self._demotions,
                promotions=self._promotions,
                checksum_failures=self._checksum_failures,
                released_pages=self._released,
                dropped_namespaces=self._dropped,
                late_puts=self._late_puts,
                meta_write_failures=self._meta_write_failures,
                column_families=len(self._ssd.namespaces()),
                memtable_bytes=self._ssd.memtable_bytes(),
                flush_failures=self._flush_failures,
                write_stalls=self._ssd.write_stalls,
                write_stall_failures=self._ssd.write_stall_failures,
                write_stall_seconds=self._ssd.write_stall_seconds,
                pending_ssd_records=len(self._pending_ssd),
                pending_ssd_bytes=self._pending_bytes,
                chain_links=self._chain_links,
                orphan_owner_records=self._orphan_records,
            )

    def namespace_layout(self, namespace: str) -> KVLayout | None:
        with self._lock:
            ns = self._namespaces.get(namespace)
            return ns.layout if ns is not None else None

    def raw_ssd(self) -> SsdTier:
        """The SSD tier itself (tests corrupt pages through it)."""
        return self._ssd

    def flush_to_ssd(self) -> int:
        """Writes DRAM-only pages to the SSD tier (oldest first); returns how many were written.

        A page whose write fails is logged, counted (flush_failures) and stays DRAM-only: one bad
        write must not cost the pages after it their demotion, nor (in close) the close of RocksDB.
        A write that stalled (WriteStalled: RocksDB takes no writes, e.g. a full disk) ends the
        flush: every page after it would wait out the stall timeout too."""
        with self._lock:
            self._reconcile_ssd(limit=len(self._pending_ssd))
            n = failed = oversized = 0
            pending = [(cast(Key, key), data) for key, data in self._dram.items()]
            for i, (key, data) in enumerate(pending):
                entry = self._entry(key)
                if entry is None or entry.on_ssd:
                    continue
                if entry.size > self.ssd_capacity_bytes:
                    # Never fits the SSD tier (see _demote): counted, without a traceback.
                    failed += 1
                    oversized += 1
                    continue
                try:
                    self._write_ssd(key, entry, data)
                except WriteStalled:
                    left = sum(1 for k, _ in pending[i:] if self._dram_only(k))
                    failed += left
                    log.error("flush to SSD stopped: RocksDB takes no writes", exc_info=True,
                              extra=kv(written=n, not_written=left))
                    break
                except Exception:
                    failed += 1
                    if failed == 1:  # one traceback; the rest are counted (a full disk fails them all)
                        log.warning("flush to SSD: a page write failed; it stays in DRAM only", exc_info=True,
                                    extra=kv(namespace=key[0], page=key[1].hex()))
                    continue
                n += 1
            self._flush_failures += failed
            if failed:
                log.warning("flush to SSD: pages not written",
                            extra=kv(written=n, failed=failed, larger_than_ssd_budget=oversized))
            self._enforce_ssd_capacity()
            self._ssd.flush()
            return n

    @property
    def flush_failures(self) -> int:
        """DRAM pages flush_to_ssd (close) could not write to SSD (logged)."""
        with self._lock:
            return self._flush_failures

    def _dram_only(self, key: Key) -> bool:
        entry = self._entry(key)
        return entry is not None and not entry.on_ssd

    def close(self) -> None:
        """Flushes DRAM to SSD and closes RocksDB (graceful stop); idempotent. RocksDB is closed
        whatever the flush does (a failed write, a failed memtable flush): left open, the process
        would exit with its memtables unflushed and, in a process that goes on, hold the DB's LOCK."""
        with self._lock:
            if self._closed:
                return
            flushed = 0
            try:
                flushed = self.flush_to_ssd()
            except Exception:
                log.error("flush to SSD at close failed; closing RocksDB anyway", exc_info=True)
            finally:
                self._closed = True
                self._ssd.close()
                # What is still pending stays journaled: the next open applies it.
                self._journal.close()
            log.info("kvstore closed", extra=kv(flushed_pages=flushed, flush_failures=self._flush_failures,
                                                ssd_bytes=self._ssd_bytes))
