"""Paged KV cache bookkeeping: page allocation, reference counts and prefix caching.

A page holds `page_size` consecutive tokens of one sequence. A full page whose KV is computed is
registered under its chained hash (services.common.pagehash: parent hash, model version, the page's
tokens), the same key the KV store uses, so identical prefixes (the G requests of a group, a request
resumed in a later chunk, pages imported from another worker) share pages instead of recomputing.
Pages with no users but a registered hash stay cached in an LRU and are evicted only when a free
page is needed. Only this module touches page ids; the KV tensors live in the model runner.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence as Seq

import numpy as np

from services.common.pagehash import chain_hashes, page_hash
from services.worker.engines.reference.sequence import Sequence


class BlockManager:
    def __init__(self, num_pages: int, page_size: int, model_version: str) -> None:
        self.num_pages = num_pages
        self.page_size = page_size
        self.model_version = model_version
        self.ref_count = [0] * num_pages
        self.page_hash: list[bytes | None] = [None] * num_pages
        self.hash_to_page: dict[bytes, int] = {}
        self.free: list[int] = list(range(num_pages - 1, -1, -1))  # pop() gives low ids first
        # Cached pages nobody uses, least recently used first (evicted from the front).
        self.lru: OrderedDict[int, None] = OrderedDict()

    # ---- capacity -------------------------------------------------------------------------
    @property
    def num_free(self) -> int:
        """Pages that can be handed out now (truly free + cached but unused)."""
        return len(self.free) + len(self.lru)

    @property
    def num_used(self) -> int:
        return self.num_pages - self.num_free

    def pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    # ---- prefix cache lookups ---------------------------------------------------------------
    def hashes(self, tokens: Seq[int]) -> list[bytes]:
        return chain_hashes(tokens, self.page_size, self.model_version)

    def cached_pages(self, hashes: Seq[bytes]) -> list[int]:
        """Pages of the longest cached prefix of `hashes`."""
        out: list[int] = []
        for h in hashes:
            p = self.hash_to_page.get(h)
            if p is None:
                break
            out.append(p)
        return out

    # ---- allocation -------------------------------------------------------------------------
    def _take(self) -> int:
        if self.free:
            return self.free.pop()
        page, _ = self.lru.popitem(last=False)  # evict the least recently used cached page
        h = self.page_hash[page]
        if h is not None and self.hash_to_page.get(h) == page:
            del self.hash_to_page[h]
        self.page_hash[page] = None
        return page

    def _acquire(self, page: int) -> None:
        if self.ref_count[page] == 0:
            self.lru.pop(page, None)
        self.ref_count[page] += 1

    def plan(self, seq: Sequence) -> tuple[list[bytes], int, int]:
        """(hashes of the full pages, cached pages usable, new pages needed) for admitting seq.

        At most (len - 1) // page_size pages are taken from the cache: the last token is always
        computed because its logits are needed."""
        hashes = self.hashes(seq.token_ids)
        usable = min(len(self.cached_pages(hashes)), (len(seq) - 1) // self.page_size)
        need = self.pages_for(seq.capacity) - usable
        return hashes, usable, need

    def can_allocate(self, seq: Sequence) -> bool:
        _, usable, need = self.plan(seq)
        # Cached pages about to be reused may themselves sit in the LRU: they do not count as free.
        hashes = self.hashes(seq.token_ids)[:usable]
        in_lru = sum(1 for h in hashes if self.ref_count[self.hash_to_page[h]] == 0)
        return need <= self.num_free - in_lru

    def allocate(self, seq: Sequence) -> None:
        """Gives seq its pages for the whole call: cached prefix pages first, then new pages.

        Full pages of the prefix that will be computed in this step are registered right away, so
        a sibling admitted in the same step (same prompt) shares them: within each layer the model
        writes all new KV before any attention reads it."""
        hashes, usable, need = self.plan(seq)
        table: list[int] = []
        for h in hashes[:usable]:
            p = self.hash_to_page[h]
            self._acquire(p)
            table.append(p)
        for _ in range(need):
            p = self._take()
            self.ref_count[p] = 1
            table.append(p)
        seq.block_table = table
        seq.block_array = np.asarray(table, dtype=np.int64)
        seq.num_computed = usable * self.page_size
        seq.num_cached_at_admit = seq.num_computed
        seq.page_hashes = list(hashes[:usable])
        # Full prefix pages computed in this step (every token of the prefix is fed).
        self._register(seq, len(hashes), hashes)

    def _register(self, seq: Sequence, upto_pages: int, hashes: Seq[bytes] | None = None) -> None:
        """Registers the hashes of seq's full pages [len(seq.page_hashes), upto_pages)."""
        while len(seq.page_hashes) < upto_pages:
            i = len(seq.page_hashes)
            if hashes is not None and i < len(hashes):
                h = hashes[i]
            else:
                parent = seq.page_hashes[-1] if seq.page_hashes else None
                h = page_hash(parent, seq.token_ids[i * self.page_size : (i + 1) * self.page_size], self.model_version)
            seq.page_hashes.append(h)
            page = seq.block_table[i]
            if h not in self.hash_to_page and self.page_hash[page] is None:
                self.hash_to_page[h] = page
                self.page_hash[page] = h

    def on_computed(self, seq: Sequence) -> None:
        """Registers pages that became full of computed KV after a step."""
        self._register(seq, seq.num_computed // self.page_size)

    def free_seq(self, seq: Sequence) -> None:
        self.release(seq.block_table)
        seq.block_table = []
        seq.block_array = np.zeros(0, dtype=np.int64)

    def release(self, pages: Seq[int]) -> None:
        """Drops one reference to each page (of a chain, in chain order)."""
        # Tail pages first into the LRU so they are evicted first: a cached chain is only usable
        # from its first page, so evicting page 0 first would strand the rest of the chain.
        for p in reversed(pages):
            self.ref_count[p] -= 1
            if self.ref_count[p] == 0:
                h = self.page_hash[p]
                if h is not None and self.hash_to_page.get(h) == p:
                    self.lru[p] = None  # stays cached until evicted
                else:
                    self.page_hash[p] = None
                    self.free.append(p)

    def unallocate(self, seq: Sequence) -> None:
        """Undoes allocate() for a sequence whose first step failed before its KV was written.

        The pages allocate() registered for the prefix to be computed hold no KV (the forward pass
        that would have filled them did not complete), so their hashes are dropped before the pages
        are freed: a later request must never reuse them as cached. Pages seq reused from the cache
        were computed earlier and stay cached. Siblings admitted in the same step that share these
        pages must be unallocated too (they counted them as cached)."""
        first_new = seq.num_cached_at_admit // self.page_size
        for i in range(first_new, min(len(seq.page_hashes), len(seq.block_table))):
            h, p = seq.page_hashes[i], seq.block_table[i]
            if self.hash_to_page.get(h) == p:
                del self.hash_to_page[h]
                self.page_hash[p] = None
        self.free_seq(seq)
        seq.page_hashes = []
        seq.num_computed = 0
        seq.num_cached_at_admit = 0

    # ---- import -------------------------------------------------------------------------------
    def insert_cached(self, h: bytes) -> int | None:
        """A free page registered under h (ref count 0, in the LRU), or None when none is free."""
        if h in self.hash_to_page:
            return self.hash_to_page[h]
        if self.num_free == 0:
            return None
        p = self._take()
        self.page_hash[p] = h
        self.hash_to_page[h] = p
        self.lru[p] = None
        return p

    def drop_cached(self, page: int) -> None:
        """Unregisters an unused cached page (its KV is not valid) and frees it."""
        if self.ref_count[page] != 0:
            raise RuntimeError(f"drop_cached: page {page} is in use")
        h = self.page_hash[page]
        if h is not None and self.hash_to_page.get(h) == page:
            del self.hash_to_page[h]
        self.page_hash[page] = None
        if page in self.lru:
            del self.lru[page]
            self.free.append(page)

    def touch(self, page: int) -> None:
        if page in self.lru:
            self.lru.move_to_end(page)

    def pin(self, pages: Seq[int]) -> None:
        """Takes a reference to each page so no allocation evicts it (undo with release)."""
        for p in pages:
            self._acquire(p)

    def reset(self, model_version: str) -> None:
        """Drops every cached page (weights changed); only valid with no live sequences."""
        if any(self.ref_count):
            raise RuntimeError("reset: pages are still in use")
        self.__init__(self.num_pages, self.page_size, model_version)  # type: ignore[misc]
