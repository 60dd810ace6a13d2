"""Responses of earlier iterations by prompt key (RhymeRL HistoSpec): the drafts of an iteration's start.

Each prompt key keeps the responses of its last `keep_iterations` iterations. Memory is accounted
per iteration; the store evicts the globally oldest iteration first when over its budget.
"""

from __future__ import annotations

from array import array
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

from services.common.errors import InvalidArgument

# Responses are stored as array('i') (4 bytes a token, no int objects): as tuples, the int objects
# were shared with the indexes of live groups of the key, so evicting history freed a fraction of
# what it was accounted for. Bytes of one response besides its tokens: the array object and the
# list slot (tracemalloc: tests/draft/test_store.py).
HISTORY_TOKEN_BYTES = 4
HISTORY_RESPONSE_BYTES = 96


@dataclass
class _Iteration:
    iteration: int
    seq: int  # global insertion order: the eviction order
    responses: list[array[int]] = field(default_factory=list)
    tokens: int = 0
    batches: set[int] = field(default_factory=set)  # _batch_key of every add: the same add again is a no-op

    @property
    def memory_bytes(self) -> int:
        return self.tokens * HISTORY_TOKEN_BYTES + len(self.responses) * HISTORY_RESPONSE_BYTES


class HistoryStore:
    """prompt key -> iteration -> responses. Not thread-safe; DraftStore locks around it."""

    def __init__(self, keep_iterations: int = 2) -> None:
        if keep_iterations < 1:
            raise InvalidArgument("must be >= 1", field="history_iterations")
        self.keep_iterations = keep_iterations
        self._keys: dict[str, dict[int, _Iteration]] = {}
        self._counter = 0
        # Every kept iteration by seq, oldest first (seqs are handed out in increasing order, so
        # insertion order is seq order): evict_oldest takes the first in O(1). It scanned every
        # key, under the draft store's lock, once per eviction.
        self._order: OrderedDict[int, tuple[str, int]] = OrderedDict()
        self.memory_bytes = 0
        self.evicted = 0

    def add(self, prompt_key: str, iteration: int, responses: Sequence[Sequence[int]]) -> list[tuple[int, ...]]:
        """Adds responses for (key, iteration); returns the ones added. Idempotent: the same
        responses (in any order) already held for the key, in any kept iteration, add nothing (a
        retried SeedHistory; a group completed again after a restart, whose responses the buffer
        refill brought back already, or the other way round), and no empty iteration is created
        (it would count as the newest and push out real ones). Iterations older than the newest
        `keep_iterations` of the key are dropped."""
        if not prompt_key:
            raise InvalidArgument("must not be empty", field="prompt_key")
        added = [tuple(int(t) for t in r) for r in responses if len(r)]
        if not added or self.has(prompt_key, added):
            return []
        iters = self._keys.setdefault(prompt_key, {})
        it = iters.get(iteration)
        if it is None:
            if len(iters) >= self.keep_iterations and iteration < min(iters):
                return []  # older than everything kept: nothing to do
            self._counter += 1
            it = iters[iteration] = _Iteration(iteration, self._counter)
            self._order[it.seq] = (prompt_key, iteration)
        it.batches.add(_batch_key(added))
        before = it.memory_bytes
        it.responses.extend(array("i", r) for r in added)
        it.tokens += sum(len(r) for r in added)
        self.memory_bytes += it.memory_bytes - before
        while len(iters) > self.keep_iterations:
            self._drop(prompt_key, min(iters))
        return added

    def has(self, prompt_key: str, responses: Sequence[Sequence[int]]) -> bool:
        """Whether exactly these responses (in any order) were added for the key in one add, in
        any iteration still kept."""
        key = _batch_key([tuple(int(t) for t in r) for r in responses if len(r)])
        return any(key in it.batches for it in self._keys.get(prompt_key, {}).values())

    def next_iteration(self, prompt_key: str) -> int:
        iters = self._keys.get(prompt_key)
        return max(iters) + 1 if iters else 0

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

    def _drop(self, prompt_key: str, iteration: int) -> None:
        iters = self._keys[prompt_key]
        it = iters.pop(iteration)
        del self._order[it.seq]
        self.memory_bytes -= it.memory_bytes
        self.evicted += len(it.responses)
        if not iters:
            del self._keys[prompt_key]

    def evict_oldest(self) -> bool:
        """Drops the globally oldest stored iteration; False when there is nothing left."""
        if not self._order:
            return False
        key, iteration = next(iter(self._order.values()))
        self._drop(key, iteration)
        return True

    def __iter__(self) -> Iterator[str]:
        return iter(self._keys)


def _batch_key(responses: Sequence[tuple[int, ...]]) -> int:
    """Identifies one add's responses, order left out (a group promotes them by request id, the
    buffer returns them by sample index): Python's hash of int tuples is not salted, so it is
    stable within the process, which is all the store needs."""
    return hash(tuple(sorted(responses)))
