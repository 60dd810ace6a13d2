"""Responses of earlier iterations by prompt key (RhymeRL HistoSpec): the drafts of an iteration's start.

Each prompt key keeps the responses of its last `keep_iterations` iterations. An iteration is the
policy version the responses were generated with (DraftStore.register): every group of a key at one
version merges into one iteration. Memory is accounted per iteration; the store evicts the oldest
iteration first when over its budget.
"""

from __future__ import annotations

import hashlib
import time
from array import array
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

from services.common.errors import InvalidArgument
from services.common.log import get_logger, kv

log = get_logger(__name__)

# Responses are stored as array('i') (4 bytes a token, no int objects): as tuples, the int objects
# were shared with the indexes of live groups of the key, so evicting history freed a fraction of
# what it was accounted for. Bytes of one response besides its tokens: the array object and the
# list slot (tracemalloc: tests/draft/test_store.py), and its source (8 bytes in _Iteration.sources).
HISTORY_TOKEN_BYTES = 4
HISTORY_RESPONSE_BYTES = 104
# The fixed structures of a kept iteration (the _Iteration, its list and sources array, its entries
# in the key's dict and in HistoryStore._order) and of a key with history (its dict, its entry in
# _keys and the key string). tracemalloc, 20,000 keys of 1-3 iterations of 1-4 short responses:
# ~470 and ~310 bytes (tests/draft/test_history_memory.py). Not counted, a key of one iteration of
# one 8-token response held 841 bytes for 136 accounted (6x): many prompts with short responses
# overran the budget by the difference.
HISTORY_ITERATION_BYTES = 480
HISTORY_KEY_BYTES = 320
# Responses one iteration of a key holds at most (besides the add that brings them: one group's
# responses are kept whole). An iteration is a policy version (DraftStore.register), and every
# group of the key at that version merges into it: a loop that never updates the weights (a
# benchmark, an evaluation) runs every batch at one version, and its iteration grew without bound,
# copied into the index of every new group of the key. Over the cap the oldest responses of the
# iteration go (counted as evicted). 64: four groups of 16, a prompt sampled a few times a batch.
HISTORY_ITERATION_RESPONSES = 64
# Iterations numbered without a policy version (an old client's group: the key's next number) are
# kept under UNVERSIONED_BASE + their number: below every version (versions are >= 0), so such a
# number never counts as newer than a real version. Numbered in one space, three old-client groups
# after version 3 were iterations 4..6, and then version 4's responses were "older than everything
# kept" and silently not kept (a rolling upgrade mixes old and new clients).
UNVERSIONED_BASE = -(1 << 62)


def unversioned(number: int) -> int:
    """The stored iteration of fallback number `number` (no policy version known)."""
    return UNVERSIONED_BASE + number


def is_versioned(iteration: int) -> bool:
    """Whether a stored iteration is a policy version (else a fallback number, unversioned())."""
    return iteration >= 0


def describe(iteration: int) -> str:
    """An iteration as text (messages, probes): "v<version>" or "unversioned <number>"."""
    return f"v{iteration}" if is_versioned(iteration) else f"unversioned {iteration - UNVERSIONED_BASE}"


def log_fields(iteration: int) -> dict[str, int | bool]:
    """An iteration as structured log fields: `iteration`, an int as it always was (the version,
    or the fallback number), and `versioned`, which of the two it is. (The field became a string
    for a while, "v3" / "unversioned 0": a log query or dashboard reading it as a number broke.)"""
    versioned = is_versioned(iteration)
    return {"iteration": iteration if versioned else iteration - UNVERSIONED_BASE, "versioned": versioned}


