"""Dispatch epochs (RunChunkRequest.dispatch_epoch = the draft service's AppendRequest.epoch).

An epoch orders the attempts of one request: the draft service refuses an append older than the
newest epoch it has seen for the request, and a worker ignores an Abort older than the attempt it
runs. So an attempt must never carry an epoch lower than one already used for its request, or every
append of the newer attempt (its finish too) is refused as stale.

Epochs were `max(request's last + 1, wall clock in microseconds)`. The wall clock is what carried
the order across a scheduler restart (which forgets every request's last epoch), and it can go back:
an NTP step, a VM restored or migrated, a scheduler restarted on a host whose clock is behind. Then
the restarted scheduler's epochs are below the old process's for as long as the clock is behind.

Here the wall clock is read once, at start; the epochs then follow the monotonic clock (never back
within a process) and are strictly increasing over all requests. Across a restart, with
`epoch_file` set, the process reserves epochs ahead in that file (one write per `reserve_us` of
epochs, not per dispatch) and a new process starts above everything reserved, whatever the wall
clock says. Without the file a restart falls back to the wall clock, as before.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
import time
from collections.abc import Callable

from services.common.log import get_logger, kv

log = get_logger(__name__)

# Epochs reserved ahead per write of epoch_file: a minute of microseconds, so a busy scheduler writes
# the file about once a minute, and a restart skips at most a minute's worth of epochs.
RESERVE_US = 60_000_000


class EpochClock:
    """Strictly increasing dispatch epochs (microsecond-like uint64 values). Not thread-safe: the
    Dispatcher calls it under its lock."""

    def __init__(
        self,
        path: str = "",
        *,
        wall_ns: Callable[[], int] = time.time_ns,
        monotonic_ns: Callable[[], int] = time.monotonic_ns,
        reserve_us: int = RESERVE_US,
    ) -> None:
        self._path = path
        self._monotonic_ns = monotonic_ns
        self._reserve_us = reserve_us
        floor = _read_floor(path) if path else 0
        # Above what an earlier process reserved, even when the wall clock is now behind it.
        self._anchor = max(wall_ns() // 1000, floor + 1)
        self._start_ns = monotonic_ns()
        self._last = 0
        self._reserved = 0  # epochs below this are covered by the file (0: nothing written yet)

    def next(self, after: int = 0) -> int:
        """A new epoch, larger than every epoch this clock gave and than `after` (the request's
        last epoch)."""
        now = self._anchor + (self._monotonic_ns() - self._start_ns) // 1000
        epoch = max(self._last + 1, after + 1, now)
        if self._path and epoch >= self._reserved:
            self._reserve(epoch + self._reserve_us)
        self._last = epoch
        return epoch

    def _reserve(self, upto: int) -> None:
        try:
            _write_floor(self._path, upto)
        except OSError as e:
            # Dispatch goes on (the epochs stay ordered within this process); only a restart loses
            # the guarantee. Tried again after another reserve_us of epochs, not every dispatch.
            log.error("could not persist the dispatch epoch floor; a restart may reuse lower epochs",
                      extra=kv(epoch_file=self._path, error=str(e)))
        self._reserved = upto


def _read_floor(path: str) -> int:
    try:
        with open(path, encoding="ascii") as f:
            text = f.read().strip()
    except FileNotFoundError:
        return 0
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"epoch_file: cannot read {path!r}: {e}") from e
    if not text:
        return 0  # created empty (touched beforehand): nothing reserved yet; a torn write cannot leave one
    try:
        value = int(text)
    except ValueError:
        raise ValueError(f"epoch_file: {path!r} holds {text[:40]!r}, not an epoch") from None
    if value < 0:
        raise ValueError(f"epoch_file: {path!r} holds {value}, not an epoch (>= 0)")
    return value


def _write_floor(path: str, value: int) -> None:
    """Atomically (a crash leaves the old value or the new one, never a torn file)."""
    directory = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(prefix=".epoch-", dir=directory)
    try:
        with os.fdopen(fd, "w", encoding="ascii") as f:
            f.write(f"{value}\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        # The rename itself is durable only once the directory is synced: after a power loss the
        # file could otherwise be back at the previous floor, below epochs already handed out.
        dir_fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
