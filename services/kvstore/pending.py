"""The journal of pending SSD records: page deletes and owner-record rewrites RocksDB refused.

When RocksDB refuses a page's delete or its owner-record rewrite (a write stop, a full disk), the
store's index in memory is already right and the disk lags (KvStore._pending_ssd, retried later).
Kept in memory only, a crash lost them: the restart rebuilt the index from the records on disk and
brought released pages back, owned by the requests that had released them (nobody releases them
again: a leak until LRU), or kept an owner record short of its new owners. So each pending record
is also journaled here, and the next open applies the journal to the recovered index.

Not in RocksDB: the records are pending exactly because RocksDB refuses writes (a write stop refuses
every write of the DB, the default column family's and the WAL's too). A plain file append is not
stopped by RocksDB's write controller. The file sits in the DB's directory under a name RocksDB does
not parse, so RocksDB's obsolete-file purge leaves it alone.

Format: one JSON array per line, appended (os.write on an O_APPEND descriptor: a process crash keeps
every line written; not fsynced, like the pages themselves, which skip the WAL):
- ["+", namespace, page_hash_hex, meta]: what recovery should make of the page's record on disk:
  `meta` (its owner record: the page is still indexed, on SSD or only in DRAM with its SSD copy's
  delete pending), or none (meta null: the page is gone). A later "+" for the same page replaces it.
- ["-", namespace, page_hash_hex]: the record agrees with the index again.
A line that is not one of these (a write cut short by a crash, a JSON object, a "+" whose meta is
neither a string nor null) is skipped, never taken for a delete and never failing the open. The
file is emptied when no record is pending and rewritten whole (a temp file renamed over it) when it
holds many more lines than pending records, or many more bytes than at its last rewrite: a line
holds a page's whole owner list, so 3000 claims of one page during a write stop appended 189 MB
while its line count stayed under the line limit (review of session 27). A rewrite that fails (a full
disk: the temp file is as large as the journal) removes its temp file and backs off: the next one
waits until the journal has doubled again, and the caller appends the change instead (review of
session 27: every later change retried the rewrite and none was appended).
"""

from __future__ import annotations

import contextlib
import json
import os
from collections import OrderedDict
from collections.abc import Iterable

Key = tuple[str, bytes]  # (namespace, page hash)

FILE_NAME = "seer-pending-ssd.jsonl"
# Lines kept beyond twice the pending records before the journal is rewritten whole.
_SLACK_LINES = 1024
# And bytes beyond twice the journal's size at its last rewrite: the bytes bound matters when lines
# are long (a page with thousands of owners); doubling keeps a rewrite's cost amortized over the
# appends before it.
_SLACK_BYTES = 1 << 20


