"""DraftStore TTL expiry by a min-heap with lazy deletion, and seed_history by a prompt-key index.

The sweep scanned every live group under the store's lock (every 0.5 s), and seed_history every
group for the live ones of its key. These tests check that the heap expires exactly what the scan
did (refreshed deadlines, shortened ones, ids used again by a new incarnation, removals by eviction
or replacement), that it stays bounded, and, by counting, that a sweep and a seed look only at what
they need; and that seed_history reaches exactly the live, not completed groups of its key.
"""

from __future__ import annotations

import dataclasses
import random
from collections import Counter
from collections.abc import Callable, Iterator

import pytest

from services.common.errors import AlreadyExists, FailedPrecondition, InvalidArgument, NotFound
from services.draft import store as store_mod
from services.draft.store import DraftStore, StoreLimits, _Group


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def _store(clock: Clock, memory_budget_bytes: int = 2 << 30) -> DraftStore:
    return DraftStore(StoreLimits(memory_budget_bytes=memory_budget_bytes), clock=clock)


def _heap_bound(s: DraftStore) -> int:
    return 2 * len(s._groups) + store_mod._EXPIRY_SLACK


def _check_invariants(s: DraftStore) -> None:
    """The heap holds one current entry per live group, not later than its deadline, and stays
    bounded; the key index holds exactly the live groups, in _groups' order."""
    assert len(s._expiry) <= _heap_bound(s)
    current = Counter(gid for at, seq, gid in s._expiry if gid in s._groups and s._groups[gid].expiry_seq == seq)
    assert current == Counter(list(s._groups)), "every live group has exactly one current heap entry"
    for at, seq, gid in s._expiry:
        g = s._groups.get(gid)
        if g is not None and g.expiry_seq == seq:
            assert at == g.queued_at <= g.expires_at  # reached by the sweep by its deadline
    by_key: dict[str, list[str]] = {}
    for gid, g in s._groups.items():
        by_key.setdefault(g.prompt_key, []).append(gid)
    assert {k: list(v) for k, v in s._by_key.items()} == by_key


# ---- refreshes, shortened deadlines, incarnations ---------------------------------------------------


def test_an_append_moves_the_deadline_later() -> None:
    clock = Clock()
    s = _store(clock)
    s.register_group("g", "k", [1, 2], ttl_seconds=10)  # due at 1010
    s.register_group("h", "k", [1, 2], ttl_seconds=10)  # due at 1010, never refreshed
    clock.t = 1006
    s.append("g", "r", 0, [5, 6])  # due at 1016
    clock.t = 1010
    assert s.expire_now() == 1 and "g" in s._groups  # h at its deadline, g not at its old one
    clock.t = 1014
    s.append("g", "r", 1, [7, 8], truncate=True)  # a truncate+append refreshes too: due at 1024
    clock.t = 1016
    assert s.expire_now() == 1
    clock.t = 1023.9
    assert s.expire_now() == 1
    clock.t = 1024
    assert s.expire_now() == 0  # at its new deadline exactly (expires_at <= now)
    assert s.stats().expired_groups == 2
    _check_invariants(s)


def test_a_busy_group_costs_one_push_per_ttl_not_one_per_append() -> None:
    clock = Clock()
    s = _store(clock)
    s.register_group("g", "k", [1], ttl_seconds=10)
    first = next(s._expiry_seq)  # the sequence numbers handed out count the pushes
    for i in range(1000):  # one append per decode step, 0.1 s apart: 100 s, 10 TTLs
        clock.t += 0.1
        s.append("g", "r", i, [i % 100])
        assert len(s._expiry) == 1  # pushed again when it comes up, never duplicated
    assert s.expire_now() == 1
    assert next(s._expiry_seq) - first - 1 <= 11  # one push per TTL (10 s), not 1,000


def test_a_shorter_ttl_on_re_registration_expires_the_group_at_the_new_deadline() -> None:
    clock = Clock()
    s = _store(clock)
    s.register_group("g", "k", [1], ttl_seconds=100)  # due at 1100
    clock.t = 1001
    s.register_group("g", "k", [1], ttl_seconds=5)  # the same registration, TTL 5: due at 1006
    s.append("g", "r", 0, [3])  # an append uses the new TTL: due at 1006 still
    clock.t = 1006
    assert s.expire_now() == 0
    assert s.stats().expired_groups == 1  # once, though two entries of it were due by 1100
    clock.t = 1100
    assert s.expire_now() == 0 and s.stats().expired_groups == 1
    _check_invariants(s)


