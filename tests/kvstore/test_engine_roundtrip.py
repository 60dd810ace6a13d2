"""Migration of a request between two real engines through two real kvstore replicas: the chunk
that moves computes no prefill for the stored prefix and produces the same greedy tokens."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from services.worker.engine import GenerateRequest, SamplingParams
from services.worker.kv_client import KVClient
from tests.kvstore.kvhelpers import Replica

engine_mod = pytest.importorskip("services.worker.engines.reference.engine")

Make = Callable[..., Replica]
GREEDY = SamplingParams(temperature=0.0, ignore_eos=True)


@pytest.fixture
def one_torch_thread() -> Iterator[None]:
    """One torch thread is far faster on the shared, oversubscribed CI machine; the engine sets it
    process-wide, so put the old value back for other tests."""
    import torch

    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def test_chunk_moves_to_another_engine_without_reprefill(
    model_dir: Path, replicas: Make, one_torch_thread: None
) -> None:
    a_store, b_store = replicas("a", dram_bytes=64 << 20), replicas("b", dram_bytes=64 << 20)
    version = "smollm2@v1"
    worker_a = engine_mod.ReferenceEngine.from_dir(model_dir, num_pages=48, model_version=version, num_threads=1)
    worker_b = engine_mod.ReferenceEngine.from_dir(model_dir, num_pages=48, model_version=version, num_threads=1)
    prompt = tuple(range(1000, 1000 + 70))  # 4 full pages of 16 and a partial one
    # Reference: the request generated in one go on worker A.
    ref = worker_a.generate([GenerateRequest("ref", prompt, 12, GREEDY)])["ref"].token_ids
    assert len(ref) == 12
    with KVClient([a_store.address, b_store.address]) as kv:
        # Chunk 1 ran on A (its cache holds the pages); A offloads them at the chunk end.
        context = list(prompt) + ref[:6]
        pages = worker_a.export_kv(context)
        assert len(pages.pages) == len(context) // 16
        assert kv.offload_async(pages, "req-1").result(timeout=60).stored == len(pages.pages)
        assert a_store.store is not None and b_store.store is not None
        # Sharded by the ring: each replica holds exactly the pages the ring assigns it (with 4
        # pages and random ports, all may land on one replica; tests/kvstore/test_client.py covers
        # the spread).
        owner = [kv.ring.node_for(h) for h in pages.page_hashes]
        assert a_store.store.stats().pages == owner.count(a_store.address)
        assert b_store.store.stats().pages == owner.count(b_store.address)
        # Chunk 2 runs on B: fetch the prefix, import, resume.
        assert worker_b.cached_prefix_tokens(context) == 0
        fetched = kv.fetch_prefix(context, worker_b.model_version, worker_b.kv_layout)
        assert fetched is not None and fetched.pages == pages.pages
        assert worker_b.import_kv(fetched) == len(pages.pages) * 16
        before = worker_b.stats().prefill_tokens
        out = worker_b.generate([GenerateRequest("req-1", prompt, 6, GREEDY, output_token_ids=tuple(ref[:6]))])
        prefilled = worker_b.stats().prefill_tokens - before
        assert out["req-1"].token_ids == ref[6:]
        # Only the partial tail page is computed; the stored prefix is not re-prefilled.
        assert prefilled < 16, prefilled
        assert worker_b.stats().imported_tokens == len(pages.pages) * 16
        # Pages of this version are never served to an engine on the next version.
        assert kv.fetch_prefix(context, "smollm2@v2", worker_b.kv_layout) is None
        assert kv.release(version, "req-1") == len(pages.pages)


def test_continuation_offload_sends_only_new_pages(model_dir: Path, replicas: Make, one_torch_thread: None) -> None:
    """Chunk-end offloads with KVPages.first_page > 0 (only the pages earlier chunks did not offload)
    add up in the store to the whole prefix, which another engine fetches and resumes from."""
    r = replicas("a", dram_bytes=64 << 20)
    version = "smollm2@v1"
    worker_a = engine_mod.ReferenceEngine.from_dir(model_dir, num_pages=48, model_version=version, num_threads=1)
    worker_b = engine_mod.ReferenceEngine.from_dir(model_dir, num_pages=48, model_version=version, num_threads=1)
    prompt = tuple(range(3000, 3000 + 60))
    ref = worker_a.generate([GenerateRequest("ref", prompt, 10, GREEDY)])["ref"].token_ids
    with KVClient([r.address], streams_per_replica=2) as kv:
        chunk1 = list(prompt) + ref[:2]  # 62 tokens: 3 full pages
        first = worker_a.export_kv(chunk1)
        assert first.first_page == 0 and kv.put_pages(first, "req") == 3
        sent = kv.stats().put_bytes
        chunk2 = list(prompt) + ref[:6]  # 66 tokens: 4 full pages, only page 3 is new
        more = worker_a.export_kv(chunk2, start_page=first.end_page)
        assert more.first_page == 3 and len(more.pages) == 1
        assert kv.put_pages(more, "req") == 1
        assert kv.stats().put_bytes - sent == len(more.pages[0])  # only the new page's bytes
        fetched = kv.fetch_prefix(chunk2, version, worker_b.kv_layout)
        assert fetched is not None and fetched.first_page == 0
        assert fetched.pages == worker_a.export_kv(chunk2).pages
        assert worker_b.import_kv(fetched) == 64
        out = worker_b.generate([GenerateRequest("req", prompt, 4, GREEDY, output_token_ids=tuple(ref[:6]))])
        assert out["req"].token_ids == ref[6:10]
        # A third engine holding the first chunk's pages fetches only the rest and continues them.
        worker_c = engine_mod.ReferenceEngine.from_dir(model_dir, num_pages=48, model_version=version, num_threads=1)
        worker_c.import_kv(first)
        have = worker_c.cached_prefix_tokens(chunk2)
        assert have == 48
        rest = kv.fetch_prefix(chunk2, version, worker_c.kv_layout, min_tokens=have)
        assert rest is not None and rest.first_page == 3 and len(rest.pages) == 1
        assert worker_c.import_kv(rest) == 64  # the cached prefix it extends, in tokens
        out = worker_c.generate([GenerateRequest("req", prompt, 4, GREEDY, output_token_ids=tuple(ref[:6]))])
        assert out["req"].token_ids == ref[6:10]
        assert kv.release(version, "req") == 4
