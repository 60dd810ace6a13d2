"""DraftStore memory accounting: the running totals, the budget, and the cost of keeping them.

The store reports memory as running totals kept at every change (it summed over every group on
each append, under its lock: 9 ms with 5,000 live groups). These tests check the totals against a
recomputation from the stored data, that no write (tokens, a finish or re-opening entry, an epoch
entry) takes the memory over the budget, and, by counting, that an append or an eviction costs
the same however many groups are live.
"""

from __future__ import annotations

import contextlib
import dataclasses
import random
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from services.common.errors import (
    AlreadyExists,
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    ResourceExhausted,
)
from services.draft import history as history_mod
from services.draft.history import (
    HISTORY_ITERATION_BYTES,
    HISTORY_KEY_BYTES,
    HISTORY_RESPONSE_BYTES,
    HISTORY_TOKEN_BYTES,
    HistoryStore,
)
from services.draft.index import (
    ENTRY_BYTES,
    INDEX_BYTES,
    KEY_BYTES,
    LEAD_TOKEN_BYTES,
    LIST_BYTES,
    PROMPT_TOKEN_BYTES,
    SEQ_BYTES,
    TOKEN_BYTES,
    TOKEN_KEY_BYTES,
    GroupIndex,
    new_index_bytes_bound,
)
from services.draft.store import (
    _EPOCH_BYTES,
    _GROUP_BYTES,
    _LOG_ENTRY_BYTES,
    _LOG_TOKEN_BYTES,
    DraftStore,
    StoreLimits,
    _Group,
)

_REFUSALS = (ResourceExhausted, InvalidArgument, FailedPrecondition, NotFound, AlreadyExists)


def _index_bytes(idx: GroupIndex) -> tuple[int, int]:
    """(memory, indexed tokens) of an index counted from its tables and sequences, not its counters."""
    tokens = sum(len(q) for q in idx._seqs)
    lead = sum(idx._bases[s] for s in range(len(idx._seqs)) if s not in idx._free)
    mem = INDEX_BYTES + len(idx.prompt) * PROMPT_TOKEN_BYTES + len(idx._seqs) * SEQ_BYTES
    mem += (tokens - lead) * TOKEN_BYTES + lead * LEAD_TOKEN_BYTES
    for k, table in zip(idx.levels, idx._tables, strict=True):
        for v in table.values():
            mem += TOKEN_KEY_BYTES if k == 1 else KEY_BYTES
            if not isinstance(v, int):
                mem += LIST_BYTES + (len(v) - 1) * ENTRY_BYTES
    return mem, tokens


def _recount(s: DraftStore) -> tuple[int, int]:
    """(memory, indexed tokens) of the whole store recounted from what it holds."""
    mem = tokens = 0
    for g in s._groups.values():
        m, t = _index_bytes(g.index)
        mem += _GROUP_BYTES + m + sum(_LOG_ENTRY_BYTES + len(e.token_ids) * _LOG_TOKEN_BYTES for e in g.log)
        mem += len(g.epochs) * _EPOCH_BYTES
        # A response not finished holds its finish's log entry (reserved by its first append).
        assert g.finish_reserved.isdisjoint(g.finished)
        mem += len(g.finish_reserved) * _LOG_ENTRY_BYTES
        tokens += t
    for iters in s._history._keys.values():
        mem += HISTORY_KEY_BYTES
        for it in iters.values():
            mem += HISTORY_ITERATION_BYTES
            mem += sum(len(r) * HISTORY_TOKEN_BYTES + HISTORY_RESPONSE_BYTES for r in it.responses)
    return mem, tokens


def _check(s: DraftStore, what: str) -> None:
    """The totals equal a recount, and the memory is within the budget."""
    st = s.stats()
    assert (st.memory_bytes, st.indexed_tokens) == _recount(s), what
    assert st.memory_bytes <= st.memory_budget_bytes, f"{what}: {st.memory_bytes} > {st.memory_budget_bytes}"


# ---- (a) the running totals against a recount, and the budget, over random operations --------------