def test_an_old_incarnations_heap_entry_never_expires_the_new_one() -> None:
    """A completed group's id registered again (another prompt) is a new group: the old group's
    heap entries, still in the heap, must not expire it early, nor expire it twice."""
    clock = Clock()
    s = _store(clock)
    s.register_group("g", "k", [1], ttl_seconds=10, group_size=1)  # entry at 1010
    s.append("g", "r", 0, [5], finished=True)  # completed
    old = s._groups["g"]
    clock.t = 1002
    created, _ = s.register_group("g", "k", [2], ttl_seconds=60, group_size=1)  # a new incarnation, due at 1062
    assert created and s._groups["g"] is not old
    clock.t = 1010  # the old incarnation's deadline
    assert s.expire_now() == 1 and s._groups["g"].index.prompt == (2,)
    (d,) = s.sync([("g", 0)])
    assert not d.gone and d.incarnation == s._groups["g"].incarnation
    clock.t = 1061.5
    assert s.expire_now() == 1
    clock.t = 1062
    assert s.expire_now() == 0
    assert s.stats().expired_groups == 1

    # The other way round: the old incarnation's entry (1162) later than the new one's (1090, then
    # 1085 after a shorter re-registration): by 1200 every entry of the id is due, and the group
    # expires once.
    s.register_group("h", "k", [1], ttl_seconds=100, group_size=1)  # at 1062: entry at 1162
    s.append("h", "r", 0, [5], finished=True)
    clock.t = 1070
    s.register_group("h", "k", [2], ttl_seconds=20, group_size=1)  # new incarnation: entry at 1090
    clock.t = 1080
    s.register_group("h", "k", [2], ttl_seconds=5)  # the same registration, shorter: due at 1085
    clock.t = 1084.9
    assert s.expire_now() == 1
    clock.t = 1200  # every entry of "h" is due now: 1162 (old incarnation), 1090 and 1085
    assert s.expire_now() == 0
    assert s.stats().expired_groups == 2
    _check_invariants(s)


def test_a_test_making_a_group_due_by_hand_is_expired() -> None:
    """Writing a live group's expires_at directly (tests do, test_client_faults.py) keeps the heap right."""
    clock = Clock()
    s = _store(clock)
    s.register_group("g", "k", [1], ttl_seconds=60)
    s._groups["g"].expires_at = 0.0
    assert s.expire_now() == 0
    assert s.stats().expired_groups == 1


# ---- against a brute-force model ----------------------------------------------------------------


_KEYS = [f"k{i}" for i in range(6)]


def _prompt(gid: int, variant: int) -> tuple[str, list[int]]:
    """Two registrations per id: the same one again refreshes, the other is refused or (completed) a
    new incarnation."""
    return (_KEYS[gid % len(_KEYS)], [gid, 1]) if variant == 0 else (_KEYS[(gid + 1) % len(_KEYS)], [gid, 2])


