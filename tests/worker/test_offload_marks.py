"""Glue tests (fake engine, fake pool) of the worker's per-request offload watermark: after each
chunk only the pages the pool lacks are exported; a resumed request starts from the pages it fetched;
a first chunk still claims its siblings' prompt pages; an offload that did not land is redone."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from worker_fake_engine import FakeEngine, FakePool

from services.worker.core import ChunkFinish, ChunkJob, Worker
from services.worker.engine import SamplingParams

PROMPT = tuple(range(1, 11))  # 10 tokens; the fake engine's pages hold 4


def job(rid: str = "r0", output: Sequence[int] = (), seq: int = 0, **kw: Any) -> ChunkJob:
    base: dict[str, Any] = dict(request_id=rid, prompt_token_ids=PROMPT, output_token_ids=tuple(output),
                                max_new_tokens=8, max_tokens=40, sampling=SamplingParams(temperature=0.0),
                                policy_version=0, group_id="g0", seq=seq, fetch_kv=True)
    base.update(kw)
    return ChunkJob(**base)

    def close(self) -> None:
        pass


def _chunks(w: Worker, rid: str, n: int, start: Sequence[int] = ()) -> list[int]:
    out = list(start)
    for i in range(n):
        toks, _, done = w.run(job(rid, out, seq=i))
        assert done.finish == ChunkFinish.CHUNK
        out += toks
    return out


def test_each_chunk_exports_only_new_pages() -> None:
    eng, pool = FakeEngine(), FakePool()
    w = Worker(eng, kv_pool=pool, speculation=False).start()
    try:
        out = _chunks(w, "r0", 3)
        # Prefix after chunk k: 10 + 8k tokens, 8k + 9 of them computed: pages [0, 4), [4, 6), [6, 8).
        assert eng.exports == [(0, 4), (4, 6), (6, 8)]
        assert pool.sent == [("r0", 0, 4), ("r0", 4, 6), ("r0", 6, 8)]
        assert w.offloaded_pages("r0") == 8
        _, _, done = w.run(job("r0", out, seq=3, max_tokens=len(out) + 8))
        assert done.finish == ChunkFinish.LENGTH
        assert w.offloaded_pages("r0") == 0  # finished: forgotten (its pages are released)
    finally:
        w.close()


def test_resumed_request_starts_from_fetched_pages_first_chunk_from_zero() -> None:
    pool = FakePool()
    e1, e2, e3 = FakeEngine(), FakeEngine(), FakeEngine()
    w1 = Worker(e1, kv_pool=pool, speculation=False).start()
    w2 = Worker(e2, kv_pool=pool, speculation=False).start()
    w3 = Worker(e3, kv_pool=pool, speculation=False).start()
    try:
        out = _chunks(w1, "r0", 1)  # pages [0, 4) stored, by r0
        # r0 moves to w2: it fetches pages [0, 4) and offloads only what comes after them.
        _, _, done = w2.run(job("r0", out, seq=1))
        assert done.finish == ChunkFinish.CHUNK and done.stats.kv_loaded_tokens == 16
        assert e2.exports == [(4, 6)] and pool.sent[-1] == ("r0", 4, 6)
        # A sibling's first chunk on w3 fetches the shared prompt pages; it must still claim them
        # as an owner (the store drops a page with its last owner), so it exports from page 0.
        _, _, done = w3.run(job("r1"))
        assert done.finish == ChunkFinish.CHUNK and done.stats.kv_loaded_tokens == 8
        assert e3.exports == [(0, 4)] and pool.sent[-1] == ("r1", 0, 4)
    finally:
        w1.close()
        w2.close()
        w3.close()


def test_offload_that_did_not_land_is_redone() -> None:
    eng, pool = FakeEngine(), FakePool()
    w = Worker(eng, kv_pool=pool, speculation=False).start()
    try:
        out = _chunks(w, "r0", 1)
        pool.fail_next = True
        out = _chunks(w, "r0", 1, out)  # pages [4, 6) fail
        w.wait_offloads()
        assert w.offloaded_pages("r0") == 4
        pool.drop_next = True
        out = _chunks(w, "r0", 1, out)  # pages [4, 8): dropped by a full queue
        w.wait_offloads()
        assert w.offloaded_pages("r0") == 4
        _chunks(w, "r0", 1, out)
        assert eng.exports == [(0, 4), (4, 6), (4, 8), (4, 10)]
        assert pool.sent == [("r0", 0, 4), ("r0", 4, 10)]
        assert w.offloaded_pages("r0") == 10
    finally:
        w.close()


def test_partial_offload_resends_from_the_first_missing_page() -> None:
    """A replica down during one offload stores only part of it: the watermark must stop at the
    first missing page (not at the end), so the next chunk resends from there and the pool ends up
    with a prefix without gaps."""
    eng, pool = FakeEngine(), FakePool()
    w = Worker(eng, kv_pool=pool, speculation=False).start()
    try:
        out = _chunks(w, "r0", 1)  # pages [0, 4)
        pool.partial_next = 1
        out = _chunks(w, "r0", 1, out)  # pages [4, 6) sent; only page 4 stored
        w.wait_offloads()
        assert w.offloaded_pages("r0") == 5
        _chunks(w, "r0", 1, out)
        w.wait_offloads()
        assert eng.exports[-1] == (5, 8) and pool.sent[-1] == ("r0", 5, 8)
        assert w.offloaded_pages("r0") == 8
    finally:
        w.close()


def test_a_later_offload_does_not_jump_over_a_gap() -> None:
    """Offload B (pages from 10) is marked, then an earlier offload A fails and unmarks to page 3:
    B's completion must not move the mark past the gap [3, 10) (it would never be resent)."""
    w = Worker(FakeEngine(), kv_pool=FakePool(), speculation=False)
    w._mark_offloaded("r", "v", 10, 0)  # A: pages [0, 10)
    w._mark_offloaded("r", "v", 20, 10)  # B: pages [10, 20)
    w._lower_offloaded("r", 3, "v")  # A failed from page 3
    assert w._offloaded["r"] == ("v", 3)
    w._mark_offloaded("r", "v", 30, 20)  # C: pages [20, 30) while the gap is open
    assert w._offloaded["r"] == ("v", 3)
    w._mark_offloaded("r", "v", 30, 3)  # the resend from the gap
    assert w._offloaded["r"] == ("v", 30)
