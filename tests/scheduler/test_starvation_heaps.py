"""The lazy heaps of services/scheduler/core/starvation.py under bulk clean-up.

Both heaps (_starved_heap: postponed submissions; _unpostponed: the others) drop stale entries
lazily from the top, and all at once (Starvation._compact) when stale ones dominate. These tests
drive many submissions through track / untrack / dispatch so that both bulk paths run, and check
after each step that the heaps hold exactly one entry per live record they should hold: a live
entry dropped would hide a starved request for ever (or keep a submission from ever being
postponed), a dead one kept would grow the heaps with the submissions ever seen."""

from __future__ import annotations

import random

import pytest

from services.scheduler.core.starvation import Starvation, WaitEntry

LIMIT_S = 10.0


class _Rig:
    """A Starvation with a settable clock and the waits it is told about (its `alive`)."""

    def __init__(self) -> None:
        self.t = 0.0
        self.live: dict[str, int] = {}  # request id -> enqueue count of its live wait
        self.s = Starvation(LIMIT_S, lambda: self.t, self._alive)
        self._enq = 0

    def _alive(self, entry: WaitEntry) -> bool:
        return self.live.get(entry[1]) == entry[2]

    def wait(self, sid: int, rid: str) -> None:
        self._enq += 1
        self.live[rid] = self._enq
        self.s.wait(sid, self.t, rid, self._enq)


def _expected_heaps(s: Starvation) -> tuple[set[tuple[int, int]], set[tuple[int, int]]]:
    """(submission, token) that each heap must hold after a clean-up: the postponed records that
    are marked in the starved heap, and the records not postponed."""
    starved = {(sid, o.token) for sid, o in s._subs.items() if o.in_heap}
    unpostponed = {(sid, o.token) for sid, o in s._subs.items() if o.newer_since is None}
    return starved, unpostponed


class _Compactions:
    """Untracks through the one path that rebuilds the heaps, and checks each rebuild: then the
    heap must hold exactly the live entries. A rebuild is told by the heap being a new list
    (Starvation._compact assigns one), not by its shrinking: clocks stopping pushes entries back
    on the rebuilt unpostponed heap in the same untrack, which can leave it no shorter."""

    def __init__(self) -> None:
        self.starved = 0
        self.unpostponed = 0

    def untrack(self, s: Starvation, sid: int) -> bool:
        # The old lists are held here, so identity cannot be fooled by a reused id.
        before = s._starved_heap, s._unpostponed
        stopped = s.untrack(sid)
        starved_want, unpostponed_want = _expected_heaps(s)
        if s._starved_heap is not before[0]:
            self.starved += 1
            assert sorted((e[1], e[2]) for e in s._starved_heap) == sorted(starved_want)
        if s._unpostponed is not before[1]:
            self.unpostponed += 1
            assert sorted(s._unpostponed) == sorted(unpostponed_want)
        return stopped


def _check_invariants(s: Starvation) -> None:
    """Always (compacted or not): no live record misses its entry (a dropped live entry), every
    postponed record with waits is in the starved heap, and the dead entries stay within the
    compaction bound."""
    starved_want, unpostponed_want = _expected_heaps(s)
    in_starved = {(e[1], e[2]) for e in s._starved_heap}
    in_unpostponed = set(s._unpostponed)
    assert starved_want <= in_starved, starved_want - in_starved
    assert unpostponed_want <= in_unpostponed, unpostponed_want - in_unpostponed
    for sid, o in s._subs.items():
        # A postponed record is marked in the heap (or was dropped from it when it had no wait).
        assert o.newer_since is None or o.in_heap or o.waiting.oldest(s._alive) is None, sid
    # Dead entries are made only by untrack, which rebuilds a heap they dominate: they never
    # outnumber the bound (a clean-up that kept them would let them pile up past it).
    bound = max(64, 4 * len(s._subs))
    assert len(in_starved - starved_want) <= bound and len(in_unpostponed - unpostponed_want) <= bound
    # The rule the lazy heaps stand for: the top is the newest tracked submission that ran, and
    # exactly the tracked ones below it are postponed. The number heaps that find the next top and
    # the clocks that stop when the top ends hold every live number, within the same bound.
    ran = {sid for sid, o in s._subs.items() if o.dispatched}
    assert s._top_dispatched == max(ran, default=None)
    top = s._top_dispatched
    postponed = {sid for sid, o in s._subs.items() if o.newer_since is not None}
    assert postponed == {sid for sid in s._subs if top is not None and sid < top}
    assert ran <= {-n for n in s._dispatched_heap} and postponed <= {-n for n in s._postponed}
    assert len(s._dispatched_heap) <= bound + len(ran) and len(s._postponed) <= bound + len(postponed)