def _random_run(seed: int, ops: int, budget: int) -> Counter[str]:
    rnd = random.Random(seed)
    now = [0.0]
    s = DraftStore(StoreLimits(memory_budget_bytes=budget, history_iterations=2, default_ttl_seconds=60),
                   clock=lambda: now[0])
    ids = [f"g{i}" for i in range(20)]
    keys = ["", "k0", "k1", "k2"]
    rids = [f"r{i}" for i in range(6)]
    prompts = {gid: [[rnd.randrange(12) for _ in range(rnd.randrange(0, 25))] for _ in range(2)] for gid in ids}
    seen: Counter[str] = Counter()

    def toks(n: int) -> list[int]:
        return [rnd.randrange(12) for _ in range(n)]

    for step in range(ops):
        kind = rnd.choices(["append", "truncate", "finish", "epoch", "register", "seed", "clock"],
                           [40, 14, 10, 5, 18, 5, 8])[0]
        # Mostly a live group (an unknown id is refused, NotFound, before anything else is tried).
        gid = rnd.choice(list(s._groups)) if s._groups and rnd.random() < 0.85 else rnd.choice(ids)
        rid = rnd.choice(rids)
        g = s._groups.get(gid)
        have = g.index.length(rid) if g is not None else 0
        cur = g.epochs.get(rid, 0) if g is not None else 0
        # Mostly the request's attempt or a newer one; now and then 0 (unordered) or a stale one.
        epoch = max(0, rnd.choices([cur, cur + 1, 0, cur - 1], [50, 25, 20, 5])[0])
        try:
            if kind == "append":
                back = rnd.randrange(min(have, 2) + 1)
                old = g.index.tokens(rid)[have - back:] if g is not None else []
                s.append(gid, rid, have - back, old + toks(rnd.randrange(5)), finished=rnd.random() < 0.1,
                         epoch=epoch)
            elif kind == "truncate":
                s.append(gid, rid, rnd.randrange(have + 1), toks(rnd.randrange(4)), finished=rnd.random() < 0.3,
                         truncate=True, epoch=epoch)
            elif kind == "finish":
                s.append(gid, rid, have, [], finished=True)
            elif kind == "epoch":
                s.append(gid, rid, have, [], epoch=cur + 1)
            elif kind == "register":
                # Mostly the group's usual registration; now and then another (refused, or a new
                # incarnation of a completed group; another group_size is another group too).
                usual = rnd.random() < 0.9
                created, _ = s.register_group(
                    gid, keys[int(gid[1:]) % len(keys)] if usual else rnd.choice(keys),
                    prompts[gid][rnd.random() < 0.15], ttl_seconds=rnd.randrange(5, 60),
                    group_size=(1, 2, 2, 3)[int(gid[1:]) % 4] if rnd.random() < 0.8 else rnd.choice([0, 1, 2, 2, 3]))
                if created and g is not None:
                    seen["replaced"] += 1  # a completed group's id registered again: a new incarnation
            elif kind == "seed":
                s.seed_history(rnd.choice(keys[1:]), rnd.randrange(5),
                               [toks(rnd.randrange(12)) for _ in range(rnd.randrange(1, 4))])
            else:
                now[0] += rnd.uniform(0, 15)
                if rnd.random() < 0.5:
                    s.expire_now()
            seen[kind] += 1
        except _REFUSALS as e:
            seen[type(e).__name__] += 1
        _check(s, f"seed {seed}, step {step} ({kind})")
    st = s.stats()
    seen["evicted_groups"] = st.evicted_groups
    seen["expired_groups"] = st.expired_groups
    seen["evicted_history"] = st.evicted_history
    return seen


@pytest.mark.parametrize("seed", [1, 2, 3, 4])
def test_running_totals_match_a_recount_and_stay_within_the_budget(seed: int) -> None:
    seen = _random_run(seed, 800, budget=80_000)
    # The run went through what it is meant to: evictions, expiry, refusals for the budget.
    assert seen["evicted_groups"] and seen["expired_groups"] and seen["evicted_history"], seen
    assert seen["ResourceExhausted"] and seen["replaced"] and seen["seed"] and seen["truncate"], seen


