"""RocksDB storage of the buffer (rocksdict, raw bytes keys and values).

Key layout (batch ids cannot contain '/', so "<prefix>/<batch_id>/" never matches another batch):

    m/policy_version                      current policy version (decimal)
    m/policy_source                       weights directory of the current policy
    m/policy_intent                       an UpdateWeights whose outcome is unknown (JSON)
    m/next_submit_seq                     the number the next submitted batch gets (decimal)
    m/store_format                        the store format version (decimal; STORE_FORMAT)
    b/<batch_id>                          BatchRecord
    g/<batch_id>/<group:06d>              GroupRecord
    r/<batch_id>/<group:06d>/<sample:04d> RequestRecord
    c/<batch_id>/<group:06d>/<sample:04d>/<seq:08d>   ChunkRecord (while the request is unfinished)
    l/<batch_id>/<index:010d>             RolloutResult (the batch's append-only results log)
    z/<batch_id>/<index:010d>             stored bytes of that RolloutResult (decimal; absent in
                                          stores written before sizes were kept)
    h/<prompt_key>                        history iterations of a prompt key
    d/<batch_id>                          a batch retention deleted: "<deletion seq> <results> <submit seq>"
    t/<submission_token>                  a token CancelBatch found no batch of: "<seq>" (refused by SubmitBatch)

Zero-padded numbers make key order the numeric order (recovery and GetBatch read requests in key
order) only while they fit their width: validation bounds groups per batch (MAX_GROUPS_PER_BATCH,
10**6) and samples per group (MAX_GROUP_SIZE, 1024); a seq is below max_tokens, a result index
below the batch's requests.

Every state change is one WriteBatch, so a crash (even kill -9) leaves either all of it or none.
Calls block; the gRPC server runs them in its handler threads.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from rocksdict import Options, Rdict, RdictIter, Snapshot, WriteBatch, WriteOptions

from services.common.errors import DataLoss, FailedPrecondition


def batch_key(batch_id: str) -> bytes:
    return f"b/{batch_id}".encode()


def group_key(batch_id: str, group_index: int) -> bytes:
    return f"g/{batch_id}/{group_index:06d}".encode()


def request_key(batch_id: str, group_index: int, sample_index: int) -> bytes:
    return f"r/{batch_id}/{group_index:06d}/{sample_index:04d}".encode()


def requests_prefix(batch_id: str) -> bytes:
    return f"r/{batch_id}/".encode()


def chunk_key(batch_id: str, group_index: int, sample_index: int, seq: int) -> bytes:
    return f"c/{batch_id}/{group_index:06d}/{sample_index:04d}/{seq:08d}".encode()


def chunks_prefix(batch_id: str, group_index: int, sample_index: int) -> bytes:
    return f"c/{batch_id}/{group_index:06d}/{sample_index:04d}/".encode()


def chunks_range(batch_id: str, group_index: int, sample_index: int) -> tuple[bytes, bytes]:
    """[begin, end) covering every chunk key of one request."""
    prefix = chunks_prefix(batch_id, group_index, sample_index)
    return prefix, prefix[:-1] + b"0"  # '0' sorts right after '/'


BATCH_PREFIXES = (b"g/", b"r/", b"c/", b"l/", b"z/")


def batch_ranges(batch_id: str) -> list[tuple[bytes, bytes]]:
    """[begin, end) ranges covering every key of a batch except its b/ record."""
    return [(p + f"{batch_id}/".encode(), p + f"{batch_id}0".encode()) for p in BATCH_PREFIXES]


def result_key(batch_id: str, index: int) -> bytes:
    return f"l/{batch_id}/{index:010d}".encode()


def result_size_key(batch_id: str, index: int) -> bytes:
    """The stored size of result `index`: a results page ends before a value that would not fit
    without reading it (BufferCore.read_results)."""
    return f"z/{batch_id}/{index:010d}".encode()


def deleted_key(batch_id: str) -> bytes:
    """A batch retention deleted: value "<deletion seq> <results it had>" (the seq orders eviction
    of the oldest remembered deletions across restarts)."""
    return f"d/{batch_id}".encode()


def cancelled_token_key(token: str) -> bytes:
    """A submission token a CancelBatch found no batch of: value "<seq>" (orders eviction of the
    oldest remembered tokens across restarts). Tokens cannot contain '/'."""
    return f"t/{token}".encode()


def history_key(prompt_key: str) -> bytes:
    return b"h/" + prompt_key.encode()


POLICY_VERSION_KEY = b"m/policy_version"
# The weights directory of the current policy (the last non-empty UpdateWeights source).
POLICY_SOURCE_KEY = b"m/policy_source"
# A weight update whose outcome is unknown (JSON {"version", "source"}): written before the buffer
# asks the scheduler to switch, deleted with the write of the new version (or when the scheduler
# refused outright). While it exists the workers may serve either version.
POLICY_INTENT_KEY = b"m/policy_intent"


class View:
    """A consistent view of the store for point reads (a RocksDB snapshot): writes after it was
    taken do not show. Only point reads: rocksdict's Snapshot.items()/iter() (0.3.29) read the live
    database, not the snapshot (Store.scan is a consistent view by itself)."""

    def __init__(self, snapshot: Snapshot) -> None:
        self._snapshot: Snapshot | None = snapshot

    def get_many(self, keys: list[bytes]) -> list[bytes | None]:
        """The values of keys as of the view (None where absent)."""
        if self._snapshot is None:
            raise RuntimeError("store view: read after release()")
        out: list[bytes | None] = []
        for key in keys:
            try:
                value = self._snapshot[key]
            except Exception as e:  # rocksdict raises a bare Exception for an absent key
                if "key not found" not in str(e):  # the text varies by rocksdict version
                    raise
                out.append(None)
                continue
            out.append(bytes(value))
        return out

    def release(self) -> None:
        """Drops the snapshot (it keeps the database open and holds old versions in it)."""
        self._snapshot = None


class ScanError(DataLoss):
    """A scan could not read the store (a corrupted block, an I/O error): raised instead of ending
    the scan early, which would pass a partial read off as the whole."""


class Scan:
    """Store.scan's items: an iterator over one RocksDB iterator, which reads the store as of its
    creation (RocksDB pins the sequence number and the files at NewIterator, not at the seek).

    Stepped by hand (seek/valid/next) rather than through rocksdict's items(): items() ends when
    the iterator becomes invalid and never checks its status, so a corrupted block ended a scan
    without error halfway (32,864 of 65,536 records). Here the end of the loop checks status()."""

    def __init__(self, it: RdictIter, prefix: bytes, start: bytes) -> None:
        self._it: RdictIter | None = it
        self._prefix = prefix
        self._start = start
        self._seeked = False
        self._count = 0

    def __iter__(self) -> Scan:
        return self

    def __next__(self) -> tuple[bytes, bytes]:
        it = self._it
        if it is None:
            raise StopIteration
        # The step onto an entry comes before its item, not after the previous one: an item is
        # read only when it is asked for (the first one included: the seek is the first step).
        if self._seeked:
            it.next()
        else:
            it.seek(self._start)
            self._seeked = True
        if it.valid():
            key = bytes(it.key())
            if key.startswith(self._prefix):
                self._count += 1
                return key, bytes(it.value())
        else:
            self._check(it)
        self.close()
        raise StopIteration

    def _check(self, it: RdictIter) -> None:
        """Raises ScanError when the iterator became invalid because of an error, not its end."""
        try:
            it.status()
        except Exception as e:  # rocksdict raises a bare Exception carrying RocksDB's status
            self.close()
            raise ScanError(f"reading the store's {self._prefix!r} keys failed after {self._count} items "
                            f"(from {self._start!r}): {e}") from e

    def close(self) -> None:
        """Drops the iterator (it keeps the database open and holds the files it reads); later
        steps end the scan. Idempotent, and valid before the first step."""
        self._it = None


# The format of the records this buffer writes and reads (README "Storage format"). Bumped by a
# change an older buffer would misread (a field whose meaning changed, one whose loss when an older
# buffer rewrites the record is wrong, a new enum value, a new key kind recovery must see); not by an
# additive optional field older code can ignore (records.py ignores unknown fields with a warning).
STORE_FORMAT = 1
STORE_FORMAT_KEY = b"m/store_format"


class StoreFormatError(FailedPrecondition):
    """The data dir holds a store this buffer cannot read (written by a newer buffer, or a stamp
    that is not a version): refused at open, before any record is read or written."""

    def __init__(self, message: str, *, path: str, found: str) -> None:
        self.path = path
        self.found = found
        super().__init__(message)


class Store:
    def __init__(self, path: str | Path, *, sync: bool = False) -> None:
        Path(path).mkdir(parents=True, exist_ok=True)
        opts = Options(raw_mode=True)
        opts.create_if_missing(True)
        self._db = Rdict(str(path), opts)
        self._write_opts = WriteOptions()
        self._write_opts.sync = sync
        self.path = str(path)
        try:
            self.format = self._check_format()
        except BaseException:
            self._db.close()  # the DB's LOCK: a caller that reports the error may open it again
            raise

    def _check_format(self) -> int:
        """The store's format version, stamped with STORE_FORMAT when absent: a store written
        before stamps were kept (records, no stamp) is format 1, which is what they were. A newer
        stamp is refused before anything is read or written: a newer buffer's records may mean
        something else here, and rewriting them would lose what this buffer does not know of."""
        raw = self.get(STORE_FORMAT_KEY)
        if raw is None:
            wb = self.new_batch()
            wb.put(STORE_FORMAT_KEY, str(STORE_FORMAT).encode())
            self.write(wb)
            return STORE_FORMAT
        text = raw.decode(errors="replace")
        found = int(text) if text.isascii() and text.isdecimal() else None
        if found is None or found < 1:
            raise StoreFormatError(f"data dir {self.path}: store format stamp {STORE_FORMAT_KEY.decode()} is "
                                   f"{text[:40]!r}, not a format version (this buffer supports store "
                                   f"formats up to {STORE_FORMAT})", path=self.path, found=text)
        if found > STORE_FORMAT:
            raise StoreFormatError(f"data dir {self.path}: store format {found} was written by a newer "
                                   f"buffer; this buffer supports store formats up to {STORE_FORMAT} (run a "
                                   f"buffer that supports format {found}, or point --data-dir elsewhere)",
                                   path=self.path, found=text)
        return found

    def get(self, key: bytes) -> bytes | None:
        value = self._db.get(key)
        return None if value is None else bytes(value)

    def get_many(self, keys: list[bytes]) -> list[bytes | None]:
        """Point reads (one multi-get): only these values are read."""
        if not keys:
            return []
        wanted: list[str | int | float | bytes | bool] = list(keys)
        values: list[Any] = self._db.get(wanted) or []  # a list in, a list out (None where absent)
        return [None if v is None else bytes(v) for v in values]

    def scan(self, prefix: bytes, start: bytes | None = None) -> Scan:
        """Items whose key starts with prefix, in key order, from `start` (>= prefix) on.

        The RocksDB iterator is created by this call, not by the first step: the items are the
        store as of the call (later writes, flushes and compactions do not show), so a caller may
        take the scan under its lock and read it after releasing the lock. The seek to the first
        item is the first step. A read error ends the scan with ScanError, never early. close() it
        (or read it to its end) before the store is closed."""
        return Scan(self._db.iter(), prefix, start or prefix)

    def view(self) -> View:
        """Point reads of the store as it is now (a RocksDB snapshot): taken under a caller's lock,
        read after releasing it. release() it before the store is closed."""
        return View(self._db.snapshot())

    def new_batch(self) -> WriteBatch:
        return WriteBatch(raw_mode=True)

    def write(self, wb: WriteBatch) -> None:
        self._db.write(wb, self._write_opts)

    def close(self) -> None:
        self._db.close()
# The submission number the next batch gets, written with each submission: derived from the stored
# batches alone it would fall back after retention deleted the newest one, and a batch id used
# again could then get the number its deleted namesake had (and be taken for a re-delivery of it).
NEXT_SUBMIT_SEQ_KEY = b"m/next_submit_seq"