def test_bulk_clean_up_keeps_exactly_the_live_entries() -> None:
    """300 postponed submissions (one newer one ran), then all but 5 of them end: the starved heap
    is rebuilt with the 5 live ones only (also one whose number came back as a new record, whose
    old entry is dead). Then 300 submissions above the running one come and most end: the
    unpostponed heap is rebuilt the same way."""
    r = _Rig()
    s = r.s
    c = _Compactions()
    top = 1000
    s.track(top)
    r.wait(top, "top")
    for sid in range(1, 301):
        s.track(sid)
        r.wait(sid, f"r{sid}")
    r.t = 1.0
    s.dispatched(top, r.t)  # postpones 1..300
    assert len(s._starved_heap) == 300
    keep = {7, 150, 151, 299, 300}
    for sid in range(1, 301):
        if sid not in keep:
            r.live.pop(f"r{sid}")
            assert c.untrack(s, sid) is False  # the newest that ran (top) is still tracked
    assert c.starved > 0  # rebuilt (and checked exact) as dead entries came to dominate
    # The live ones are all there; the dead left since the last rebuild at most its bound.
    assert keep <= {e[1] for e in s._starved_heap}
    assert len(s._starved_heap) <= 64
    # A number that comes back is a new record (new token); its old entry is dead.
    r.live.pop("r7")
    c.untrack(s, 7)
    r.t = 2.0
    s.track(7)
    r.wait(7, "r7-again")
    _check_invariants(s)
    assert len([e for e in s._starved_heap if e[1] == 7 and e[2] == s._subs[7].token]) == 1
    # The clean-up kept what matters: the starved request is the oldest live wait past the limit
    # (150, postponed since 1.0), and a re-tracked 7 waits from 2.0.
    r.t = 1.0 + LIMIT_S + 0.5
    assert s.starved_entry(r.t) == (0.0, "r150", r.live["r150"])
    r.live.pop("r150")
    assert s.starved_entry(r.t) == (0.0, "r151", r.live["r151"])

    # Now the other heap: submissions above the running one are not postponed.
    for sid in range(2000, 2300):
        s.track(sid)
        r.wait(sid, f"u{sid}")
    assert len(s._unpostponed) >= 300
    above_keep = {2000, 2001, 2299}
    for sid in range(2000, 2300):
        if sid not in above_keep:
            r.live.pop(f"u{sid}")
            c.untrack(s, sid)
    _check_invariants(s)
    assert c.unpostponed > 0
    assert above_keep | {top} <= {e[0] for e in s._unpostponed}
    # A first dispatch of the newest postpones exactly the live ones below it (none lost).
    r.t = 20.0
    s.dispatched(2299, r.t)
    assert {sid for sid, o in s._subs.items() if o.newer_since is None} == {2299}
    assert s._subs[2000].newer_since == s._subs[2001].newer_since == s._subs[top].newer_since == 20.0


