"""StreamResults pages are bounded by the stored bytes they read (results_page_bytes), not only by
their count: 256 results of long responses (token ids, logprobs, text: ~0.5 MB each at 64K tokens)
made pages of ~128 MB, held by every open stream. A page never goes past the bound unless it holds a
single result (which must still go through), and every result arrives exactly once, in order, with
the stream ending exactly when the batch is terminal and its log is drained."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from buffer_helpers import STOP, BufferHandle, commit, group, submit, token_for
from seer.v1 import rollout_pb2

from services.buffer import store as keys
from services.buffer.config import DEFAULT_RESULTS_PAGE_BYTES, BufferConfig
from services.buffer.core import BufferCore, Commit
from services.buffer.model import ModelInfo
from services.buffer.records import FinishReason, GroupSpec, RolloutResult, Sampling
from services.buffer.store import Store, View
from services.common import config

PAGE_BYTES = 40_000  # results_page_bytes of the core tests: a few of their results a page
# Response lengths in tokens, in commit order (8 stored bytes a token, plus the header): pages of
# one to several results, and two results over the bound on their own (12,000 and 6,000 tokens).
LENGTHS = [1_000, 3_000, 500, 12_000, 2_000, 2_000, 2_000, 100, 4_000, 6_000, 700, 700, 1_500, 50, 3_500]
# The order results are committed in (not the request order: the log is in finishing order).
ORDER = [7, 3, 0, 12, 5, 1, 14, 9, 2, 11, 4, 13, 6, 10, 8]


def _core(path: Path, page_bytes: int = PAGE_BYTES) -> BufferCore:
    return BufferCore(Store(path), ModelInfo(vocab_size=1000, max_context=20_000, tokenizer=None),
                      results_page_bytes=page_bytes)


def _submit(core: BufferCore, batch_id: str) -> None:
    core.submit_batch(batch_id, [GroupSpec(prompt_key="pk", prompt_token_ids=(1, 2), group_size=len(LENGTHS),
                                           max_tokens=max(LENGTHS), sampling=Sampling(seed=1))])


def _finish(core: BufferCore, batch_id: str, sample: int) -> None:
    n = LENGTHS[sample]
    tokens = [(7 * i + sample) % 1000 for i in range(n)]
    out = core.commit_chunk(Commit(f"{batch_id}/0/{sample}", 0, tokens, [-0.25] * n, FinishReason.STOP, 0))
    assert out.request_finished


def _stored(core: BufferCore, batch_id: str, index: int) -> int:
    """The stored bytes of result `index`: what the page bound counts."""
    value = core._store.get(keys.result_key(batch_id, index))
    assert value is not None
    return len(value)


def _pages(core: BufferCore, batch_id: str, cursor: int = 0
           ) -> Iterator[tuple[int, list[tuple[int, RolloutResult]], bool]]:
    """(cursor, page, done) of each read_results call until done or an empty page."""
    while True:
        page, done = core.read_results(batch_id, cursor)
        yield cursor, page, done
        if done or not page:
            return
        cursor = page[-1][0] + 1


def _check_bounded(core: BufferCore, batch_id: str, cursor: int, page: list[tuple[int, RolloutResult]],
                   available: int) -> None:
    """The page is results [cursor, cursor+len) under the bound (or alone), and it stopped only when
    the next result would not fit (or the log ended): pages are as full as the bound allows."""
    assert [i for i, _r in page] == list(range(cursor, cursor + len(page)))
    sizes = [_stored(core, batch_id, i) for i, _r in page]
    assert sum(sizes) <= PAGE_BYTES or len(page) == 1, (cursor, sizes)
    end = cursor + len(page)
    if end < available:
        assert sum(sizes) + _stored(core, batch_id, end) > PAGE_BYTES, (cursor, sizes)


def test_pages_stay_under_the_byte_bound_and_deliver_every_result_once(tmp_path: Path) -> None:
    core = _core(tmp_path / "db")
    try:
        _submit(core, "big")
        half = len(ORDER) // 2
        for s in ORDER[:half]:
            _finish(core, "big", s)
        # While the batch runs: every result so far, bounded pages, never done (the last page of
        # what exists is followed by an empty one, not by the end of the stream).
        got: list[int] = []
        for cursor, page, done in _pages(core, "big"):
            assert not done
            _check_bounded(core, "big", cursor, page, half)
            got += [i for i, _r in page]
        assert got == list(range(half))
        for s in ORDER[half:]:
            _finish(core, "big", s)

        sizes = [_stored(core, "big", i) for i in range(len(ORDER))]
        assert max(sizes) > 2 * PAGE_BYTES and sum(sizes) > 6 * PAGE_BYTES  # the bound matters here
        pages = list(_pages(core, "big"))
        for cursor, page, _done in pages:
            _check_bounded(core, "big", cursor, page, len(ORDER))
        # Exactly once, in log order, and the log is the finishing order.
        results = [r for _c, page, _d in pages for _i, r in page]
        assert [r.request_id for r in results] == [f"big/0/{s}" for s in ORDER]
        assert [len(r.token_ids) for r in results] == [LENGTHS[s] for s in ORDER]
        # done on the last page only, and the last page is not empty (no extra round trip).
        assert [d for _c, _p, d in pages] == [False] * (len(pages) - 1) + [True]
        assert pages[-1][1]
        assert len(pages) > len(ORDER) // 3  # not one 256-result page as before
        oversized = [i for i, n in enumerate(sizes) if n > PAGE_BYTES]
        assert oversized and all(len(p) == 1 for _c, p, _d in pages if p[0][0] in oversized)

        # Resuming at any cursor gives exactly the rest, in order (cursor semantics unchanged).
        for start in (1, 3, 4, len(ORDER) - 1):
            rest = [i for _c, page, _d in _pages(core, "big", start) for i, _r in page]
            assert rest == list(range(start, len(ORDER)))
        assert core.read_results("big", len(ORDER)) == ([], True)
        assert [i for i, _r in core.iter_results("big", 2)] == list(range(2, len(ORDER)))
        # The count bound still holds, and an explicit byte bound wins over the core's.
        page, done = core.read_results("big", 0, limit=2, max_bytes=10**9)
        assert [i for i, _r in page] == [0, 1] and not done
        page, done = core.read_results("big", 0, max_bytes=1)
        assert [i for i, _r in page] == [0] and not done
    finally:
        core.close()


def test_a_cancelled_batch_ends_after_its_last_page(tmp_path: Path) -> None:
    core = _core(tmp_path / "db")
    try:
        _submit(core, "c")
        for s in ORDER[:6]:
            _finish(core, "c", s)
        core.cancel_batch("c")
        pages = list(_pages(core, "c"))
        assert [i for _c, page, _d in pages for i, _r in page] == list(range(6))
        assert [d for _c, _p, d in pages] == [False] * (len(pages) - 1) + [True] and len(pages) > 1
    finally:
        core.close()


def test_results_page_bytes_config() -> None:
    assert BufferConfig().results_page_bytes == DEFAULT_RESULTS_PAGE_BYTES == 4 * 1024 * 1024
    cfg = config.load(BufferConfig, "buffer", ["--results-page-bytes", "65536"], env={})
    assert cfg.results_page_bytes == 65536
    cfg = config.load(BufferConfig, "buffer", [], env={"SEER_BUFFER_RESULTS_PAGE_BYTES": "1000000"})
    assert cfg.results_page_bytes == 1_000_000
    for bad in (0, -1):
        with pytest.raises(ValueError, match="results_page_bytes: must be > 0"):
            BufferConfig(results_page_bytes=bad).validate()


# ---- through gRPC --------------------------------------------------------------------------------

GRPC_PAGE = 16_384  # results_page_bytes of the server: ~8 stored bytes a token plus the text
GRPC_LENGTHS = [300, 900, 100, 2_500, 600, 600, 600, 50, 1_200, 400, 2_000, 700, 3_000, 150]


def test_stream_results_in_byte_bounded_pages_resumes_from_the_middle(
        make_buffer: Callable[..., BufferHandle]) -> None:
    buf = make_buffer(results_page_bytes=GRPC_PAGE, max_context=4_096)
    # Spy on the pages the stream reads (the real core's, on the server's handler thread).
    pages: list[tuple[int, list[int], bool]] = []
    read = buf.core.read_results

    def spy(batch_id: str, cursor: int, *args: Any, **kw: Any) -> tuple[list[tuple[int, RolloutResult]], bool]:
        page, done = read(batch_id, cursor, *args, **kw)
        pages.append((cursor, [i for i, _r in page], done))
        return page, done

    buf.core.read_results = spy  # type: ignore[method-assign]
    n = len(GRPC_LENGTHS)
    submit(buf.rollout, "g", [group(group_size=n, max_tokens=max(GRPC_LENGTHS))])

    def finish(sample: int) -> None:
        rid = f"g/0/{sample}"
        commit(buf.internal, rid, 0, [token_for(rid, p) for p in range(GRPC_LENGTHS[sample])], STOP)

    first = n // 2
    for s in range(first):
        finish(s)
    # A reader takes some results, goes away in the middle of a page, and comes back at its cursor
    # while the rest of the batch finishes.
    stream = buf.rollout.StreamResults(rollout_pb2.StreamResultsRequest(batch_id="g"), timeout=30)
    got = [next(stream) for _ in range(3)]
    stream.cancel()
    resumed: list[Any] = []
    error: list[BaseException] = []

    def resume() -> None:
        try:
            resumed.extend(buf.rollout.StreamResults(
                rollout_pb2.StreamResultsRequest(batch_id="g", cursor=got[-1].cursor), timeout=30))
        except grpc.RpcError as e:
            error.append(e)

    reader = threading.Thread(target=resume, daemon=True)
    reader.start()
    for s in range(first, n):
        finish(s)
    reader.join(20)
    assert not reader.is_alive(), "the stream must end once the batch is complete and delivered"
    assert not error, error
    everything = got + resumed
    assert [r.cursor for r in everything] == list(range(1, n + 1))  # exactly once, in order
    assert [r.result.request_id for r in everything] == [f"g/0/{s}" for s in range(n)]
    assert all(list(r.result.token_ids) == [token_for(r.result.request_id, p)
                                            for p in range(GRPC_LENGTHS[int(r.result.request_id[4:])])]
               for r in everything)

    # Every page the server read was under the bound, or a single result.
    sizes = [len(buf.core._store.get(keys.result_key("g", i)) or b"") for i in range(n)]
    assert max(sizes) > GRPC_PAGE and sum(sizes) > 4 * GRPC_PAGE  # the bound matters here
    for _cursor, idx, _done in pages:
        assert sum(sizes[i] for i in idx) <= GRPC_PAGE or len(idx) == 1, (idx, [sizes[i] for i in idx])
    assert pages and pages[-1][2]
    assert sum(1 for _c, idx, _d in pages if len(idx) > 1) >= 2  # pages hold several small results

    # A stream of the finished batch from any cursor: exactly the rest, in order.
    for cursor in (0, 5, n - 1, n):
        rest = list(buf.rollout.StreamResults(rollout_pb2.StreamResultsRequest(batch_id="g", cursor=cursor),
                                              timeout=10))
        assert [r.cursor for r in rest] == list(range(cursor + 1, n + 1))


# ---- reads ---------------------------------------------------------------------------------------

class _CountingStore:
    """The core's store, counting the results-log values its scans hand out (each one a value read
    from RocksDB and copied)."""

    def __init__(self, inner: Store) -> None:
        self._inner = inner
        self.values_read = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def scan(self, prefix: bytes, start: bytes | None = None) -> Iterator[tuple[bytes, bytes]]:
        for k, v in self._inner.scan(prefix, start):
            if k.startswith(b"l/"):
                self.values_read += 1
            yield k, v

    def get_many(self, keys_: list[bytes]) -> list[bytes | None]:
        self.values_read += sum(k.startswith(b"l/") for k in keys_)
        return self._inner.get_many(keys_)

    def view(self) -> _CountingView:
        """read_results reads a page's values from a snapshot view (outside the core lock)."""
        return _CountingView(self, self._inner.view())