# A rejected add (older than every kept iteration of a full key) warns once per key per this many
# seconds; the rest log at debug and are counted (HistoryStore.rejected_adds). A straggler batch of
# an old version, or a new run beside a server that kept the old run's, rejects one add per group
# of the key: a warning each flooded the log.
REJECTED_WARN_INTERVAL_S = 60.0
# Rejected adds remembered (a digest each: key, iteration, responses, sources) so that a retry of
# one (a retried SeedHistory, a group completing again) is not counted in `evicted` again: the
# count is of responses not kept, not of attempts. Bounded: an add forgotten is counted again.
_REJECTED_REMEMBERED = 1024
# Keys whose last rejection warning is remembered (HistoryStore._warned), at most: past it the key
# warned longest ago is forgotten (it may warn again within the interval: the log stays bounded by
# the keys rejected, never the dict by them). ~200 bytes an entry.
_WARNED_REMEMBERED = 4096


def source_id(group_id: str, request_id: str) -> int:
    """The source of a promoted response (a request of a group), as a nonzero 63-bit id: held
    responses of one source are one sample, equal responses of two sources two samples."""
    d = hashlib.blake2b(f"{group_id}\0{request_id}".encode(), digest_size=8).digest()
    return (int.from_bytes(d, "big") >> 1) | 1


@dataclass
class _Iteration:
    iteration: int
    seq: int  # global insertion order: the eviction order
    responses: list[array[int]] = field(default_factory=list)
    # Per response (same order): its source_id, 0 = unknown (seeded: SeedHistory, the backfill).
    sources: array[int] = field(default_factory=lambda: array("q"))
    tokens: int = 0
    # A fallback iteration's: the buffer version of a refill seeded into it while no version was
    # known for the key (DraftStore.refill_history); renumber_refill moves the seeded responses
    # there once one is. On the iteration, not on the groups running when it was seeded: those
    # may all have completed by the time a version comes (it stayed fallback then), and it goes
    # when the iteration goes. (Free: the instance dict's allocation holds a sixth key as is.)
    refill_version: int | None = None

    def remove(self, arr: array[int]) -> int:
        """Drops a held response (by identity); returns its source."""
        i = next(i for i, x in enumerate(self.responses) if x is arr)
        del self.responses[i]
        src = self.sources[i]
        del self.sources[i]
        return src

    @property
    def memory_bytes(self) -> int:
        return (HISTORY_ITERATION_BYTES + self.tokens * HISTORY_TOKEN_BYTES
                + len(self.responses) * HISTORY_RESPONSE_BYTES)


@dataclass
class _Plan:
    """What an add does to the key's kept iterations (HistoryStore._plan)."""

    new: list[tuple[tuple[int, ...], int]] = field(default_factory=list)  # (tokens, source) not held
    moved: list[tuple[_Iteration, array[int]]] = field(default_factory=list)  # held older: move here
    same: list[array[int]] = field(default_factory=list)  # held in the add's iteration already
    claimed: list[tuple[_Iteration, array[int], int]] = field(default_factory=list)  # unknown source: now this
    rejected: bool = False  # older than every kept iteration of a full key: nothing added

    @property
    def kept(self) -> int:
        """Responses of the add its iteration holds after it: the cap never trims them."""
        return len(self.new) + len(self.moved) + len(self.same)


@dataclass
class AddPlan:
    """An add planned once (HistoryStore.plan_add): its cost for the budget and the plan add()
    applies. Valid while the history is unchanged (`changes`): add() plans again otherwise."""

    prompt_key: str
    iteration: int
    changes: int  # HistoryStore._changes when planned
    plan: _Plan
    # The new copies the add stores (none for a rejected add): what a seed makes room for.
    new: list[tuple[int, ...]]
    # The fixed structures it creates net of those it drops (structure_bytes_bound).
    structure_bytes: int
    # What the iteration's response cap frees of earlier adds when it runs (a seed reserves net).
    trimmed_bytes: int


