"""glibc malloc tuning for processes that move KV pages (the kvstore server, a worker's KVClient).

Why: glibc serves every allocation above its mmap threshold (128 KiB at start, adjusted
dynamically) with a fresh mmap and gives it back with munmap on free, and it trims the top of the
heap back to the OS once 128 KiB are free there. A page (0.7 MiB for SmolLM2 in float32) passes
through several such buffers per hop (gRPC slices, protobuf arenas, Python bytes), so each hop
page-faults fresh zero-filled memory in: on this VM building and serializing one 0.7 MiB
PutRequest ran at 0.15 GB/s untuned against 3 GB/s tuned (bench numbers in services/kvstore/README.md).
Raising both thresholds keeps those buffers in the heap, where the next page reuses them. Both are
needed: a higher mmap threshold alone just moves the churn to heap trimming.

Cost: up to `trim_bytes` of freed memory stays mapped in the process instead of going back to
the OS. Outside glibc (musl, macOS) this does nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import threading
from dataclasses import dataclass

from services.common.log import get_logger, kv

log = get_logger(__name__)

# mallopt parameters (malloc.h).
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_M_ARENA_MAX = -8
# glibc caps M_MMAP_THRESHOLD at HEAP_MAX_SIZE / 2 = 32 MiB on 64-bit; a larger value is refused.
MAX_MMAP_THRESHOLD = 32 * 1024 * 1024


@dataclass(frozen=True)
class MallocTuning:
    mmap_threshold: int
    trim_bytes: int
    arenas: int | None  # None: glibc's default (8 per core)


_lock = threading.Lock()
_applied: MallocTuning | None = None


def tune_malloc_for_pages(
    mmap_threshold: int = MAX_MMAP_THRESHOLD, trim_bytes: int = 256 * 1024 * 1024, arenas: int | None = None
) -> bool:
    """Raises glibc's mmap and trim thresholds (once per process; later calls are no-ops).

    arenas: also caps glibc's malloc arenas (threads that have not allocated yet share them). A
    thread's own arena is a chain of 64 MiB heaps, and glibc unmaps a heap as soon as all of it is
    free whatever the trim threshold: pages received on such a thread, kept a while and freed
    (a fetch imported into the engine) page-fault back in on the next fetch. arenas=1 puts every
    thread on the main heap, where the trim threshold holds (measured on a 256 MiB fetch: 125-280K
    page faults per GB without, ~0 with). Costs malloc lock contention between threads that
    allocate a lot at once, so the kvstore server (Python, under the GIL) caps it, and a worker
    chooses (KVClient(malloc_arenas=...)).

    True when glibc accepted the settings (now or earlier)."""
    global _applied
    if not 0 < mmap_threshold <= MAX_MMAP_THRESHOLD:
        raise ValueError(f"mmap_threshold: must be in (0, {MAX_MMAP_THRESHOLD}], got {mmap_threshold}")
    if not 0 < trim_bytes < 2**31:  # mallopt takes a C int
        raise ValueError(f"trim_bytes: must be in (0, 2**31), got {trim_bytes}")
    if arenas is not None and arenas < 1:
        raise ValueError(f"arenas: must be >= 1, got {arenas}")
    with _lock:
        if _applied is not None:
            return True
        name = ctypes.util.find_library("c")
        try:
            libc = ctypes.CDLL(name or "libc.so.6")
            mallopt = libc.mallopt
        except (OSError, AttributeError):
            return False  # not glibc: nothing to tune
        mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
        mallopt.restype = ctypes.c_int
        ok = mallopt(_M_TRIM_THRESHOLD, trim_bytes) == 1 and mallopt(_M_MMAP_THRESHOLD, mmap_threshold) == 1
        if ok and arenas is not None:
            ok = mallopt(_M_ARENA_MAX, arenas) == 1
        if ok:
            _applied = MallocTuning(mmap_threshold, trim_bytes, arenas)
            log.info(
                "malloc tuned for page buffers",
                extra=kv(mmap_threshold=mmap_threshold, trim_bytes=trim_bytes, arenas=arenas),
            )
        return ok


def malloc_tuned() -> MallocTuning | None:
    """The tuning applied in this process, or None."""
    return _applied