class PendingJournal:
    """Appends the pending-record changes of one store (its lock serializes the calls). Every method
    may raise OSError (a full disk): the caller logs it, the record stays pending in memory."""

    def __init__(self, directory: str) -> None:
        self.path = os.path.join(directory, FILE_NAME)
        self._fd: int | None = None
        self._lines = 0
        self._bytes = 0  # written since the last rewrite included (an unread old file: not counted)
        self._base_bytes = 0  # the size the last rewrite left (or the size at a failed one)
        self._min_lines = 0  # after a failed rewrite: the line count the next one waits for

    def load(self) -> OrderedDict[Key, bytes | None]:
        """The records pending when the journal was last written, oldest first: page -> the owner
        record it should have, or None when it should be deleted. Empty when there is no journal."""
        out: OrderedDict[Key, bytes | None] = OrderedDict()
        try:
            with open(self.path, "rb") as f:
                raw = f.read()
        except FileNotFoundError:
            return out
        for line in raw.splitlines():
            parsed = _parse(line)
            if parsed is None:
                continue  # a line cut short by a crash, or not ours
            op, key, meta = parsed
            out.pop(key, None)
            if op == "+":
                out[key] = meta
        return out

    def pend(self, key: Key, meta: bytes | None) -> None:
        """Journals that key's record should be `meta` (None: deleted)."""
        self._append(["+", key[0], key[1].hex(), None if meta is None else meta.decode("utf-8")])

    def resolve(self, key: Key) -> None:
        """Journals that key's record agrees with the index again."""
        self._append(["-", key[0], key[1].hex()])

    def needs_rewrite(self, pending: int) -> bool:
        """Whether the journal holds far more than `pending` records need: lines beyond twice their
        count, or bytes beyond twice its size at the last rewrite (lines of long owner lists). After a
        failed rewrite, only once the journal has doubled since (see rewrite)."""
        lines_limit = max(2 * pending + _SLACK_LINES, self._min_lines)
        return self._lines > lines_limit or self._bytes > 2 * self._base_bytes + _SLACK_BYTES

    def rewrite(self, records: Iterable[tuple[Key, bytes | None]]) -> None:
        """Replaces the journal with exactly `records` (none: an empty journal). Atomic: a temp file
        renamed over it, so a crash leaves the old journal or the new one.

        On failure (OSError: a full disk) the old journal is left whole, appendable, and the temp
        file is removed (a full disk kept a partial copy of the journal in it); the next rewrite
        then waits until the journal has doubled again (needs_rewrite), so the caller can append its
        change instead of retrying a rewrite that fails at every change."""
        lines = [
            json.dumps(["+", k[0], k[1].hex(), None if m is None else m.decode("utf-8")]).encode("utf-8") + b"\n"
            for k, m in records
        ]
        self._close_fd()
        tmp = self.path + ".tmp"
        try:
            if not lines:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(self.path)
                self._lines = self._bytes = self._base_bytes = self._min_lines = 0
                return
            data = b"".join(lines)
            with open(tmp, "wb") as f:
                f.write(data)
            os.replace(tmp, self.path)
        except BaseException:
            with contextlib.suppress(OSError):  # gone, or never made (its name is a directory)
                os.unlink(tmp)
            # Back off: as if the journal had been rewritten at its current size.
            self._base_bytes = self._bytes
            self._min_lines = 2 * self._lines + _SLACK_LINES
            raise
        self._lines = len(lines)
        self._bytes = self._base_bytes = len(data)
        self._min_lines = 0

    def close(self) -> None:
        self._close_fd()

    def _append(self, rec: list[object]) -> None:
        if self._fd is None:
            self._fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        line = json.dumps(rec).encode("utf-8") + b"\n"
        # One write per line: O_APPEND keeps it whole at the end (a short write only on a full disk,
        # and load skips the cut line).
        written = os.write(self._fd, line)
        if written != len(line):
            raise OSError(f"short write to {self.path}: {written} of {len(line)} bytes")
        self._lines += 1
        self._bytes += written

    def _close_fd(self) -> None:
        if self._fd is not None:
            fd, self._fd = self._fd, None
            os.close(fd)


def _parse(line: bytes) -> tuple[str, Key, bytes | None] | None:
    """(op, key, meta) of a journal line, or None for one that is not a well-formed "+" or "-" line.
    Any failure means skip: a line that raised out of load (a JSON object: KeyError) kept the store
    from opening, and a "+" whose meta was a number was read as its text, which recovery took for a
    delete of a live page."""
    try:
        rec = json.loads(line)
        if not isinstance(rec, list) or len(rec) < 3:
            return None
        op, namespace, page_hex = rec[0], rec[1], rec[2]
        if not isinstance(namespace, str) or not isinstance(page_hex, str):
            return None
        key = (namespace, bytes.fromhex(page_hex))
        if op == "-" and len(rec) == 3:
            return op, key, None
        if op == "+" and len(rec) == 4 and (rec[3] is None or isinstance(rec[3], str)):
            return op, key, None if rec[3] is None else rec[3].encode("utf-8")
    except Exception:  # whatever a line holds, it is skipped, never fatal
        return None
    return None