class HistoryStore:
    """prompt key -> iteration -> responses. Not thread-safe; DraftStore locks around it."""

    def __init__(self, keep_iterations: int = 2, iteration_responses: int = HISTORY_ITERATION_RESPONSES, *,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if keep_iterations < 1:
            raise InvalidArgument("must be >= 1", field="history_iterations")
        if iteration_responses < 1:
            raise InvalidArgument("must be >= 1", field="history_iteration_responses")
        self.keep_iterations = keep_iterations
        self.iteration_responses = iteration_responses
        self._keys: dict[str, dict[int, _Iteration]] = {}
        self._counter = 0
        # Every kept iteration by seq, oldest first (seqs are handed out in increasing order, so
        # insertion order is seq order): evict_oldest takes the first in O(1). It scanned every
        # key, under the draft store's lock, once per eviction.
        self._order: OrderedDict[int, tuple[str, int]] = OrderedDict()
        self.memory_bytes = 0
        self.evicted = 0
        # Bumped by every change to what is held: an AddPlan of an older count is stale.
        self._changes = 0
        self._clock = clock
        # Rejected adds: how many (retries too), the digests of recent ones (a retry is not counted
        # in `evicted` again), and per key when it last warned and the rejections since (logged
        # with the next warning). _warned is in warning-time order (a key warning again moves to
        # the end), so the keys whose warning is older than the interval are at its front and are
        # popped from there, amortised O(1) a rejection, and it holds at most _WARNED_REMEMBERED
        # keys. (A dict scanned whole at each rejection once it held 1,024 keys, deleting nothing
        # while all were younger than the interval, grew without bound and cost 337 us a rejection
        # at 32,000 keys, under the draft store's lock: review 4417.)
        self.rejected_adds = 0
        self._rejected: OrderedDict[bytes, None] = OrderedDict()
        self._warned: OrderedDict[str, tuple[float, int]] = OrderedDict()

    def add(self, prompt_key: str, iteration: int, responses: Sequence[Sequence[int]],
            sources: Sequence[int] | None = None, *, planned: AddPlan | None = None) -> list[tuple[int, ...]]:
        """Adds responses for (key, iteration); returns the ones added (new copies). Idempotent per
        response: the key's history is the multiset union of what was added while kept, so a
        response already held for the key, in any kept iteration, is not added again (a retried
        SeedHistory, in any order or iteration; a subset or superset of an earlier add; a group's
        responses promoted here and then refilled from the buffer within its whole iteration, or
        the other way round), and n equal responses in one add (a low temperature) are held n
        times.

        `sources` (per response, source_id; a group's promotion) tells samples apart: a response
        with a source matches only a held copy of that source (the same group completing again: a
        restart, a straggler re-creating it) or one of unknown source (seeded: the buffer holds the
        same samples, so it is claimed), never another source's. So equal responses of two groups
        of the key are two samples, held twice, as the buffer holds them: a seed of the buffer's
        iteration afterwards matches both. Without sources (seeds) any held copy matches.

        A held response that an add of a newer iteration brings again moves to that iteration (it
        was produced again: it lives as long as the newest iteration that brought it,
        not the oldest), and one held in the add's own iteration moves to its end (the newest
        there: the cap below trims from the front) when the add brings something new; an add
        that brings nothing new (a retried seed) changes nothing, not even the order. No empty
        iteration is created (it would count as the newest and push out real ones). An add to an
        iteration the key holds merges into it (another group of the key at the same policy
        version). Iterations older than the newest `keep_iterations` of the key are dropped, and an
        iteration over `iteration_responses` drops its oldest responses (never this add's). An add
        older than every kept iteration of a full key is not kept: its new responses are counted
        in `evicted` (once per add: a retry of it is not counted again) and logged, never dropped
        silently (a straggler of an old version, or versions that went backwards: a new run beside
        a draft server that kept the old run's: no automatic rule drops the newer history, see
        services/draft/README.md).

        `planned`: plan_add's plan of this very add (same key, iteration and responses, no
        sources), applied as it is while nothing changed since; planned again otherwise."""
        if not prompt_key:
            raise InvalidArgument("must not be empty", field="prompt_key")
        if sources is not None and len(sources) != len(responses):
            raise InvalidArgument("one source per response", field="sources")
        iters = self._keys.get(prompt_key, {})
        if (planned is not None and sources is None and planned.changes == self._changes
                and planned.prompt_key == prompt_key and planned.iteration == iteration):
            plan = planned.plan
        else:
            plan = self._plan(iters, iteration, responses, sources)
        self._changes += 1
        for owner, held, source in plan.claimed:
            owner.sources[next(i for i, x in enumerate(owner.responses) if x is held)] = source
        if plan.rejected:
            if plan.new:
                self._reject(prompt_key, iteration, iters, plan.new)
            return []
        added, moved = plan.new, plan.moved
        if not added and not moved:
            # Nothing new (a retried seed, a group completing again): nothing changes, not even the
            # order. Moved to the end, a retried seed's responses became the iteration's newest,
            # and the cap then trimmed a group's real response before them.
            return []
        if prompt_key not in self._keys:
            self._keys[prompt_key] = iters
            self.memory_bytes += HISTORY_KEY_BYTES
        it = iters.get(iteration)
        if it is None:
            self._counter += 1
            it = iters[iteration] = _Iteration(iteration, self._counter)
            self._order[it.seq] = (prompt_key, iteration)
            before = 0  # its fixed structures are new too
        else:
            before = it.memory_bytes
        for src, arr in moved:
            # Same bytes, another iteration: the key's total does not change (it moves from src).
            it.sources.append(src.remove(arr))
            src.tokens -= len(arr)
            it.responses.append(arr)
            it.tokens += len(arr)
            if not src.responses:
                self._drop(prompt_key, src.iteration, evicted=False)  # everything moved on: not an eviction
        it.responses.extend(array("i", r) for r, _ in added)
        it.sources.extend(source for _, source in added)
        it.tokens += sum(len(r) for r, _ in added)
        self.memory_bytes += it.memory_bytes - before - sum(len(a) * HISTORY_TOKEN_BYTES + HISTORY_RESPONSE_BYTES
                                                             for _, a in moved)
        # This add's responses are the last ones of the list (those matched in place too, moved
        # there: left at their old front place, the cap dropped a response of the very add that
        # brought it again), so only earlier adds' are dropped.
        self._to_end(it, plan.same)
        excess = len(it.responses) - max(self.iteration_responses, plan.kept)
        if excess > 0:
            self._trim_front(it, excess)
        while len(iters) > self.keep_iterations:
            self._drop(prompt_key, min(iters))
        return [r for r, _ in added]

    def _reject(self, prompt_key: str, iteration: int, iters: dict[int, _Iteration],
                new: Sequence[tuple[tuple[int, ...], int]]) -> None:
        """An add older than every kept iteration of a full key: its new responses are counted in
        `evicted` (once: a retry of the same add is not counted again) and logged, a warning at
        most once per key per REJECTED_WARN_INTERVAL_S (the rest at debug, counted)."""
        self.rejected_adds += 1
        h = hashlib.blake2b(digest_size=16)
        h.update(prompt_key.encode() + b"\0" + iteration.to_bytes(8, "little", signed=True))
        for r, src in new:
            h.update(len(r).to_bytes(4, "little") + array("i", r).tobytes() + src.to_bytes(8, "little"))
        digest = h.digest()
        retry = digest in self._rejected
        if retry:
            self._rejected.move_to_end(digest)
        else:
            self._rejected[digest] = None
            if len(self._rejected) > _REJECTED_REMEMBERED:
                self._rejected.popitem(last=False)
            self.evicted += len(new)
        now = self._clock()
        fields: dict[str, object] = dict(prompt_key=prompt_key, **log_fields(iteration), responses=len(new),
                                         kept=[describe(i) for i in sorted(iters)], retry=retry)
        warned_at, since = self._warned.get(prompt_key, (None, 0))
        if warned_at is not None and now - warned_at < REJECTED_WARN_INTERVAL_S:
            self._warned[prompt_key] = (warned_at, since + 1)
            log.debug("history add older than every kept iteration of its key: not kept", extra=kv(**fields))
            return
        # Warns now: the key moves to the end (the newest warning), then stale keys leave the front.
        self._warned[prompt_key] = (now, 0)
        self._warned.move_to_end(prompt_key)
        while self._warned:
            _, (t, _) = next(iter(self._warned.items()))
            if now - t < REJECTED_WARN_INTERVAL_S and len(self._warned) <= _WARNED_REMEMBERED:
                break
            self._warned.popitem(last=False)
        log.warning("history add older than every kept iteration of its key: not kept",
                    extra=kv(**fields, suppressed=since))

    def note_refill(self, prompt_key: str, iteration: int, version: int) -> None:
        """A refill of the buffer's `version` was seeded into the key's fallback `iteration` (no
        version known for the key yet): renumber_refill moves it to `version` once one is (the
        newest such version when refills repeat)."""
        it = self._keys.get(prompt_key, {}).get(iteration)
        if it is not None and not is_versioned(iteration):
            it.refill_version = version if it.refill_version is None else max(it.refill_version, version)

    def renumber_refill(self, prompt_key: str) -> tuple[int, int] | None:
        """A version is known for the key now: a refill seeded under fallback number 0
        (note_refill) becomes the buffer's version it was (renumber_seeded), once. Returns
        (responses moved, that version), None when the key has no pending refill."""
        it = self._keys.get(prompt_key, {}).get(unversioned(0))
        if it is None or it.refill_version is None:
            return None
        version, it.refill_version = it.refill_version, None
        return self.renumber_seeded(prompt_key, unversioned(0), version), version

    def renumber_seeded(self, prompt_key: str, src: int, dst: int) -> int:
        """Moves the key's responses of unknown source (seeded) held in iteration `src` to
        iteration `dst`, before dst's own (they are its oldest); returns how many moved. For a
        refill seeded under a fallback number because no group of the key had a version yet, when
        a registration then gives the group its version (DraftStore.register): the refill is
        renumbered as the buffer's version it was, as if the version had been known when it was
        seeded. Responses of a known source (a group's promotion) stay. The cap and
        `keep_iterations` apply as in add (dropped responses counted in `evicted`). The memory
        changes by at most an iteration's fixed structures: the caller evicts after."""
        iters = self._keys.get(prompt_key)
        if not iters or src not in iters or src == dst:
            return 0
        it = iters[src]
        seeded = [(a, s) for a, s in zip(it.responses, it.sources, strict=True) if not s]
        if not seeded:
            return 0
        self._changes += 1
        target = iters.get(dst)
        if target is None:
            self._counter += 1
            target = iters[dst] = _Iteration(dst, self._counter)
            self._order[target.seq] = (prompt_key, dst)
            self.memory_bytes += HISTORY_ITERATION_BYTES
        ids = {id(a) for a, _ in seeded}
        rest = [(a, s) for a, s in zip(it.responses, it.sources, strict=True) if id(a) not in ids]
        moved_tokens = sum(len(a) for a, _ in seeded)
        it.responses[:] = [a for a, _ in rest]
        it.sources = array("q", [s for _, s in rest])
        it.tokens -= moved_tokens
        target.responses[:0] = [a for a, _ in seeded]
        target.sources = array("q", [0] * len(seeded)) + target.sources
        target.tokens += moved_tokens
        if not it.responses:
            self._drop(prompt_key, src, evicted=False)  # everything moved on: not an eviction
        excess = len(target.responses) - self.iteration_responses
        if excess > 0:
            self._trim_front(target, excess)
        while len(iters) > self.keep_iterations:
            self._drop(prompt_key, min(iters))
        return len(seeded)

    def _trim_front(self, it: _Iteration, n: int) -> None:
        """Drops the `n` oldest responses of `it` (the cap), counted as evicted."""
        dropped = it.responses[:n]
        del it.responses[:n]
        del it.sources[:n]
        freed = sum(len(a) for a in dropped)
        it.tokens -= freed
        self.memory_bytes -= freed * HISTORY_TOKEN_BYTES + n * HISTORY_RESPONSE_BYTES
        self.evicted += n

    @staticmethod
    def _to_end(it: _Iteration, arrs: Sequence[array[int]]) -> None:
        """Moves held responses of `it` (by identity) to its end, in their order: O(len(it))."""
        if not arrs:
            return
        ids = {id(a) for a in arrs}
        stay = [(a, s) for a, s in zip(it.responses, it.sources, strict=True) if id(a) not in ids]
        last = {id(a): s for a, s in zip(it.responses, it.sources, strict=True) if id(a) in ids}
        it.responses[:] = [a for a, _ in stay] + list(arrs)
        it.sources = array("q", [s for _, s in stay] + [last[id(a)] for a in arrs])

    def plan_add(self, prompt_key: str, iteration: int, responses: Sequence[Sequence[int]]) -> AddPlan:
        """Plans add() of seeded responses (unknown source) at (key, iteration) once: the new copies
        (what seed_history makes room for; none for an add that is not kept), the fixed
        structures it creates (structure_bytes_bound) and what the cap trims of earlier adds, and
        the plan add(planned=...) applies while the history is unchanged. (The seed computed each
        of these with its own plan, and add() a fourth, every plan matching the responses against
        every held response of the key, under the draft store's lock.)"""
        iters = self._keys.get(prompt_key, {})
        plan = self._plan(iters, iteration, responses)
        new = [] if plan.rejected else [r for r, _ in plan.new]
        return AddPlan(prompt_key, iteration, self._changes, plan, new,
                       self._structure_bytes(iters, iteration, responses, plan),
                       self._trimmed_bytes(iters.get(iteration), plan))

    def _trimmed_bytes(self, it: _Iteration | None, plan: _Plan) -> int:
        """The history bytes the `iteration_responses` cap frees when add() of `plan` runs now (its
        oldest responses of earlier adds): seed_history reserves the new copies net of them.
        Reserving them gross evicted other keys' history (or completed groups) for growth that the
        cap takes back at once, e.g. a refill into an iteration at its cap."""
        if it is None or plan.rejected:
            return 0
        excess = len(it.responses) + len(plan.new) + len(plan.moved) - max(self.iteration_responses, plan.kept)
        if excess <= 0:
            return 0
        ids = {id(a) for a in plan.same}
        dropped = [a for a in it.responses if id(a) not in ids][:excess]
        return sum(len(a) for a in dropped) * HISTORY_TOKEN_BYTES + len(dropped) * HISTORY_RESPONSE_BYTES

    def _plan(self, iters: dict[int, _Iteration], iteration: int, responses: Sequence[Sequence[int]],
              sources: Sequence[int] | None = None) -> _Plan:
        """What add() does: responses not held with their sources (new), held copies to move to
        `iteration` (moved) or held in it already (same), copies of unknown source a sourced response
        claims. Each response of the add is matched to one held copy of equal tokens, newest
        iteration first (a multiset: n equal responses need n copies): a sourced one to a copy of
        its source, else one of unknown source (see add); the unmatched ones are new. Only held
        responses of a length the add has are compared, so an add costs O(its tokens + the key's
        responses). rejected: the key keeps `keep_iterations` iterations, all newer than this one
        (the new responses are not kept; matched ones are held anyway)."""
        srcs = sources if sources is not None else [0] * len(responses)
        resp = [(tuple(int(t) for t in r), int(s)) for r, s in zip(responses, srcs, strict=True) if len(r)]
        plan = _Plan()
        if not resp:
            return plan
        plan.rejected = bool(iters) and iteration not in iters and len(iters) >= self.keep_iterations \
            and iteration < min(iters)
        lengths = {len(r) for r, _ in resp}
        pool: dict[bytes, list[tuple[_Iteration, array[int], int]]] = {}
        for it in sorted(iters.values(), key=lambda it: it.iteration, reverse=True):
            for arr, held_src in zip(it.responses, it.sources, strict=True):
                if len(arr) in lengths:
                    pool.setdefault(arr.tobytes(), []).append((it, arr, held_src))
        for r, source in resp:
            copies = pool.get(array("i", r).tobytes()) if pool else None
            j = None
            if copies:
                if not source:
                    j = 0
                else:
                    j = next((k for k, c in enumerate(copies) if c[2] == source), None)
                    if j is None:
                        j = next((k for k, c in enumerate(copies) if not c[2]), None)
            if copies is None or j is None:
                plan.new.append((r, source))
                continue
            held, arr, held_src = copies.pop(j)
            if source and not held_src:
                plan.claimed.append((held, arr, source))
            if held.iteration < iteration:
                plan.moved.append((held, arr))
            elif held.iteration == iteration:
                plan.same.append(arr)
        return plan

    def structure_bytes_bound(self, prompt_key: str, iteration: int, responses: Sequence[Sequence[int]]) -> int:
        """An upper bound of the fixed structures an add of `responses` at (key, iteration) creates,
        net of those it drops: the iteration's, and the key's when it has no history
        (seed_history makes room for them with the responses). Nothing for an add that adds and
        moves nothing (every response held newer), and no net iteration for one that only moves
        held responses out of iterations it empties (they are dropped): reserving one anyway
        evicted history for no growth when the budget was nearly full."""
        return self.plan_add(prompt_key, iteration, responses).structure_bytes

    @staticmethod
    def _structure_bytes(iters: dict[int, _Iteration], iteration: int, responses: Sequence[Sequence[int]],
                         plan: _Plan) -> int:
        """structure_bytes_bound of `plan` (planned against `iters`, the key's iterations)."""
        if not iters:
            return HISTORY_KEY_BYTES + HISTORY_ITERATION_BYTES if any(len(r) for r in responses) else 0
        if iteration in iters:
            return 0
        if plan.rejected or (not plan.new and not plan.moved):
            return 0  # older than everything kept, or every response held in a newer iteration
        emptied = 0
        if not plan.new:
            taken: dict[int, int] = {}
            for src, _arr in plan.moved:
                taken[src.iteration] = taken.get(src.iteration, 0) + 1
            emptied = sum(1 for i, n in taken.items() if n == len(iters[i].responses))
        return max(0, HISTORY_ITERATION_BYTES * (1 - emptied))

    def next_iteration(self, prompt_key: str) -> int:
        """The iteration of a group registered without a policy version (an old client). When the
        key's newest iteration is a version, that version: the group runs beside groups of it (a
        rolling upgrade), and as its newest + 1 it counted as a newer version than the real next one,
        whose responses were then not kept. Else (no version seen for the key: every client old) the
        old rule, the newest fallback number + 1 (unversioned(0) on an empty key), below every
        version."""
        iters = self._keys.get(prompt_key)
        if not iters:
            return unversioned(0)
        newest = max(iters)
        return newest if is_versioned(newest) else newest + 1

    def responses(self, prompt_key: str) -> list[tuple[int, ...]]:
        """All kept responses of a key, newest iteration first (as tuples: copies)."""
        iters = self._keys.get(prompt_key, {})
        return [tuple(r) for i in sorted(iters, reverse=True) for r in iters[i].responses]

    def tokens(self, prompt_key: str) -> int:
        """Tokens of all kept responses of a key."""
        return sum(it.tokens for it in self._keys.get(prompt_key, {}).values())

    def count(self, prompt_key: str) -> int:
        return sum(len(it.responses) for it in self._keys.get(prompt_key, {}).values())

    @property
    def num_keys(self) -> int:
        return len(self._keys)

    def _drop(self, prompt_key: str, iteration: int, *, evicted: bool = True) -> None:
        iters = self._keys[prompt_key]
        it = iters.pop(iteration)
        self._changes += 1
        del self._order[it.seq]
        self.memory_bytes -= it.memory_bytes
        if evicted:
            self.evicted += len(it.responses)
        if not iters:
            del self._keys[prompt_key]
            self.memory_bytes -= HISTORY_KEY_BYTES

    def evict_oldest(self) -> bool:
        """Drops the oldest iteration of the key whose iteration was stored first; False when there
        is nothing left. The key's oldest by number, not the one stored first: iterations are policy
        versions, and a straggler group of an older version that completes after a newer one was
        stored would otherwise outlive it."""
        if not self._order:
            return False
        key, _ = next(iter(self._order.values()))
        self._drop(key, min(self._keys[key]))
        return True

    def __iter__(self) -> Iterator[str]:
        return iter(self._keys)

