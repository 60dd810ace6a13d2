"""export_kv(token_ids, start_page) hands over only the pages from start_page on (and reads only
their bytes); import_kv takes such a continuation when the engine already holds the pages before it
(issue 6: a request's pages go to the KV pool once, not after every chunk)."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest
from tokenizers import Tokenizer

from services.worker.engine import GenerateRequest, KVPages, SamplingParams
from services.worker.engines.reference import ReferenceEngine

from .conftest import chat
from .device import DEVICE

GREEDY = SamplingParams(temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def other(model_dir: Path) -> Iterator[ReferenceEngine]:
    eng = ReferenceEngine.from_dir(model_dir, device=DEVICE, num_pages=128, max_batch_size=4, num_threads=1)
    yield eng
    assert not eng.has_unfinished()


_FILLER = " Answer in full sentences, mention at least three details, and keep a calm, friendly tone."


def _context(engine: ReferenceEngine, tok: Tokenizer, text: str, rid: str, n: int = 2) -> tuple[int, ...]:
    """A prompt no other test uses (> 4 pages), run for n tokens: its pages are in engine's cache."""
    p = chat(tok, text + _FILLER * 4)
    out = engine.generate([GenerateRequest(rid, p, n, GREEDY)])[rid]
    return p + tuple(out.token_ids)


def test_export_from_start_page_reads_only_new_pages(engine: ReferenceEngine, tokenizer: Tokenizer,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    ctx = _context(engine, tokenizer, "Export test: explain in detail why the sky looks blue at noon.", "exp-a")
    full = engine.export_kv(ctx)
    n = len(full.pages)
    assert n >= 4 and full.first_page == 0 and full.end_page == n
    assert len(full.token_ids) == n * 16

    read: list[int] = []
    real_read = engine.runner.read_pages

    def counting_read(pages: list[int]) -> list[memoryview]:
        read.append(len(pages))
        return real_read(pages)

    monkeypatch.setattr(engine.runner, "read_pages", counting_read)
    tail = engine.export_kv(ctx, 2)
    assert read == [n - 2]  # the bytes of pages [0, 2) are not even read
    assert tail.first_page == 2 and tail.end_page == n
    assert tail.token_ids == full.token_ids  # from token 0: the importer recomputes the chain
    assert tail.page_hashes == full.page_hashes[2:] and tail.pages == full.pages[2:]

    past = engine.export_kv(ctx, n + 5)  # everything already offloaded
    assert past.pages == () and past.page_hashes == () and past.first_page == n == past.end_page
    assert read == [n - 2, 0]
    with pytest.raises(ValueError, match="start_page"):
        engine.export_kv(ctx, -1)


def test_import_continuation_needs_the_pages_before_it(engine: ReferenceEngine, other: ReferenceEngine,
                                                       tokenizer: Tokenizer) -> None:
    ctx = _context(engine, tokenizer, "Import test: list the planets of the solar system with one fact each.",
                   "imp-a")
    full = engine.export_kv(ctx)
    n = len(full.pages)
    assert n >= 4
    head = KVPages(full.model_version, full.layout, full.token_ids[:32], full.page_hashes[:2], full.pages[:2])
    tail = engine.export_kv(ctx, 2)
    assert other.cached_prefix_tokens(ctx) == 0

    # Without pages [0, 2) the continuation could never be reached: rejected, nothing imported.
    free = other.stats().free_pages
    with pytest.raises(ValueError, match="first_page"):
        other.import_kv(tail)
    assert other.cached_prefix_tokens(ctx) == 0 and other.stats().free_pages == free
    # Malformed continuations name the field.
    with pytest.raises(ValueError, match="token_ids"):
        other.import_kv(replace(tail, token_ids=tail.token_ids[:-16]))
    with pytest.raises(ValueError, match=r"page_hashes\[0\]"):
        other.import_kv(replace(tail, page_hashes=(full.page_hashes[0], *tail.page_hashes[1:])))
    with pytest.raises(ValueError, match="first_page"):
        other.import_kv(replace(tail, first_page=-1))

    imported = other.stats().imported_tokens
    assert other.import_kv(head) == 32
    assert other.import_kv(tail) == n * 16  # the whole chain is now cached
    assert other.stats().imported_tokens - imported == n * 16
    assert other.import_kv(tail) == n * 16  # idempotent

    # The continuation is real KV: resuming from it computes only the uncached tail and generates
    # what the exporting engine generates.
    req = GenerateRequest("imp-b", ctx, 8, GREEDY)
    before = other.stats().prefill_tokens
    got = other.generate([req])["imp-b"].token_ids
    assert other.stats().prefill_tokens - before == len(ctx) - n * 16
    assert got == engine.generate([replace(req, request_id="imp-c")])["imp-c"].token_ids


def test_import_continuation_into_a_full_cache_keeps_its_chain(model_dir: Path, engine: ReferenceEngine,
                                                               tokenizer: Tokenizer) -> None:
    """Importing evicts unused cached pages; the chain's own head must not be among them."""
    ctx = _context(engine, tokenizer, "Eviction test: describe a quiet morning in a small harbour town.", "ev-a")
    full = engine.export_kv(ctx)
    n = len(full.pages)
    small = ReferenceEngine.from_dir(model_dir, device=DEVICE, num_pages=n, max_batch_size=1, num_threads=1)
    head = KVPages(full.model_version, full.layout, full.token_ids[:16], full.page_hashes[:1], full.pages[:1])
    assert small.import_kv(head) == 16
    # Fill the rest of the cache with an unrelated chain: every page is now cached and unused, the
    # head the least recently used, so the continuation can only go in by evicting.
    ctx2 = _context(engine, tokenizer, "Filler test: tell me about the history of paper making.", "ev-b")
    other = engine.export_kv(ctx2)
    assert len(other.pages) >= n - 1
    filler = KVPages(other.model_version, other.layout, other.token_ids[: (n - 1) * 16],
                     other.page_hashes[: n - 1], other.pages[: n - 1])
    assert small.import_kv(filler) == (n - 1) * 16
    assert small.stats().free_pages == n  # all unused (cached), none truly free
    assert small.import_kv(engine.export_kv(ctx, 1)) == n * 16
    assert small.cached_prefix_tokens(ctx) == n * 16
    assert small.cached_prefix_tokens(ctx2) == 0  # the filler was evicted instead


def test_an_exported_chain_loses_its_tail_first_under_eviction(model_dir: Path) -> None:
    """release() queues a finished chain's pages tail first, so eviction takes the tail and the
    prefix stays usable; export_kv (the worker's offload after every chunk) touched them head
    first, making page 0 the least recent: one eviction stranded the whole chain (found by review)."""
    ps = 4

    def cached_after_one_eviction(export: bool) -> int:
        eng = ReferenceEngine.from_dir(model_dir, device=DEVICE, num_pages=8, page_size=ps, num_threads=1)
        prompt = tuple(range(100, 112))  # 3 pages
        toks = prompt + tuple(eng.generate([GenerateRequest("a", prompt, 4, GREEDY)])["a"].token_ids)
        if export:
            eng.export_kv(toks)
        free = len(eng.blocks.free)
        other = (5000,) * (free * ps - 1)  # with 2 new tokens: every free page and one cached page
        assert eng.blocks.pages_for(len(other) + 2) == free + 1
        eng.generate([GenerateRequest("b", other, 2, GREEDY)])
        return eng.cached_prefix_tokens(toks)

    assert cached_after_one_eviction(False) == 2 * ps
    assert cached_after_one_eviction(True) == 2 * ps