@pytest.mark.parametrize("slack", [None, 0])
@pytest.mark.parametrize("seed", [1, 2, 3])
def test_random_operations_expire_exactly_what_a_scan_of_every_group_would(
    seed: int, slack: int | None, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Random registrations (refreshes, shorter and longer TTLs, new incarnations), appends (plain,
    truncating, finishing), seeds, syncs, stats and forced sweeps with a fake clock. Before each
    operation that sweeps, the groups due are computed by a scan of every group (what _sweep did);
    afterwards exactly those are gone, in that order, and each live group's deadline equals an
    independent model's (now + its TTL at its last registration or append). With slack 0 the heap
    is rebuilt as soon as stale entries outnumber the live groups: rebuilds happen mid-run."""
    if slack is not None:
        monkeypatch.setattr(store_mod, "_EXPIRY_SLACK", slack)
    rebuilds = Counter[str]()
    compact = DraftStore._compact_expiry

    def counted_compact(self: DraftStore) -> None:
        before = self._expiry
        compact(self)
        rebuilds["rebuilds"] += self._expiry is not before

    monkeypatch.setattr(DraftStore, "_compact_expiry", counted_compact)
    rnd = random.Random(seed)
    clock = Clock()
    s = _store(clock)
    deadline: dict[str, float] = {}  # the model: live group -> deadline
    ttl: dict[str, float] = {}
    expired = incarnations = shortened = 0
    for step in range(4000):
        clock.t += rnd.choice([0.0, 0.0, 0.05, 0.1, 0.2, 0.5, 1.0, 4.0])
        now = clock.t
        op = rnd.choices(["register", "append", "sync", "stats", "expire", "seed"], [30, 45, 5, 3, 7, 10])[0]
        # What the sweep this operation runs (if any) must expire: every group due, in _groups' order.
        sweeps = (op in ("register", "append", "sync", "stats") and now >= s._next_sweep) or op == "expire"
        due = [gid for gid, g in s._groups.items() if g.expires_at <= now] if sweeps else []
        assert sorted(due) == sorted(gid for gid, at in deadline.items() if sweeps and at <= now), step
        for gid in due:
            del deadline[gid]
            ttl.pop(gid)
        expired += len(due)
        tombstones_before = list(s._expired)
        n = rnd.randrange(16)
        gid = f"g{n}"
        try:
            if op == "register":
                key, prompt = _prompt(n, int(rnd.random() < 0.4))
                t = rnd.choice([1, 2, 3, 5, 8, 13, 30, 60])
                size = rnd.choice([1, 1, 2])
                g = s._groups.get(gid) if gid not in due else None  # (due: expired by the sweep first)
                # Another group_size is another group too (refused while running, session 25).
                same = g is not None and (g.prompt_key, g.index.prompt, g.group_size) == (key, tuple(prompt), size)
                shorter = g is not None and now + t < g.queued_at
                created, _ = s.register_group(gid, key, prompt, ttl_seconds=t, group_size=size)
                assert created == (not same)
                incarnations += created and g is not None
                shortened += same and shorter
                deadline[gid] = now + t
                ttl[gid] = t
            elif op == "append":
                g = s._groups.get(gid) if gid not in due else None
                r = rnd.choice("ab")
                have = g.index.length(r) if g is not None else 0
                truncate = rnd.random() < 0.2
                offset = rnd.randint(0, have) if truncate else have
                s.append(gid, r, offset, [rnd.randrange(50) for _ in range(rnd.randint(0, 3))],
                         finished=rnd.random() < 0.3, truncate=truncate)
                deadline[gid] = now + ttl[gid]
            elif op == "sync":
                s.sync([(gid, 0)])
            elif op == "stats":
                s.stats()
            elif op == "expire":
                s.expire_now()
                # Tombstoned in the order the scan found them due (a live group has no tombstone).
                assert list(s._expired) == [*tombstones_before, *due], step
            else:  # seed: reaches exactly the live, not completed groups of the key
                key = rnd.choice(_KEYS)
                reached = {g.group_id for g in s._groups.values() if g.prompt_key == key and not g.completed}
                logs = {g.group_id: len(g.log) for g in s._groups.values()}
                added = s.seed_history(key, rnd.randrange(4), [[step, rnd.randrange(50)]])
                grew = {g.group_id for g in s._groups.values() if len(g.log) != logs[g.group_id]}
                assert grew == (reached if added else set()), step
        except (NotFound, AlreadyExists, FailedPrecondition, InvalidArgument):
            pass  # refused after its sweep: no refresh
        assert set(s._groups) == set(deadline), step
        for g in s._groups.values():
            assert g.expires_at == deadline[g.group_id], (step, g.group_id)
        assert s._expired_count == expired, step
        _check_invariants(s)
    # The run went through what the heap must get right.
    assert expired > 300 and incarnations > 20 and shortened > 20, (expired, incarnations, shortened)
    if slack == 0:
        assert rebuilds["rebuilds"] > 1, (rebuilds, incarnations, shortened)


# ---- the heap stays bounded -----------------------------------------------------------------------


def test_the_heap_stays_bounded_over_10000_cycles() -> None:
    clock = Clock()
    # Registration and expiry: an entry per group, popped when it expires.
    s = _store(clock)
    for i in range(10000):
        s.register_group(f"e{i}", "k", [i], ttl_seconds=1)
        clock.t += 0.1  # about ten live at a time
        s.stats()  # sweeps (every 0.5 s)
        assert len(s._expiry) <= _heap_bound(s)
    # A completed group's id used again (a removal leaving its entry behind), 10,000 times, with
    # 100 others live: the stale entries are compacted away.
    s = _store(clock)
    for i in range(100):
        s.register_group(f"l{i}", "k", [i], ttl_seconds=3600)
    for i in range(10000):
        s.register_group("g", "k", [i], ttl_seconds=3600, group_size=1)
        s.append("g", "r", 0, [1], finished=True)
        assert len(s._expiry) <= _heap_bound(s) <= 2 * 101 + store_mod._EXPIRY_SLACK
    # A deadline moved earlier (a new entry, the old one stale) 10,000 times.
    for i in range(10000):
        s.register_group("l7", "k", [7], ttl_seconds=20000 - i)
        assert len(s._expiry) <= _heap_bound(s)
    # Refreshed by appends across many TTLs: re-pushed, never duplicated.
    for i in range(10000):
        clock.t += 0.5
        s.append(f"l{i % 100}", "r", i // 100, [i % 7])
        assert len(s._expiry) <= _heap_bound(s)
    _check_invariants(s)


def test_evicted_groups_leave_no_entries_behind_forever() -> None:
    """Evictions remove groups the heap still has entries for: compacted, and an entry holds an
    id, never the evicted group (whose memory eviction is to free)."""
    clock = Clock()
    s = _store(clock, memory_budget_bytes=1 << 30)
    for i in range(3000):
        s.register_group(f"c{i}", "k", [1, 2, i % 100], group_size=1)
        s.append(f"c{i}", "r", 0, [4, 5, i % 50], finished=True)
    s.register_group("live", "", [1])
    s.limits = dataclasses.replace(s.limits, memory_budget_bytes=s.stats().memory_bytes // 4)
    s.append("live", "r", 0, [7, 8, 9])
    assert s.stats().evicted_groups > 1500
    assert len(s._expiry) <= _heap_bound(s)
    assert all(isinstance(gid, str) for _, _, gid in s._expiry)
    _check_invariants(s)


# ---- cost, by counting --------------------------------------------------------------------------


@pytest.fixture()
def deadline_reads(monkeypatch: pytest.MonkeyPatch) -> Iterator[Counter[str]]:
    """Counts reads of _Group.expires_at."""
    n: Counter[str] = Counter()
    prop: property = vars(_Group)["expires_at"]
    fget: Callable[[_Group], float] = prop.fget  # type: ignore[assignment]

    def counted(g: _Group) -> float:
        n["expires_at"] += 1
        return fget(g)

    monkeypatch.setattr(_Group, "expires_at", prop.getter(counted))
    yield n


def test_a_sweep_looks_only_at_the_groups_due(deadline_reads: Counter[str]) -> None:
    clock = Clock()
    s = _store(clock)
    for i in range(2000):
        s.register_group(f"g{i}", f"k{i}", [i], ttl_seconds=100 + i % 7)
    s.register_group("soon", "k", [1], ttl_seconds=5)
    clock.t += 6
    deadline_reads.clear()
    assert s.expire_now() == 2000
    assert deadline_reads["expires_at"] <= 3  # "soon" only (the scan read all 2,001)
    deadline_reads.clear()
    assert s.expire_now() == 2000
    assert deadline_reads["expires_at"] == 0


def test_seed_history_looks_only_at_the_groups_of_its_key(monkeypatch: pytest.MonkeyPatch) -> None:
    reads = Counter[str]()

    class CountedKey:
        def __get__(self, obj: object, owner: type | None = None) -> object:
            if obj is None:
                return self
            reads["prompt_key"] += 1
            return obj.__dict__["_counted_prompt_key"]

        def __set__(self, obj: object, value: object) -> None:
            obj.__dict__["_counted_prompt_key"] = value

    monkeypatch.setattr(_Group, "prompt_key", CountedKey(), raising=False)  # a field: no class attribute
    s = DraftStore()
    for i in range(2000):
        s.register_group(f"g{i}", f"k{i}", [i])
    s.register_group("hot", "hot", [1])
    reads.clear()
    assert s.seed_history("hot", 0, [[5, 6, 7]]) == 1
    assert reads["prompt_key"] <= 2  # (the scan read all 2,001)
    (d,) = s.sync([("hot", 0)])
    assert [(e.request_id, e.token_ids) for e in d.appends] == [("", (5, 6, 7))]


# ---- seed_history's reach -----------------------------------------------------------------------


def test_seed_history_reaches_exactly_the_live_unfinished_groups_of_its_key() -> None:
    clock = Clock()
    s = _store(clock, memory_budget_bytes=1 << 30)
    s.register_group("live", "k", [1], ttl_seconds=100, group_size=2)
    s.register_group("other", "o", [1], ttl_seconds=100, group_size=2)
    s.register_group("done", "k", [2], ttl_seconds=100, group_size=1)
    s.append("done", "r", 0, [9], finished=True)  # completed: its responses are history
    s.register_group("gone", "k", [3], ttl_seconds=5, group_size=2)  # expires
    s.register_group("moved", "k", [4], ttl_seconds=100, group_size=1)
    s.append("moved", "r", 0, [8], finished=True)
    s.register_group("moved", "o", [5], ttl_seconds=100, group_size=2)  # its id used again, key "o"
    s.register_group("back", "k", [6], ttl_seconds=5, group_size=2)
    clock.t += 6
    assert s.expire_now() == 4  # "gone" and "back" expired
    s.register_group("back", "k", [6], ttl_seconds=100, group_size=2)  # registered again: live
    # An evicted completed group of the key (the budget shrunk to what is live now).
    s.register_group("evicted", "k", [7], ttl_seconds=100, group_size=1)
    s.append("evicted", "r", 0, [6], finished=True)
    s.register_group("newer", "k", [8], ttl_seconds=100, group_size=2)
    # A budget the append below fits in only with all history and both completed groups evicted.
    newer = s._groups["newer"]
    need = DraftStore._write_bytes(newer, "r", 0, 30, True, 0)
    need += DraftStore._finish_reservation(newer, "r", False, False)
    freeable = s._history.memory_bytes + s._groups["done"].charged_bytes + s._groups["evicted"].charged_bytes
    s.limits = dataclasses.replace(s.limits, memory_budget_bytes=s.stats().memory_bytes - freeable + need)
    s.append("newer", "r", 0, list(range(30)))  # evicts history, then the completed groups
    assert "done" not in s._groups and "evicted" not in s._groups and s.stats().evicted_groups == 2
    s.limits = dataclasses.replace(s.limits, memory_budget_bytes=1 << 30)
    s.register_group("kept", "k", [9], ttl_seconds=100, group_size=1)
    s.append("kept", "r", 0, [3], finished=True)  # completed, still live: not reached
    _check_invariants(s)
    logs = {gid: len(g.log) for gid, g in s._groups.items()}
    assert s.seed_history("k", 5, [[40, 41], [42]]) == 2
    grew = {gid for gid, g in s._groups.items() if len(g.log) != logs[gid]}
    assert grew == {"live", "back", "newer"}
    assert sorted(s._by_key["k"]) == ["back", "kept", "live", "newer"]
    assert sorted(s._by_key["o"]) == ["moved", "other"]
    for gid in grew:
        assert [e.token_ids for e in s._groups[gid].log[-2:]] == [(40, 41), (42,)]
    # Every group of a key gone: the key leaves the index.
    s.register_group("solo", "s", [1], ttl_seconds=1)
    clock.t += 2
    s.expire_now()
    assert "s" not in s._by_key
    assert s.seed_history("s", 0, [[1]]) == 1  # history only, no group


def test_a_heap_rebuild_collects_the_current_entries_and_reads_no_deadline(deadline_reads: Counter[str]) -> None:
    """A rebuild is one pause under the store's lock, O(live groups): it takes each live group's
    current entry as it is (the tuple in the heap) instead of making a new one from the group's
    deadline (two property reads, a new sequence number and three writes a group: 65-85 ms at
    50,000 groups, session 25)."""
    clock = Clock()
    s = _store(clock)
    for i in range(2000):
        s.register_group(f"g{i}", f"k{i}", [i], ttl_seconds=100)  # due at 1100
    clock.t = 1050
    for i in range(1, 51):
        s.append(f"g{i}", "r", 0, [i])  # refreshed to 1150: their entries (1100) are early now
    entries = {e[2]: e for e in s._expiry if s._groups[e[2]].expiry_seq == e[1]}  # the current ones
    assert len(entries) == len(s._groups)
    reads_in_rebuild = None
    for k in range(2 * 2000 + store_mod._EXPIRY_SLACK + 2):
        before = s._expiry
        deadline_reads.clear()
        # Earlier each time (a new entry): the (fake) clock steps back, as the TTL is whole seconds.
        clock.t = 1050 - k * 1e-3
        s.register_group("g0", "k0", [0], ttl_seconds=40)
        if s._expiry is not before:
            reads_in_rebuild = deadline_reads["expires_at"]
            break
    assert reads_in_rebuild is not None, "no rebuild"
    assert reads_in_rebuild <= 4  # the re-registration's own (the rebuild read 2 a group: 4,000)
    assert len(s._expiry) == len(s._groups)
    rebuilt = {e[2]: e for e in s._expiry}
    for gid, e in entries.items():
        if gid != "g0":
            assert rebuilt[gid] is e  # the same entry, the early ones too
    _check_invariants(s)
    # The early entries come up at 1100 and are pushed again at 1150: nothing expires early.
    clock.t = 1100
    assert s.expire_now() == 50
    _check_invariants(s)
    clock.t = 1150
    assert s.expire_now() == 0
