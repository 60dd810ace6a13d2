"""A request moves between workers through the real KV store: the second chunk runs on another
engine, loads the prefix pages the first worker offloaded instead of re-prefilling them, and
generates exactly what one uninterrupted run would (greedy)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest

from services.common.server import RunningServer
from services.kvstore.config import KvStoreConfig
from services.kvstore.server import serve
from services.worker.core import ChunkFinish, ChunkJob, Worker
from services.worker.engine import SamplingParams
from services.worker.engines.reference.engine import ReferenceEngine
from services.worker.kv_client import KVClient


@dataclass
class Pool:
    """Two workers on two engines sharing one real KV store."""

    wa: Worker
    wb: Worker
    other: ReferenceEngine  # wb's engine
    kv_a: KVClient
    kv_b: KVClient
    running: RunningServer

    def close(self) -> None:
        self.wa.close()
        self.wb.close()
        self.running.stop(1.0)


@pytest.fixture
def pool(ref_engine: ReferenceEngine, model_dir: Path, tmp_path: Path) -> Pool:
    running, _store = serve(KvStoreConfig(port=0, data_dir=str(tmp_path / "kv"), dram_bytes=64 << 20,
                                          ssd_bytes=256 << 20, grace_seconds=1.0))
    other = ReferenceEngine.from_dir(model_dir, num_pages=256, max_batch_size=4)
    kv_a, kv_b = KVClient([running.address]), KVClient([running.address])
    wa = Worker(ref_engine, worker_id="a", kv_pool=kv_a, speculation=False).start()
    wb = Worker(other, worker_id="b", kv_pool=kv_b, speculation=False).start()
    return Pool(wa, wb, other, kv_a, kv_b, running)


def test_chunk_moves_with_kv_from_the_pool(pool: Pool, prompts: list[tuple[int, ...]]) -> None:
    wa, wb, other, kv_a, kv_b = pool.wa, pool.wb, pool.other, pool.kv_a, pool.kv_b
    prompt = prompts[2] + prompts[0]  # > 2 pages of 16 tokens
    greedy = SamplingParams(temperature=0.0)

    def job(rid: str, **kw: object) -> ChunkJob:
        base: dict[str, object] = dict(request_id=rid, prompt_token_ids=prompt, max_new_tokens=20, max_tokens=20,
                                       sampling=greedy, policy_version=0, group_id="g", fetch_kv=True)
        base.update(kw)
        return ChunkJob(**base)  # type: ignore[arg-type]

    try:
        whole, _, _ = wa.run(job("whole", fetch_kv=False, sampling=SamplingParams(temperature=0.0, ignore_eos=True)))
        first, _, d1 = wa.run(job("moved", max_new_tokens=10,
                                  sampling=SamplingParams(temperature=0.0, ignore_eos=True)))
        assert d1.finish == ChunkFinish.CHUNK
        wa.wait_offloads()
        assert kv_a.stats().put_pages >= len(prompt) // 16
        second, _, d2 = wb.run(job("moved", output_token_ids=tuple(first), seq=1, max_new_tokens=10,
                                   sampling=SamplingParams(temperature=0.0, ignore_eos=True)))
        assert first + second == whole
        assert d2.finish == ChunkFinish.LENGTH
        prefix = len(prompt) + len(first)
        assert d2.stats.kv_loaded_tokens >= (prefix - 1) // 16 * 16 - 16
        assert d2.stats.kv_loaded_tokens > 0 and d2.stats.cached_tokens == d2.stats.kv_loaded_tokens
        assert d2.stats.prefill_tokens == prefix - d2.stats.cached_tokens
        assert other.stats().imported_tokens == d2.stats.kv_loaded_tokens
        assert wb.stats().kv_loaded_tokens == d2.stats.kv_loaded_tokens
        # A third, unrelated request finds nothing in the pool and recomputes its pages.
        _, _, d3 = wb.run(job("fresh", prompt_token_ids=prompts[1], max_new_tokens=2, max_tokens=2))
        assert d3.stats.kv_loaded_tokens == 0
    finally:
        pool.close()
    # The finished request released its pages (asynchronously, before close returned).
    assert kv_b.stats().released_pages > 0


def test_continuation_refetched_when_its_base_pages_were_evicted(pool: Pool, prompts: list[tuple[int, ...]]) -> None:
    """Worker b caches the prompt's pages, so its fetch asks the pool only for the pages after them
    (a continuation). If b's engine evicts those cached pages before the import (other requests
    needed the space), the continuation cannot attach: the worker fetches again from what is
    cached now instead of recomputing the whole prefix."""
    wa, wb, other = pool.wa, pool.wb, pool.other
    prompt = prompts[2] + prompts[0]
    greedy = SamplingParams(temperature=0.0, ignore_eos=True)

    def job(rid: str, **kw: object) -> ChunkJob:
        base: dict[str, object] = dict(request_id=rid, prompt_token_ids=prompt, max_new_tokens=40, max_tokens=80,
                                       sampling=greedy, policy_version=0, group_id="g", fetch_kv=True)
        base.update(kw)
        return ChunkJob(**base)  # type: ignore[arg-type]

    fetches: list[int] = []
    fetch = wb._fetch_kv

    def fetch_then_evict(prefix: tuple[int, ...], admission: object) -> object:
        got = fetch(prefix, admission)  # type: ignore[arg-type]
        fetches.append(got.first_page if got is not None else -1)
        if len(fetches) == 1:
            with wb._locked():  # every cached page is unused here: drop them all
                for page in list(other.blocks.lru):
                    other.blocks.drop_cached(page)
        return got

    try:
        first, _, _ = wa.run(job("moved"))
        wa.wait_offloads()
        # b holds the prompt's pages (a sibling ran there), not the 40 generated tokens.
        wb.run(job("sibling", max_new_tokens=1, max_tokens=1, fetch_kv=False))
        wb._fetch_kv = fetch_then_evict  # type: ignore[method-assign,assignment]
        second, _, done = wb.run(job("moved", output_token_ids=tuple(first), seq=1))
        prefix = len(prompt) + len(first)
        assert fetches[0] > 0, "the first fetch must be a continuation of b's cached pages"
        assert fetches[1:] == [0], "the second fetch starts from page 0: nothing is cached any more"
        assert wb.stats().kv_refetches == 1
        assert done.stats.kv_loaded_tokens >= (prefix - 1) // 16 * 16 - 16
        assert done.stats.prefill_tokens == prefix - done.stats.cached_tokens <= 32
        whole, _, _ = wa.run(job("whole", max_new_tokens=80, fetch_kv=False))
        assert first + second == whole
    finally:
        pool.close()


def test_a_moved_request_claims_the_sibling_pages_it_fetched(pool: Pool, prompts: list[tuple[int, ...]]) -> None:
    """A resumed request whose own offload was dropped fetches its sibling's prompt pages on the
    next worker. It must become an owner of them: otherwise the sibling's Release drops the prefix
    under it and every later move of the request recomputes it."""
    wa, wb, other, kv_a, kv_b = pool.wa, pool.wb, pool.other, pool.kv_a, pool.kv_b
    prompt = prompts[2] + prompts[0]  # > 2 pages of 16 tokens
    greedy = SamplingParams(temperature=0.0)

    def job(rid: str, **kw: object) -> ChunkJob:
        base: dict[str, object] = dict(request_id=rid, prompt_token_ids=prompt, max_new_tokens=4, max_tokens=40,
                                       sampling=greedy, policy_version=0, group_id="g", fetch_kv=True)
        base.update(kw)
        return ChunkJob(**base)  # type: ignore[arg-type]

    try:
        wa.run(job("sibling", fetch_kv=False))  # a CHUNK end: its prompt pages are offloaded
        wa.wait_offloads()
        kv_a.max_pending_offloads, kv_a._pending = 1, 1  # the moved request's own offload is dropped
        first, _, _ = wa.run(job("moved", fetch_kv=False))
        kv_a._pending = 0
        assert kv_a.stats().offloads_dropped == 1
        wb.run(job("moved", output_token_ids=tuple(first), seq=1))
        wb.wait_offloads()
        version, layout = other.model_version, other.kv_layout
        assert kv_b.fetch_prefix(prompt, version, layout) is not None
        kv_a.release(version, "sibling")
        got = kv_b.fetch_prefix(prompt + tuple(first), version, layout)
        assert got is not None and got.end_page >= len(prompt) // 16, "the moved request's prefix went with its sibling"
    finally:
        pool.close()
