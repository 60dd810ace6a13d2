"""KVClient's concurrent streams per replica, and the page-path helpers (split, malloc tuning)."""

from __future__ import annotations

import platform
import subprocess
import sys
from collections.abc import Callable, Iterator

import grpc
import pytest

from services.common.memtune import HEAP_MAX_SIZE, MAX_MMAP_THRESHOLD, malloc_tuned, tune_malloc
from services.kvstore.checksum import page_checksum
from services.worker.engine import KVPages
from services.worker.kv_client import KVClient, split_even
from tests.common.malloc_env import plain_malloc_env
from tests.kvstore.kvhelpers import KV_LAYOUT, LAYOUT, Replica, make_pages

Make = Callable[..., Replica]

TOKENS = list(range(2000, 2000 + 4 * 24))  # 24 full pages


@pytest.mark.parametrize(("n", "parts"), [(0, 3), (1, 3), (5, 2), (24, 3), (7, 7), (3, 10), (10, 1)])
def test_split_even_covers_all_items_in_order(n: int, parts: int) -> None:
    items = list(range(n))
    runs = split_even(items, parts)
    assert [x for run in runs for x in run] == items
    assert all(len(run) > 0 for run in runs)
    assert len(runs) == min(parts, n) if n else runs == []
    if runs:
        assert max(map(len, runs)) - min(map(len, runs)) <= 1


@pytest.mark.parametrize("streams", [1, 2, 5])
def test_streams_round_trip_with_claims(replicas: Make, streams: int) -> None:
    r = replicas("a")
    full = make_pages(TOKENS)
    first = KVPages(full.model_version, full.layout, full.token_ids[:40], full.page_hashes[:10], full.pages[:10])
    with KVClient([r.address], streams_per_replica=streams) as kv:
        assert kv.put_pages(first, "r1") == 10
        # 10 pages are claimed (first stream), 14 new ones are split over the streams.
        assert kv.put_pages(full, "r2") == 14
        s = kv.stats()
        assert s.claimed_pages == 10 and s.put_bytes == 24 * len(full.pages[0])
        got = kv.fetch_prefix(TOKENS, "m@v1", KV_LAYOUT)
        assert got is not None and got.pages == full.pages and got.page_hashes == full.page_hashes
        assert all(isinstance(p, memoryview) for p in got.pages)
        # Both owners hold every page they sent or claimed.
        assert kv.release("m@v1", "r1") == 10
        assert kv.release("m@v1", "r2") == 24
        assert r.store is not None and r.store.stats().pages == 0


def test_bad_page_in_a_later_stream_ends_the_prefix_there(replicas: Make) -> None:
    """Pages arrive over several streams; a page failing its checksum in the last stream's share still
    cuts the fetched prefix exactly there (and the store never serves it as good)."""
    r = replicas("a", verify_put_checksums=False)
    pages = make_pages(TOKENS)
    with KVClient([r.address], streams_per_replica=3) as kv:
        assert r.store is not None
        for i, (h, d) in enumerate(zip(pages.page_hashes, pages.pages, strict=True)):
            data = bytes(b ^ 0x5A for b in d) if i == 20 else d
            r.store.put("m@v1", LAYOUT, h, data, page_checksum(d), "r1")
        got = kv.fetch_prefix(TOKENS, "m@v1", KV_LAYOUT)
        assert got is not None and got.pages == pages.pages[:20]
        assert kv.stats().checksum_failures == 1


def test_put_checksum_mismatch_is_rejected_by_the_server(replicas: Make) -> None:
    """The server still verifies each Put page's checksum when it decodes with services.kvstore.wire."""
    r = replicas("a")
    pages = make_pages(TOKENS)
    bad = list(pages.pages)
    bad[3] = bytes(b ^ 1 for b in bad[3])
    with KVClient([r.address], streams_per_replica=1) as kv:
        # The client computes the checksum of what it sends; make it disagree by corrupting after the fact.
        original = kv._put_rpc[r.address]

        def corrupting(requests: Iterator[bytes], timeout: float) -> grpc.Future:
            def gen() -> Iterator[bytes]:
                for k, raw in enumerate(requests):
                    yield raw[:-1] + bytes([raw[-1] ^ 1]) if k == 3 else raw

            return original.future(gen(), timeout=timeout)  # type: ignore[no-any-return]

        class Rpc:
            future = staticmethod(corrupting)

        kv._put_rpc[r.address] = Rpc  # type: ignore[assignment]
        with pytest.raises(Exception, match=r"requests\[3\]\.checksum"):
            kv.put_pages(pages, "r1")
        assert r.store is not None and r.store.stats().pages == 3  # the pages before it stay stored


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc mallopt")
def test_malloc_tuning_applies_once_and_checks_its_arguments() -> None:
    assert tune_malloc() is True
    assert tune_malloc(trim_bytes=1 << 20) is True  # later calls keep the first setting
    applied = malloc_tuned()
    assert applied is not None and applied.mmap_threshold <= MAX_MMAP_THRESHOLD
    with pytest.raises(ValueError, match="mmap_threshold"):
        tune_malloc(mmap_threshold=MAX_MMAP_THRESHOLD + 1)
    with pytest.raises(ValueError, match="trim_bytes"):
        tune_malloc(trim_bytes=0)
    with pytest.raises(ValueError, match="arenas"):
        tune_malloc(arenas=0)
    with pytest.raises(ValueError, match="top_pad"):
        tune_malloc(top_pad=-1)


_FAULT_PROBE = """
import resource, sys, threading
from services.common.memtune import tune_malloc
assert tune_malloc() if sys.argv[1] == "default" else tune_malloc(top_pad=int(sys.argv[1]))
faults = []
def work():
    # 140 page-sized buffers (~100 MB: more than one 64 MiB heap of this thread's arena), freed,
    # then the same again, as a fetch thread receives, imports and frees pages chunk after chunk.
    for _ in range(3):
        f0 = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt
        bufs = [b"\\x01" * 737_280 for _ in range(140)]
        faults.append(resource.getrusage(resource.RUSAGE_THREAD).ru_minflt - f0)
        del bufs
t = threading.Thread(target=work)
t.start()
t.join()
print(max(faults[1:]))
"""


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc malloc, RUSAGE_THREAD")
@pytest.mark.parametrize("top_pad", ["default", str(HEAP_MAX_SIZE), str(128 * 1024)])
def test_thread_arena_keeps_freed_page_buffers_mapped(top_pad: str) -> None:
    """With the default top pad, a thread arena's heap is unmapped once all of it is free, so the
    next round of page buffers on that thread faults fresh memory in (the negative control);
    with a 64 MiB top pad the second and third rounds reuse the mapped memory."""
    out = subprocess.run(
        [sys.executable, "-c", _FAULT_PROBE, top_pad], capture_output=True, text=True, timeout=60, check=True,
        env=plain_malloc_env(),
    )
    faults = int(out.stdout.strip())
    if top_pad != str(128 * 1024):  # the default tuning is the 64 MiB pad
        assert faults < 500, faults
    else:
        assert faults > 4000, faults  # ~8.8K: the freed heap's ~36 MB faulted in again