@pytest.mark.parametrize("seed", range(4))
def test_random_churn_keeps_the_heaps_exact_and_bounded(seed: int) -> None:
    """Thousands of submissions come and go in any order, with first dispatches, the newest
    running one ending (clocks stop: entries pushed back on the unpostponed heap), and requests
    dispatched while still tracked (their wait dies) that wait again later: a postponed
    submission with nothing waiting is dropped from the starved heap when read, and its next wait
    must push it back. After every step no live entry is missing and the heaps stay within the
    compaction bound; the starved request found from the heap's top is the one a scan of every
    record finds."""
    rnd = random.Random(seed)
    r = _Rig()
    s = r.s
    tracked: dict[int, list[str]] = {}
    c = _Compactions()
    repushed = 0  # waits of a postponed submission that had been dropped from the starved heap

    def check() -> None:
        _check_invariants(s)
        assert s.starved_entry(r.t) == _naive_starved(s, r.t)

    for step in range(4000):
        r.t += rnd.random()
        # Phases of growth and of shrinking, so that dead entries come to dominate both heaps.
        p_track = 0.7 if (step // 500) % 2 == 0 else 0.15
        op = rnd.random()
        if op < p_track or not tracked:
            sid = rnd.randint(max(0, step - 300), step + 50)  # mostly newer, some older
            rid = f"s{sid}-{step}"
            s.track(sid)
            tracked.setdefault(sid, []).append(rid)
            r.wait(sid, rid)
        elif op < p_track + 0.1:
            # Mostly one of the oldest (many newer ones wait unpostponed), at times any.
            ids = sorted(tracked)
            s.dispatched(rnd.choice(ids[:3] if rnd.random() < 0.9 else ids), r.t)
        else:
            sid = rnd.choice(sorted(tracked))
            rid = tracked[sid].pop()
            r.live.pop(rid, None)
            if not tracked[sid]:
                del tracked[sid]
            c.untrack(s, sid)
        check()
        # Besides (a draw of its own, so the mix above that makes both heaps compact is kept):
        # a request dispatched while it stays tracked, and one such waiting again later.
        extra = rnd.random()
        if extra < 0.15 and tracked:
            # Its wait dies. Of a postponed submission (below the newest that ran, so no new top:
            # first dispatches stay the op above's), which so comes to have nothing waiting:
            # starved_entry then drops it from the starved heap when it reaches the top.
            postponed = [i for i in sorted(tracked) if s._subs[i].newer_since is not None]
            sid = rnd.choice(postponed) if postponed else -1
            waiting = [rid for rid in tracked.get(sid, []) if rid in r.live]
            if waiting:
                r.live.pop(rnd.choice(waiting))
                s.dispatched(sid, r.t)
                check()
        elif extra < 0.25:
            # A dispatched request (its chunk done) waits again: a submission dropped from the
            # starved heap must be pushed back, or its starved request is hidden for ever.
            idle = [(sid, rid) for sid, rids in tracked.items() for rid in rids if rid not in r.live]
            if idle:
                sid, rid = rnd.choice(idle)
                sub = s._subs[sid]
                repushed += sub.newer_since is not None and not sub.in_heap
                r.wait(sid, rid)
                assert sub.newer_since is None or sub.in_heap, sid
                check()
    assert c.starved > 0 and c.unpostponed > 0  # both bulk paths ran (and were checked exact)
    assert repushed > 0  # the drop-and-push-again path ran (and was checked)


def _naive_starved(s: Starvation, now: float) -> WaitEntry | None:
    best: tuple[float, int, WaitEntry] | None = None
    for sid, sub in s._subs.items():
        oldest = sub.waiting.oldest(s._alive)
        if oldest is None or sub.newer_since is None:
            continue
        start = max(oldest[0], sub.newer_since)
        if now - start > s.limit_s and (best is None or (start, sid) < best[:2]):
            best = (start, sid, oldest)
    return None if best is None else best[2]


class _NoScan(dict[int, object]):
    """The records of a Starvation, refusing to be scanned: only look-ups by number."""

    def _refuse(self, *_: object) -> object:
        raise AssertionError("scanned every tracked submission")

    __iter__ = items = values = keys = _refuse  # type: ignore[assignment]


def test_newest_ending_stops_exactly_the_clocks_from_the_new_top_up_without_a_scan() -> None:
    """The reset when the newest submission that ran ends: the next newest that ran becomes the
    top; it and every tracked submission above it stop (back to the policy's order, clock started
    afresh by the next newer first dispatch); those below it keep the clock they had (the
    postponement by newer work had no break). It reads the records by number only: it scanned
    all of them (0.19 ms with 5,000 tracked, 0.42 ms with 10,000, per newest that ends)."""
    r = _Rig()
    s = r.s
    s._subs = _NoScan()  # type: ignore[assignment]
    for sid in (1, 2, 3, 5, 6, 7, 9):
        s.track(sid)
        r.wait(sid, f"r{sid}")
    s.dispatched(1, 0.0)
    r.t = 1.0
    s.dispatched(5, r.t)  # postpones 1, 2, 3 from 1.0
    r.t = 2.0
    s.dispatched(7, r.t)  # postpones 5, 6 from 2.0
    newer = {sid: o.newer_since for sid, o in dict.items(s._subs)}
    assert newer == {1: 1.0, 2: 1.0, 3: 1.0, 5: 2.0, 6: 2.0, 7: None, 9: None}

    r.t = 3.0
    r.live.pop("r7")
    assert s.untrack(7) is True  # the newest that ran ended: clocks stop
    assert s._top_dispatched == 5
    newer = {sid: o.newer_since for sid, o in dict.items(s._subs)}
    assert newer == {1: 1.0, 2: 1.0, 3: 1.0, 5: None, 6: None, 9: None}
    # 1-3 were postponed since 1.0 without a break: past the limit on that clock, not from 3.0.
    assert s.starved_entry(1.0 + LIMIT_S + 0.5) == (0.0, "r1", r.live["r1"])
    assert not s.is_starved(6, 0.0, 100.0)  # nothing newer than 6 runs

    r.live.pop("r5")
    assert s.untrack(5) is True
    assert s._top_dispatched == 1
    assert {sid for sid, o in dict.items(s._subs) if o.newer_since is not None} == set()
    assert s.starved_entry(100.0) is None

    # The next newer first dispatch starts the clocks again, from its own time.
    r.t = 50.0
    s.dispatched(9, r.t)
    newer = {sid: o.newer_since for sid, o in dict.items(s._subs)}
    assert newer == {1: 50.0, 2: 50.0, 3: 50.0, 6: 50.0, 9: None}
    r.live.pop("r9")
    assert s.untrack(9) is True
    assert s._top_dispatched == 1  # 1 still ran: 2, 3 and 6 stop, and 1 itself
    assert all(o.newer_since is None for o in dict.values(s._subs))
    r.live.pop("r1")
    assert s.untrack(1) is True
    assert s._top_dispatched is None