class _CountingView:
    def __init__(self, store: _CountingStore, inner: View) -> None:
        self._store, self._inner = store, inner

    def get_many(self, keys_: list[bytes]) -> list[bytes | None]:
        self._store.values_read += sum(k.startswith(b"l/") for k in keys_)
        return self._inner.get_many(keys_)

    def release(self) -> None:
        self._inner.release()


def test_a_page_reads_no_value_it_does_not_return(tmp_path: Path) -> None:
    """The page ends at the first result that does not fit by its stored size, without reading that
    result's value (it can be as large as a gRPC message). Before: every page that ended on the
    byte bound had read one value more than it returned."""
    core = _core(tmp_path / "db")
    try:
        _submit(core, "r")
        for s in ORDER:
            _finish(core, "r", s)
        counting = _CountingStore(core._store)
        core._store = counting  # type: ignore[assignment]
        pages = 0
        for cursor, page, _done in _pages(core, "r"):
            before = counting.values_read
            again, _ = core.read_results("r", cursor)
            assert counting.values_read - before == len(again) == len(page), (cursor, [i for i, _r in page])
            _check_bounded(core, "r", cursor, page, len(ORDER))
            pages += 1
        assert pages > 3
        # The count bound and the end of the log stop the page without an extra read too.
        before = counting.values_read
        assert len(core.read_results("r", 0, limit=2, max_bytes=10**9)[0]) == 2
        assert len(core.read_results("r", len(ORDER) - 2, max_bytes=10**9)[0]) == 2
        assert core.read_results("r", len(ORDER)) == ([], True)
        assert counting.values_read - before == 4
    finally:
        core.close()


