"""Regressions of the session-32 kvstore mends, on real RocksDB in tmp dirs (real gRPC for the server's
answer, a real SIGKILL of a child process for the crash):

1. A page larger than the SSD page budget (a --ssd-bytes too small for the model) emptied the SSD
   tier: written (a Put with no room in DRAM, or a demotion), it evicted every less recently used page,
   then itself. Now a Put of such a page that does not fit DRAM is refused (RESOURCE_EXHAUSTED naming
   data) before anything is created, stored or evicted; one that fits DRAM is stored there (session
   32 refused it too, so a store run on DRAM refused the whole model), and its demotion evicts that
   page alone, warned once per namespace; a restart with a budget below recovered pages evicts those
   pages alone.
2. An old version whose drop failed survived a restart: a Put creating m@v2 drops m@v1, and when
   RocksDB refused v1's tombstone record (or the process stopped before it), v1 stayed live, and only
   the next version created in the family would drop it: after a restart nothing did, and its pages
   held SSD budget until LRU evicted them. Now recovery replays each family's creations and drops what
   was due, and a running store retries the drop at a later Put: 1 s after the failure, each failed
   retry doubling the wait up to 30 s, warned and counted once (session 32 retried, warned with a
   traceback and counted at every Put: a full disk made each Put write a tombstone).
3. keep_versions lowered between runs left versions created in descending order (m@v3, m@v2, m@v1)
   all live: the open drops a numbered version with keep_versions versions above it holding pages.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import pytest
from seer.v1 import kvstore_pb2, kvstore_pb2_grpc

from services.common.errors import FailedPrecondition, ResourceExhausted
from services.common.kvlayout import KVLayout
from services.common.pagehash import chain_hashes
from services.kvstore.checksum import page_checksum
from services.kvstore.ssd import MIN_WAL_BYTES, SsdTier
from services.kvstore.store import KvStore
from services.worker.kv_client import layout_to_pb
from tests.kvstore.kvhelpers import LAYOUT, PAGE_BYTES, Replica
from tests.kvstore.test_review28 import _run_killed

Open = Callable[..., KvStore]

# 16 small pages' worth (8 KiB): more than the 8-page SSD budgets below.
BIG = KVLayout(dtype="float32", page_size=4, num_layers=32, num_kv_heads=1, head_dim=8)
BUDGET = 8 * PAGE_BYTES


def _h(namespace: str, i: int) -> bytes:
    return chain_hashes([i] * 4, 4, namespace)[0]


def _put(store: KvStore, namespace: str, i: int, layout: KVLayout = LAYOUT, owner: str = "r") -> None:
    data = os.urandom(layout.page_bytes)
    store.put(namespace, layout, _h(namespace, i), data, page_checksum(data), owner)


def _readable(store: KvStore, namespace: str, n: int) -> int:
    return sum(store.get_page(namespace, _h(namespace, i)) is not None for i in range(n))


# ---------------------------------------------------------------- item 1: a page over the SSD budget
def test_a_page_larger_than_the_ssd_budget_and_dram_is_refused_and_evicts_nothing(open_store: Open) -> None:
    """Six pages stored on SSD (no DRAM tier), then a page of 16 pages' size into an 8-page SSD budget.
    Before session 32 it was written, evicted all six and then itself (Put answered True, the tier
    empty)."""
    store = open_store(dram_bytes=0, ssd_bytes=BUDGET)
    for i in range(6):
        _put(store, "m@v1", i)
    before = store.stats()
    with pytest.raises(ResourceExhausted) as err:
        _put(store, "big@v1", 0, BIG)
    assert err.value.field == "data" and str(BUDGET) in str(err.value), err.value
    s = store.stats()
    assert s.evictions == 0 and s.ssd_pages == before.ssd_pages and s.dram_pages == before.dram_pages, s
    assert s.namespaces == 1 and store.namespace_layout("big@v1") is None  # nothing created
    assert _readable(store, "m@v1", 6) == 6


def test_a_page_larger_than_the_ssd_budget_that_fits_dram_is_stored_there(open_store: Open) -> None:
    """The same page with a DRAM tier: stored and served from DRAM, nothing evicted (a store run on
    DRAM with --ssd-bytes just above the WAL cap). Session 32 refused it: such a store refused every
    Put of the model (the reviewer's probe: 32 Puts, 32 refused)."""
    store = open_store(dram_bytes=64 * PAGE_BYTES, ssd_bytes=BUDGET)
    for i in range(6):
        _put(store, "m@v1", i)
    _put(store, "big@v1", 0, BIG)
    s = store.stats()
    assert s.evictions == 0 and s.dram_pages == 7 and s.namespaces == 2, s
    assert store.get_page("big@v1", _h("big@v1", 0)) is not None
    assert _readable(store, "m@v1", 6) == 6


def test_demotions_of_pages_over_the_ssd_budget_evict_them_alone_and_warn_once(
        open_store: Open, caplog: pytest.LogCaptureFixture) -> None:
    """DRAM holds two big pages; five are put, so three leave DRAM: each is evicted alone (the small
    pages demoted before stay on SSD), with one warning for the namespace and no traceback."""
    store = open_store(dram_bytes=2 * 16 * PAGE_BYTES + 4 * PAGE_BYTES, ssd_bytes=BUDGET)
    for i in range(8):
        _put(store, "m@v1", i)  # the last 4 pushed to SSD by the big pages below
    with caplog.at_level(logging.DEBUG, logger="services.kvstore.store"):
        for i in range(5):
            _put(store, "big@v1", i, BIG)
    records = list(caplog.records)
    s = store.stats()
    assert s.evictions == 3 and s.ssd_pages == 8 and s.demotions == 8, s
    assert [store.get_page("big@v1", _h("big@v1", i)) is not None for i in range(5)] == [False] * 3 + [True] * 2
    assert _readable(store, "m@v1", 8) == 8
    warned = [r for r in records if r.levelno >= logging.WARNING]
    assert len(warned) == 1 and warned[0].exc_info is None and "larger than the SSD" in warned[0].getMessage(), \
        [r.getMessage() for r in warned]
    assert sum("larger than the SSD" in r.getMessage() for r in records if r.levelno == logging.DEBUG) == 2


def test_the_server_answers_resource_exhausted_naming_the_data(replicas: Callable[..., Replica]) -> None:
    """Through gRPC, the page budget being --ssd-bytes less the WAL cap: RESOURCE_EXHAUSTED naming
    requests[0].data (the client degrades it to a failed offload, as a page over the message limit)."""
    r = replicas("a", dram_bytes=0, ssd_bytes=MIN_WAL_BYTES + BUDGET)
    data = os.urandom(BIG.page_bytes)
    msg = kvstore_pb2.PutRequest(namespace="big@v1", layout=layout_to_pb(BIG), page_hash=_h("big@v1", 0),
                                 data=data, checksum=page_checksum(data))
    with grpc.insecure_channel(r.address) as channel, pytest.raises(grpc.RpcError) as err:
        kvstore_pb2_grpc.KvStoreServiceStub(channel).Put(iter([msg]), timeout=10)
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert (err.value.details() or "").startswith("requests[0].data: "), err.value.details()
    assert r.store is not None and r.store.stats().evictions == 0


def test_a_demotion_of_a_page_over_a_lowered_budget_evicts_that_page_alone(open_store: Open) -> None:
    """Pages 0-3 on SSD, the big page the least recently used in DRAM, the budget then lowered below
    it (as test_review30 does), and a Put pushing it out of DRAM. Before: its demotion wrote it, and
    the capacity check evicted pages 0-3, then it: the SSD tier empty."""
    store = open_store(dram_bytes=20 * PAGE_BYTES, ssd_bytes=64 * PAGE_BYTES)
    for i in range(8):
        _put(store, "m@v1", i)
    _put(store, "big@v1", 0, BIG)  # demotes pages 0-3
    for i in range(4, 8):
        assert store.get_page("m@v1", _h("m@v1", i)) is not None  # the big page is now DRAM's oldest
    assert store.stats().ssd_pages == 4
    store.ssd_capacity_bytes = BUDGET
    _put(store, "m@v1", 8)
    s = store.stats()
    assert store.get_page("big@v1", _h("big@v1", 0)) is None
    assert s.evictions == 1 and s.ssd_pages == 4, s
    assert _readable(store, "m@v1", 9) == 9


def test_a_restart_with_a_budget_below_recovered_pages_evicts_those_alone(open_store: Open) -> None:
    """Six small pages then a big one on SSD, reopened with an 8-page budget. Before: the capacity check
    at recovery evicted the least recently used first, the six small pages, then the big one: empty."""
    store = open_store(dram_bytes=0, ssd_bytes=64 * PAGE_BYTES)
    for i in range(6):
        _put(store, "m@v1", i)
    _put(store, "big@v1", 0, BIG)
    store.close()
    store = open_store(dram_bytes=0, ssd_bytes=BUDGET)
    s = store.stats()
    assert s.ssd_pages == 6 and s.evictions == 1, s
    assert _readable(store, "m@v1", 6) == 6
    with pytest.raises(ResourceExhausted):  # and its Puts are refused from then on
        _put(store, "big@v1", 1, BIG)


# ---------------------------------------------------------------- item 2: a failed drop of a version
@pytest.fixture
def refuse_tombstones(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[bool]]:
    """RocksDB refuses the registry's tombstone records (a drop's first write) while the flag is set: the
    narrowest stand-in for a full disk or a write stop hitting just that write (a real one refuses the
    new version's own registry record first, and nothing is created)."""
    on = [True]
    real = SsdTier.put_registry

    def put_registry(self: SsdTier, namespace: str, record: bytes) -> None:
        if on[0] and b'"dropped"' in record:
            raise RuntimeError("IO error: No space left on device")
        real(self, namespace, record)

    monkeypatch.setattr(SsdTier, "put_registry", put_registry)
    yield on


def _v1_then_v2(store: KvStore) -> None:
    for i in range(3):
        _put(store, "m@v1", i)
    _put(store, "m@v2", 0)  # creates v2: v1's drop is refused, the Put goes on
    s = store.stats()
    assert store.namespace_layout("m@v1") is not None and s.meta_write_failures == 1 and s.ssd_pages == 4, s


def _assert_v1_dropped(store: KvStore, dropped: int = 1) -> None:
    """dropped: the drops this run made (a counter of the running store)."""
    s = store.stats()
    assert store.namespace_layout("m@v1") is None and s.dropped_namespaces == dropped, s
    assert s.ssd_pages == 1 and s.ssd_bytes == PAGE_BYTES and s.namespaces == 1, s  # v1's pages hold no budget
    assert store.raw_ssd().namespaces() == ["m@v2"]  # its column family (its pages on disk) gone
    with pytest.raises(FailedPrecondition):  # tombstoned: a straggler on v1 cannot bring it back
        _put(store, "m@v1", 9)


def test_a_version_whose_drop_failed_is_dropped_at_the_next_start(open_store: Open,
                                                                  refuse_tombstones: list[bool]) -> None:
    """Before: after the restart v1 was live again with its three pages, and nothing would drop it
    (v2 already existed: no creation in the family)."""
    store = open_store(dram_bytes=0)
    _v1_then_v2(store)
    store.close()
    refuse_tombstones[0] = False
    store = open_store(dram_bytes=0)
    _assert_v1_dropped(store)
    store.close()
    _assert_v1_dropped(open_store(dram_bytes=0), dropped=0)  # and stays so, with nothing left to drop


class _Clock:
    """A monotonic clock the test moves (the store's retry backoff reads it)."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_a_version_whose_drop_still_fails_at_start_opens_and_is_retried(open_store: Open,
                                                                        refuse_tombstones: list[bool]) -> None:
    """The refusal lasting through the restart: the store opens anyway (v1 still live), and a Put once
    the backoff has passed and RocksDB takes the record drops it."""
    store = open_store(dram_bytes=0)
    _v1_then_v2(store)
    store.close()
    clock = _Clock()
    store = open_store(dram_bytes=0, clock=clock)
    assert store.namespace_layout("m@v1") is not None and store.stats().meta_write_failures == 1
    refuse_tombstones[0] = False
    clock.now += 1.0
    _put(store, "m@v2", 1)
    s = store.stats()
    assert store.namespace_layout("m@v1") is None and s.dropped_namespaces == 1 and s.ssd_pages == 2, s


def test_a_running_store_retries_the_failed_drop_at_a_later_put(open_store: Open,
                                                                refuse_tombstones: list[bool]) -> None:
    """Before session 32: v1 stayed live (its pages in the budget) until a v3 was created."""
    clock = _Clock()
    store = open_store(dram_bytes=0, clock=clock)
    _v1_then_v2(store)
    clock.now += 1.0
    _put(store, "m@v2", 1)  # retried, still refused: the Put goes on, v1 stays
    assert store.namespace_layout("m@v1") is not None
    refuse_tombstones[0] = False
    clock.now += 2.0
    _put(store, "m@v2", 2)
    s = store.stats()
    assert store.namespace_layout("m@v1") is None and s.dropped_namespaces == 1 and s.ssd_pages == 3, s
    assert s.meta_write_failures == 1, s  # one failure episode


def test_a_drop_that_keeps_failing_is_retried_with_a_backoff_and_warned_once(
        open_store: Open, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """A tombstone record RocksDB keeps refusing with an ordinary error (a full disk, no stall). Session
    32 tried it at every Put, with a warning and traceback and a meta_write_failures each (the
    reviewer's probe: 1000 Puts, 1000 tries, 1000 warnings, 1001 failures). Now: a retry 1 s after the
    failure, then 2, 4, 8, 16, 30, 30 s apart; one warning, one failure counted; repeats at debug."""
    tries = [0]
    refuse = [True]
    real = SsdTier.put_registry

    def put_registry(self: SsdTier, namespace: str, record: bytes) -> None:
        if b'"dropped"' in record:
            tries[0] += 1
            if refuse[0]:
                raise RuntimeError("IO error: No space left on device")
        real(self, namespace, record)

    monkeypatch.setattr(SsdTier, "put_registry", put_registry)
    clock = _Clock()
    store = open_store(dram_bytes=0, clock=clock)
    _put(store, "m@v1", 0)
    with caplog.at_level(logging.DEBUG, logger="services.kvstore.store"):
        _put(store, "m@v2", 0)  # the creation's try
        for i in range(1, 101):
            _put(store, "m@v2", i)
        assert tries[0] == 1  # no time passed: no retry
        retried_at: list[float] = []
        start = clock.now
        for i in range(101, 101 + 100):  # 100 s, a Put every second
            clock.now += 1.0
            before = tries[0]
            _put(store, "m@v2", i)
            if tries[0] > before:
                retried_at.append(clock.now - start)
    records = list(caplog.records)
    assert retried_at == [1.0, 3.0, 7.0, 15.0, 31.0, 61.0, 91.0], retried_at
    warned = [r for r in records if r.levelno >= logging.WARNING and "superseded" in r.getMessage()]
    assert len(warned) == 1 and warned[0].exc_info is not None, [r.getMessage() for r in warned]
    assert sum(r.levelno == logging.DEBUG and "failed again" in r.getMessage() for r in records) == 7
    assert store.stats().meta_write_failures == 1 and store.namespace_layout("m@v1") is not None

    # The refusal lifts: dropped at the next retry (30 s after the last, at 121 s), and a new failure
    # episode starts over at 1 s.
    refuse[0] = False
    clock.now = start + 120.0
    _put(store, "m@v2", 500)
    assert store.namespace_layout("m@v1") is not None
    clock.now += 1.0
    _put(store, "m@v2", 501)
    assert store.namespace_layout("m@v1") is None and store.stats().dropped_namespaces == 1
    refuse[0] = True
    _put(store, "m@v3", 0)  # v2's drop refused: a new episode, warned and counted again
    assert store.stats().meta_write_failures == 2
    refuse[0] = False
    clock.now += 1.0
    _put(store, "m@v3", 1)
    assert store.namespace_layout("m@v2") is None


def test_a_version_left_by_a_crash_before_its_drop_is_dropped_at_the_next_start(open_store: Open,
                                                                                  tmp_path: Path) -> None:
    """The process is killed once v2's registry record is written, before v1's drop: v1's pages and
    records are on disk (flushed), v2 has no page. Before: v1 came back live, and stayed."""
    db = str(tmp_path / "db")
    _run_killed(f"""
        import os, signal
        from services.kvstore.store import KvStore
        from tests.kvstore.kvhelpers import PAGE_BYTES
        from tests.kvstore.test_superseded_and_oversized import _put
        store = KvStore({db!r}, dram_bytes=0, ssd_bytes=1 << 20, min_blob_bytes=256)
        for i in range(3):
            _put(store, "m@v1", i)
        store.raw_ssd().flush()
        store._drop_locked = lambda name: os.kill(os.getpid(), signal.SIGKILL)
        _put(store, "m@v2", 0)
    """)
    store = open_store(dram_bytes=0, ssd_bytes=1 << 20)
    s = store.stats()
    assert store.namespace_layout("m@v1") is None and store.namespace_layout("m@v2") is not None, s
    assert s.dropped_namespaces == 1 and s.ssd_pages == 0 and s.ssd_bytes == 0, s


@pytest.mark.parametrize(
    ("names", "keep", "live"),
    [
        # keep_versions 2: v1 dropped when v3 came, v2 and v3 stay.
        (["m@v1", "m@v2", "m@v3"], 2, ["m@v2", "m@v3"]),
        # A name without a version tail created after v3 ranks below it and drops nothing; nothing is
        # due at the restart either (a rule of "the highest keep_versions" alone would drop it).
        (["m@v3", "m@foo"], 1, ["m@foo", "m@v3"]),
        # Created before v3, it was dropped by v3's creation.
        (["m@foo", "m@v3"], 1, ["m@v3"]),
    ],
)
def test_recovery_drops_only_what_creations_dropped(open_store: Open, names: list[str], keep: int,
                                                    live: list[str]) -> None:
    """The replay at start drops nothing a running store kept (no failure here)."""
    store = open_store(dram_bytes=0, keep_versions=keep)
    for name in names:
        _put(store, name, 0)
    running = sorted(n for n in names if store.namespace_layout(n) is not None)
    assert running == live
    store.close()
    store = open_store(dram_bytes=0, keep_versions=keep)
    assert sorted(n for n in names if store.namespace_layout(n) is not None) == live
    assert store.stats().ssd_pages == len(live)


def test_keep_versions_lowered_between_runs_drops_versions_created_in_descending_order(open_store: Open) -> None:
    """m@v3, m@v2, m@v1 created (in that order) under keep_versions 3, reopened with 1. Session 32's
    replay of the creations dropped nothing (each was created below the others), so all three stayed
    live: a state a running store with keep_versions 1 never allows (it refuses v2 once v3 is live)."""
    store = open_store(dram_bytes=0, keep_versions=3)
    for name in ("m@v3", "m@v2", "m@v1"):
        _put(store, name, 0)
    store.close()
    store = open_store(dram_bytes=0, keep_versions=1)
    assert [n for n in ("m@v3", "m@v2", "m@v1") if store.namespace_layout(n) is not None] == ["m@v3"]
    s = store.stats()
    assert s.ssd_pages == 1 and s.dropped_namespaces == 2, s
    with pytest.raises(FailedPrecondition):  # and a straggler cannot bring one back
        _put(store, "m@v2", 1)


def test_an_open_keeps_what_a_running_store_with_the_same_keep_versions_kept(open_store: Open) -> None:
    """keep_versions 2: v3 then v2 (kept: one live version above it), v1 refused as a straggler.
    Reopened with the same keep_versions, the open's rule (two versions above) drops nothing: a
    running store never lets a version have keep_versions live ones above it. (Passes before the fix
    too: it guards the fix against dropping more.)"""
    store = open_store(dram_bytes=0, keep_versions=2)
    _put(store, "m@v3", 0)
    _put(store, "m@v2", 0)
    with pytest.raises(FailedPrecondition):
        _put(store, "m@v1", 0)
    live = sorted(n for n in ("m@v2", "m@v3") if store.namespace_layout(n) is not None)
    assert live == ["m@v2", "m@v3"]
    store.close()
    store = open_store(dram_bytes=0, keep_versions=2)
    assert sorted(n for n in ("m@v2", "m@v3") if store.namespace_layout(n) is not None) == live
    assert store.stats().dropped_namespaces == 0