# ---- (b) the cost of an append or an eviction does not grow with the live groups ---------------------


@pytest.fixture()
def memory_reads(monkeypatch: pytest.MonkeyPatch) -> Iterator[Counter[str]]:
    """Counts _Group.memory_bytes computations."""
    n: Counter[str] = Counter()
    fget: Callable[[_Group], int] = _Group.memory_bytes.fget  # type: ignore[attr-defined, assignment]

    def counted(g: _Group) -> int:
        n["memory_bytes"] += 1
        return fget(g)

    monkeypatch.setattr(_Group, "memory_bytes", property(counted))
    yield n


class _CountedField:
    """Stands in for a dataclass field (set before the instances are made): counts its reads."""

    def __init__(self, name: str) -> None:
        self.key = f"_counted_{name}"
        self.reads = 0

    def __get__(self, obj: object, owner: type | None = None) -> Any:
        if obj is None:
            return self
        self.reads += 1
        return obj.__dict__[self.key]

    def __set__(self, obj: object, value: Any) -> None:
        obj.__dict__[self.key] = value


def test_an_append_computes_no_other_groups_memory(memory_reads: Counter[str]) -> None:
    s = DraftStore(StoreLimits(memory_budget_bytes=1 << 30))
    for i in range(2000):
        s.register_group(f"g{i}", f"k{i}", [1, 2, 3, i % 50])
        s.append(f"g{i}", "r", 0, [4, 5])
    memory_reads.clear()
    s.append("g1000", "r", 2, [6])
    assert memory_reads["memory_bytes"] <= 2  # the group appended to, not the 2,000 (the old code: 4,000)
    s.append("g1000", "r", 3, [7], finished=True, epoch=1)
    assert memory_reads["memory_bytes"] <= 4
    _check(s, "after the appends")


