"""glibc malloc tuning for processes that churn large buffers: the kvstore server, a worker's
KVClient (KV pages) and the reference engine (per-step tensors).

Why: glibc serves every allocation above its mmap threshold (128 KiB at start, adjusted
dynamically) with a fresh mmap and gives it back with munmap on free, and it trims the top of the
heap back to the OS once 128 KiB are free there. A page (0.7 MiB for SmolLM2 in float32) passes
through several such buffers per hop (gRPC slices, protobuf arenas, Python bytes), so each hop
page-faults fresh zero-filled memory in: on this VM building and serializing one 0.7 MiB
PutRequest ran at 0.15 GB/s untuned against 3 GB/s tuned (bench numbers in services/kvstore/README.md).
Raising both thresholds keeps those buffers in the heap, where the next page reuses them. Both are
needed: a higher mmap threshold alone just moves the churn to heap trimming.

The engine has the same problem with its per-step tensors on the CPU: the logits of a step and
the target distributions computed from them are [rows, vocab] float32, 4.7 MiB for a batch of 8
with 2-token drafts (49,152 tokens of vocabulary), several per step. Untuned, a drafted step at
batch 8 page-faulted 4.5K-18K pages (18-70 MiB of fresh zeroed memory) and a plain step at batch
32 up to 21K; tuned, none (tests/engine/test_engine_malloc.py, docs/benchmarks.md).

Threads other than the first allocate from their own arenas, chains of heaps of at most 64 MiB,
and glibc (heap_trim in malloc/arena.c) unmaps a thread arena's newest heap as soon as it is
entirely free, whatever the trim threshold, unless the free space left in the heap before it is
below the top pad (M_TOP_PAD, default 128 KiB). So the pages a worker's fetch threads received,
imported and freed were page-faulted in again on the next fetch: 16.7K faults per 134 MB fetch and
0.3-0.9 GB/s, against ~0 faults and 0.9-1.2 GB/s with a 64 MiB top pad, which keeps every heap
(same script, alternating processes, 2 streams). Capping the arenas at 1 avoids it as well, but
slowed the engine's decode by 7-12% (2 torch threads, batch 8 and 32: one malloc lock for all
threads). The top pad also makes the main heap grow in steps of up to 64 MiB of address space, which
costs nothing until touched.

Cost: freed memory stays mapped in the process instead of going back to the OS: up to
`trim_bytes` at the top of the main heap, and all of a thread arena's heaps once they have grown
(each new thread arena also maps its first 64 MiB writable at once; untouched, that is address
space, not resident memory, unless the kernel runs with strict overcommit). Outside glibc (musl,
macOS) this does nothing.
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
_M_TOP_PAD = -2
_M_MMAP_THRESHOLD = -3
_M_ARENA_MAX = -8
# A thread arena's heap size limit on 64-bit glibc. glibc caps M_MMAP_THRESHOLD at half of it; a
# larger value is refused.
HEAP_MAX_SIZE = 64 * 1024 * 1024
MAX_MMAP_THRESHOLD = HEAP_MAX_SIZE // 2


@dataclass(frozen=True)
class MallocTuning:
    mmap_threshold: int
    trim_bytes: int
    arenas: int | None  # None: glibc's default (8 per core)
    top_pad: int = 0


_lock = threading.Lock()
_applied: MallocTuning | None = None


def tune_malloc(
    mmap_threshold: int = MAX_MMAP_THRESHOLD,
    trim_bytes: int = 256 * 1024 * 1024,
    arenas: int | None = None,
    top_pad: int = HEAP_MAX_SIZE,
) -> bool:
    """Raises glibc's mmap and trim thresholds and its top pad (once per process; later calls are
    no-ops). top_pad: HEAP_MAX_SIZE keeps thread arenas' heaps mapped once free (module docstring).

    arenas: also caps glibc's malloc arenas (threads that have not allocated yet share them). A
    single arena means no thread arena heaps to lose (the top pad is the cheaper fix for that) at
    the cost of malloc lock contention between threads that allocate a lot at once, so the kvstore
    server (Python, under the GIL) caps it, and a worker chooses (KVClient(malloc_arenas=...)).

    True when glibc accepted the settings (now or earlier)."""
    global _applied
    if not 0 < mmap_threshold <= MAX_MMAP_THRESHOLD:
        raise ValueError(f"mmap_threshold: must be in (0, {MAX_MMAP_THRESHOLD}], got {mmap_threshold}")
    if not 0 < trim_bytes < 2**31:  # mallopt takes a C int
        raise ValueError(f"trim_bytes: must be in (0, 2**31), got {trim_bytes}")
    if arenas is not None and arenas < 1:
        raise ValueError(f"arenas: must be >= 1, got {arenas}")
    if not 0 <= top_pad < 2**31:
        raise ValueError(f"top_pad: must be in [0, 2**31), got {top_pad}")
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
        ok = (
            mallopt(_M_TRIM_THRESHOLD, trim_bytes) == 1
            and mallopt(_M_MMAP_THRESHOLD, mmap_threshold) == 1
            and mallopt(_M_TOP_PAD, top_pad) == 1
        )
        if ok and arenas is not None:
            ok = mallopt(_M_ARENA_MAX, arenas) == 1
        if ok:
            _applied = MallocTuning(mmap_threshold, trim_bytes, arenas, top_pad)
            log.info(
                "malloc tuned for large buffers",
                extra=kv(mmap_threshold=mmap_threshold, trim_bytes=trim_bytes, arenas=arenas, top_pad=top_pad),
            )
        return ok


def malloc_tuned() -> MallocTuning | None:
    """The tuning applied in this process, or None."""
    return _applied