def _bytes_read() -> int:
    """Bytes this process has read through read(2) and pread(2) so far (RocksDB's SST reads)."""
    with open("/proc/self/io", encoding="ascii") as f:
        for line in f:
            if line.startswith("rchar:"):
                return int(line.split()[1])
    raise AssertionError("no rchar in /proc/self/io")


@pytest.mark.skipif(not Path("/proc/self/io").exists(), reason="needs Linux /proc/self/io")
def test_a_page_ending_before_a_large_result_does_not_read_it_from_disk(tmp_path: Path) -> None:
    """Measured at the file reads, not at the values Python sees: a scan's iterator steps onto the
    entry after the last one it yields, so a page planned from the stored sizes but read by a scan
    still read the large value it left out (32 MB here) from disk (review, session 25)."""
    big = 4_000_000  # tokens: ~32 MB stored, random so that it does not compress
    core = BufferCore(Store(tmp_path / "db"), ModelInfo(vocab_size=1000, max_context=big + 10, tokenizer=None),
                      results_page_bytes=16_000)
    core.submit_batch("big", [GroupSpec(prompt_key="pk", prompt_token_ids=(1, 2), group_size=2, max_tokens=big,
                                        sampling=Sampling(seed=1))])
    import random
    rnd = random.Random(5)
    for s, n in ((0, 1_000), (1, big)):
        core.commit_chunk(Commit(f"big/0/{s}", 0, [rnd.randrange(1000) for _ in range(n)],
                                 [-rnd.random() * 5 - 0.01 for _ in range(n)], FinishReason.STOP, 0))
    core.close()  # flushed: the values are read from SST files, through read(2)
    core = BufferCore(Store(tmp_path / "db"), ModelInfo(vocab_size=1000, max_context=big + 10, tokenizer=None),
                      results_page_bytes=16_000)
    try:
        before = _bytes_read()
        page, done = core.read_results("big", 0)
        read = _bytes_read() - before
        assert [i for i, _r in page] == [0] and not done
        assert read < 1_000_000, f"{read} bytes read for a page of one ~8 KB result"
    finally:
        core.close()


def test_results_stored_without_sizes_still_page_by_bytes(tmp_path: Path) -> None:
    """A store written before result sizes were kept (no z/ keys, or only for its newer results):
    each value is read, then sized, as before."""
    core = _core(tmp_path / "db")
    try:
        _submit(core, "old")
        for s in ORDER:
            _finish(core, "old", s)
        wb = core._store.new_batch()
        for i in range(len(ORDER) // 2):  # the older half unsized, the newer half sized
            wb.delete(keys.result_size_key("old", i))
        core._store.write(wb)
        pages = list(_pages(core, "old"))
        for cursor, page, _done in pages:
            _check_bounded(core, "old", cursor, page, len(ORDER))
        assert [r.request_id for _c, p, _d in pages for _i, r in p] == [f"old/0/{s}" for s in ORDER]
        assert pages[-1][2]
    finally:
        core.close()
