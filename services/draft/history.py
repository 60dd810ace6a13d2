"""Responses of earlier iterations by prompt key (RhymeRL HistoSpec): the drafts of an iteration's start.

Each prompt key keeps the responses of its last `keep_iterations` iterations. Memory is accounted
per iteration; the store evicts the globally oldest iteration first when over its budget.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

from services.common.errors import InvalidArgument

# Bytes of one stored history token (a tuple slot plus, for ids >= 256, an int object), calibrated
# with tracemalloc; the index adds its own entries when a group loads the history.
HISTORY_TOKEN_BYTES = 36
HISTORY_RESPONSE_BYTES = 64


@dataclass
class _Iteration:
    iteration: int
    seq: int  # global insertion order: the eviction order
    responses: list[tuple[int, ...]] = field(default_factory=list)
    tokens: int = 0

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
        self.memory_bytes = 0
        self.evicted = 0

    def add(self, prompt_key: str, iteration: int, responses: Sequence[Sequence[int]]) -> list[tuple[int, ...]]:
        """Adds responses for (key, iteration); returns the ones added. Iterations older than the
        newest `keep_iterations` of the key are dropped."""
        if not prompt_key:
            raise InvalidArgument("must not be empty", field="prompt_key")
        iters = self._keys.setdefault(prompt_key, {})
        it = iters.get(iteration)
        if it is None:
            if len(iters) >= self.keep_iterations and iteration < min(iters):
                return []  # older than everything kept: nothing to do
            self._counter += 1
            it = iters[iteration] = _Iteration(iteration, self._counter)
        added = [tuple(int(t) for t in r) for r in responses if len(r)]
        before = it.memory_bytes
        it.responses.extend(added)
        it.tokens += sum(len(r) for r in added)
        self.memory_bytes += it.memory_bytes - before
        while len(iters) > self.keep_iterations:
            self._drop(prompt_key, min(iters))
        return added

    def next_iteration(self, prompt_key: str) -> int:
        iters = self._keys.get(prompt_key)
        return max(iters) + 1 if iters else 0

    def responses(self, prompt_key: str) -> list[tuple[int, ...]]:
        """All kept responses of a key, newest iteration first."""
        iters = self._keys.get(prompt_key, {})
        return [r for i in sorted(iters, reverse=True) for r in iters[i].responses]

    def count(self, prompt_key: str) -> int:
        return sum(len(it.responses) for it in self._keys.get(prompt_key, {}).values())

    @property
    def num_keys(self) -> int:
        return len(self._keys)

    def _drop(self, prompt_key: str, iteration: int) -> None:
        iters = self._keys[prompt_key]
        it = iters.pop(iteration)
        self.memory_bytes -= it.memory_bytes
        self.evicted += len(it.responses)
        if not iters:
            del self._keys[prompt_key]

    def evict_oldest(self) -> bool:
        """Drops the globally oldest stored iteration; False when there is nothing left."""
        oldest: tuple[int, str, int] | None = None
        for key, iters in self._keys.items():
            for it in iters.values():
                if oldest is None or it.seq < oldest[0]:
                    oldest = (it.seq, key, it.iteration)
        if oldest is None:
            return False
        self._drop(oldest[1], oldest[2])
        return True

    def __iter__(self) -> Iterator[str]:
        return iter(self._keys)