def test_an_eviction_looks_at_no_other_groups(monkeypatch: pytest.MonkeyPatch, memory_reads: Counter[str]) -> None:
    completed = _CountedField("completed")
    monkeypatch.setattr(_Group, "completed", completed)
    s = DraftStore(StoreLimits(memory_budget_bytes=1 << 30))
    for i in range(2000):
        # One key: the history holds its last two iterations only.
        s.register_group(f"g{i}", "k", [1, 2, 3], group_size=1)
        s.append(f"g{i}", "r", 0, [4, 5, 6, i % 50, i // 50], finished=True)  # complete: evictable
    s.register_group("live", "", [1])
    # The budget is now full, and the history alone cannot make room for the next append: completed
    # groups are evicted for it.
    s.limits = dataclasses.replace(s.limits, memory_budget_bytes=s.stats().memory_bytes - s._history.memory_bytes)
    memory_reads.clear()
    completed.reads = 0
    s.append("live", "r", 0, [7, 8, 9])
    st = s.stats()
    assert 1 <= st.evicted_groups <= 3 and st.memory_bytes <= st.memory_budget_bytes
    assert "g0" not in s._groups and "g1999" in s._groups  # the first completed went first
    assert memory_reads["memory_bytes"] <= 4
    assert completed.reads <= 10  # (the old code read every group's, per group evicted)
    _check(s, "after the eviction")


def test_history_eviction_looks_at_no_other_iteration(monkeypatch: pytest.MonkeyPatch) -> None:
    seq = _CountedField("seq")
    monkeypatch.setattr(history_mod._Iteration, "seq", seq, raising=False)  # a field without a default
    h = HistoryStore(keep_iterations=2)
    for i in range(2000):
        h.add(f"k{i}", 0, [[1, 2, i]])
        h.add(f"k{i}", 1, [[3, 4, i]])
    seq.reads = 0
    assert h.evict_oldest() and h.evict_oldest()
    assert seq.reads <= 4  # (the old code read every iteration's per eviction: 8,000)
    assert h.responses("k0") == [] and h.responses("k1") == [(3, 4, 1), (1, 2, 1)]  # oldest first, as before
    memory = h.memory_bytes
    h.add("k0", 5, [[9]])
    assert h.evict_oldest()
    # k0's [9] in (k0 has history again: its key's structures too), an iteration of k1 out
    assert h.memory_bytes == memory + (1 - 3) * HISTORY_TOKEN_BYTES + HISTORY_KEY_BYTES
    assert h.responses("k1") == [(3, 4, 1)]  # k1's iteration 0 went, not k0's new one


# ---- (c) finish, re-open and epoch entries are charged to the budget ---------------------------------


def _full_store(budget: int = 30_000, finish: bool = False) -> tuple[DraftStore, list[str]]:
    """A store whose budget is full of one live group's responses (nothing evictable)."""
    s = DraftStore(StoreLimits(memory_budget_bytes=budget))
    s.register_group("g", "k", [1, 2, 3])  # group_size 0: never completes, never evictable
    rids: list[str] = []
    while True:
        rid = f"r{len(rids)}"
        try:
            s.append("g", rid, 0, [len(rids) % 7, 5], finished=finish)
        except ResourceExhausted:
            break
        rids.append(rid)
        _check(s, f"filling, {rid}")
    return s, rids


def test_token_appends_never_exceed_the_budget() -> None:
    # A response's first append is a new index sequence (its slot, the prompt-tail lead) and every
    # append a log entry: the old per-token reservation left those out. Over a range of budgets,
    # some fill up to just below where an append's estimate and its real growth differ.
    for budget in range(30_000, 31_000, 40):
        s, rids = _full_store(budget)  # the first appends, checked as they go
        assert len(rids) > 10
        for rid in rids:
            with contextlib.suppress(ResourceExhausted):
                s.append("g", rid, 2, [9])
            _check(s, f"budget {budget}, 1-token append to {rid}")


def test_finish_entries_are_charged_to_the_budget() -> None:
    """Charged ahead, by the response's first append: with the budget full, every finish still goes
    through, and the memory stays within the budget."""
    s, rids = _full_store()
    for rid in rids:
        s.append("g", rid, 2, [], finished=True)  # no token: only a log entry
        _check(s, f"finishing {rid}")


def test_reopen_entries_are_charged_to_the_budget() -> None:
    s, rids = _full_store(finish=True)
    refused = 0
    for rid in rids:
        try:
            s.append("g", rid, 2, [], truncate=True)  # not finished: re-opens it, an entry without tokens
        except ResourceExhausted:
            refused += 1
        _check(s, f"re-opening {rid}")
    assert refused


def test_epoch_entries_are_charged_to_the_budget() -> None:
    s, rids = _full_store()
    refused = 0
    for rid in [*rids, *(f"new{i}" for i in range(50))]:  # a request without tokens has an epoch too
        try:
            s.append("g", rid, s.index_of("g").length(rid), [], epoch=3)
        except ResourceExhausted:
            refused += 1
        _check(s, f"epoch of {rid}")
    assert refused
    # A newer epoch of a request that has one replaces it: no new entry, never refused for room.
    held = [rid for rid in rids if rid in s._groups["g"].epochs]
    assert held
    for rid in held:
        s.append("g", rid, 2, [], epoch=4)
    _check(s, "newer epochs")


def test_a_cut_that_frees_memory_is_not_refused_when_the_budget_is_full() -> None:
    s = DraftStore(StoreLimits(memory_budget_bytes=30_000))
    s.register_group("g", "k", [1, 2, 3])
    s.append("g", "long", 0, list(range(20, 40)))
    with pytest.raises(ResourceExhausted):
        for i in range(1000):
            s.append("g", f"r{i}", 0, [i % 7, 5])
    before = s.stats().memory_bytes
    s.append("g", "long", 10, [], truncate=True)  # a resumed attempt's cut, nothing new yet
    assert s.index_of("g").tokens("long") == list(range(20, 30))
    assert s.stats().memory_bytes < before
    _check(s, "after the cut")


# ---- eviction order and the index's bounds ------------------------------------------------------------


def test_completed_groups_are_evicted_in_the_order_they_completed() -> None:
    s = DraftStore(StoreLimits(memory_budget_bytes=1 << 30))
    s.register_group("early", "k1", [1, 2], group_size=1)  # registered first, completes last
    s.register_group("late", "k2", [1, 2], group_size=1)
    s.append("late", "r", 0, [3, 4], finished=True)
    s.append("early", "r", 0, [3, 4], finished=True)
    s.register_group("live", "", [1])
    s.limits = dataclasses.replace(s.limits, memory_budget_bytes=s.stats().memory_bytes - s._history.memory_bytes - 1)
    with s._lock:
        s._evict()  # all history first, then the group that completed first
    assert "late" not in s._groups and "early" in s._groups
    assert s.stats().evicted_groups == 1
    _check(s, "after the eviction")


@pytest.mark.parametrize("levels", [(1, 2, 4, 7), (2, 3, 5), (1,), (3,)])
def test_index_bounds_hold(levels: tuple[int, ...]) -> None:
    rnd = random.Random(sum(levels))
    for _ in range(200):
        prompt = [rnd.randrange(6) for _ in range(rnd.randrange(0, 10))]
        history = [[rnd.randrange(6) for _ in range(rnd.randrange(0, 8))] for _ in range(rnd.randrange(0, 3))]
        idx = GroupIndex(prompt, levels=levels)
        for r in history:
            idx.add_history(r)
        assert idx.memory_bytes() <= new_index_bytes_bound(levels, len(prompt), len(history),
                                                           sum(map(len, history)))
        more = [[rnd.randrange(6) for _ in range(rnd.randrange(0, 5))] for _ in range(2)]
        before = idx.memory_bytes()
        bound = idx.history_bytes_bound(len(more), sum(map(len, more)))
        for r in more:
            idx.add_history(r)
        assert idx.memory_bytes() - before <= bound
        for _ in range(20):
            rid = f"r{rnd.randrange(3)}"
            have = idx.length(rid)
            start = rnd.randrange(have + 1)
            toks = [rnd.randrange(6) for _ in range(rnd.randrange(0, 5))]
            before = idx.memory_bytes()
            floor = idx.truncate_bytes_floor(have - start)
            dropped = idx.truncate(rid, start)
            assert dropped == have - start and before - idx.memory_bytes() >= floor
            before = idx.memory_bytes()
            bound = idx.append_bytes_bound(start, len(toks))
            idx.append(rid, start, toks)
            assert idx.memory_bytes() - before <= bound
            assert idx.memory_bytes() == _index_bytes(idx)[0]


def test_finishes_are_not_refused_when_the_budget_is_full() -> None:
    """Each response's finish entry is reserved by its first append. Refused, no group of a store
    full of incomplete groups could ever complete and become evictable: the store stayed full
    (every new group refused) until their TTLs ran out."""
    s = DraftStore(StoreLimits(memory_budget_bytes=30_000))
    s.register_group("g", "k", [1, 2, 3], group_size=3)
    for rid in ("a", "b", "c"):
        s.append("g", rid, 0, [4, 5, 6])
    n = 0
    while True:  # fill the budget with a group that never completes
        try:
            s.register_group(f"f{n}", "", [7, 8], group_size=0)
            s.append(f"f{n}", "x", 0, [1, 2, 3, 4])
        except ResourceExhausted:
            break
        n += 1
    for i in range(10_000):  # and what is left with epoch entries (smaller than a finish's log entry)
        try:
            s.append("f0", f"e{i}", 0, [], epoch=1)
        except ResourceExhausted:
            break
    with pytest.raises(ResourceExhausted):  # the budget is full
        s.append("f0", "y", 0, [1])
    for rid in ("a", "b", "c"):  # each finish uses what its response's first append reserved
        s.append("g", rid, 3, [], finished=True)
        _check(s, f"finishing {rid}")
    assert s._groups["g"].completed
    _check(s, "completed")
    # The next write makes room by evicting it.
    s.register_group("next", "", [1], group_size=0)
    assert "g" not in s._groups
    _check(s, "after the eviction")
