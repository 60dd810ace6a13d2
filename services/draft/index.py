"""Per-group suffix index: a multi-level n-gram hash index over the group's token sequences.

One GroupIndex holds everything one prompt group drafts from (DESIGN.md section 4): the prompt, every
sibling response (including the request's own output) and history responses of the same prompt key
from earlier iterations.

Structure (chosen by measurement, see services/draft/README.md): for each level k in `levels`
(default 1, 2, 4, 7), a dict maps the hash of a k-gram to the positions right after its occurrences
(`seq << 32 | pos`; a bare int while there is one occurrence, a list after). Ingest is a few dict
operations per token (~1.5 M tokens/s on this machine), drafting is one dict lookup per level plus
a walk over the candidate continuations, with no per-token tree nodes. Responses are stored with the
prompt's last tokens in front, so the first tokens of a response match across siblings too.

Drafting follows SuffixDecoding (Oliaro et al. 2024), RhymeRL's history matching (longest match
first, shorter ones as fall-backs) and Seer's multi-path drafts: among the occurrences of the longest
matched suffix, prob(child) = prob(parent) * count(child) / count(parent); a draft's score is the sum
of its token probabilities (expected accepted tokens); expansion stops below `min_token_prob`; the
draft length is capped at `max_spec_factor` (4) x match length. width > 1 expands best-first into a
top-k tree. Level 1 is PPM's order-1 escape: when no longer suffix drafts (a third of the steps of a
grouped + history replay have no 2-token match at all), the last token's most frequent continuation.
Its table is keyed by the token itself, so the fourth level costs less ingest than the others (2-token
appends as fast as before with three levels, measured side by side). At forks, counts are
source-aware: the requesting response's own occurrences count OWN_WEIGHT times, history ones
HISTORY_WEIGHT times (bench.spec_variants).
"""

from __future__ import annotations

import heapq
import math
from bisect import bisect_left
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import accumulate, islice
from operator import itemgetter

from services.common.errors import InvalidArgument

_POS_BITS = 32
_POS_MASK = (1 << _POS_BITS) - 1
DEFAULT_LEVELS: tuple[int, ...] = (1, 2, 4, 7)
# Occurrences of one n-gram considered per proposal (the most recent ones): bounds the walk for very
# frequent n-grams (e.g. "the" in the prompt), which are also the least predictive.
MAX_CANDIDATES = 16
PROMPT_SEQ = 0
# Source-aware counts (bench.spec_variants, tuned on one rollout set and checked on a held-out one):
# at a fork, an occurrence in the request's own output counts OWN_WEIGHT times (a response repeats
# its own phrasing more than its siblings' and earlier iterations'), one in a history response (an
# earlier policy version) HISTORY_WEIGHT times, the prompt and sibling responses once.
# T = 0.7, G = 16, grouped + history: +2% accepted tokens per step.
OWN_WEIGHT = 3.0
HISTORY_WEIGHT = 0.5
# memory_bytes() cost model, in bytes as tracemalloc counts them (CPython 3.11, 64-bit), fitted by
# least squares to indexes of 16 x 2,000-token responses appended 2 tokens at a time with fresh int
# objects (as gRPC hands them over), siblings differing in 0-100% of their tokens, and checked
# within +-10% there and against 2 and 64 siblings (tests/draft/test_index_memory.py asserts +-25%;
# its _measure is the script to refit with). An n-gram key costs what its occurrences never share:
# - TOKEN_BYTES per indexed token: its sequence list slot (over-allocated) and its int object.
# - KEY_BYTES per table key of a level >= 2: the dict entry with its share of the spare capacity
#   (a dict is 1/3 to 2/3 full), the 64-bit hash int key and its first occurrence, a bare int
#   beyond 2^32 (`seq << 32 | pos`). TOKEN_KEY_BYTES for level 1, keyed by the token object the
#   sequence already holds: the same without the key int.
# - ENTRY_BYTES per further occurrence of a key: its int and its slot in the occurrence list.
# - LIST_BYTES per occurrence list (a key with >= 2 occurrences): the list object.
# - SEQ_BYTES per sequence: its slots in the per-sequence lists, its request id and _by_request entry.
#   LEAD_TOKEN_BYTES per token of its prompt-tail lead, instead of TOKEN_BYTES: a list slot only
#   (the int objects are the prompt's).
# - INDEX_BYTES per index: the object and its empty tables and lists; PROMPT_TOKEN_BYTES per
#   prompt token for the prompt tuple (the list in _seqs shares its int objects).
# Distinct keys are len() of the tables and lists are counted where one is made or undone, so
# memory_bytes() stays O(1) and the ingest loop gains no per-token work.
TOKEN_BYTES = 36
KEY_BYTES = 104
TOKEN_KEY_BYTES = KEY_BYTES - 36
ENTRY_BYTES = 41
LIST_BYTES = 54
SEQ_BYTES = 170
LEAD_TOKEN_BYTES = 8
INDEX_BYTES = 1560
PROMPT_TOKEN_BYTES = 8
# The most one indexed position can add to one level: a new key, or a further occurrence that turns
# a bare int into a list (the bounds below charge it for every position and level).
POSITION_BYTES_BOUND = max(KEY_BYTES, ENTRY_BYTES + LIST_BYTES)


@dataclass(frozen=True)
class Proposal:
    """A draft: tokens[i] with parent index parents[i] (-1 = the last verified token)."""

    tokens: tuple[int, ...] = ()
    parents: tuple[int, ...] = ()
    score: float = 0.0  # expected accepted draft tokens (sum of node probabilities)
    match_len: int = 0  # length of the matched context suffix

    def __len__(self) -> int:
        return len(self.tokens)


EMPTY = Proposal()
_new = object.__new__


def _proposal(tokens: tuple[int, ...], parents: tuple[int, ...], score: float, match_len: int) -> Proposal:
    """Proposal(...) without the frozen dataclass's per-field object.__setattr__ (2.7 -> 1.5 us; a
    proposal costs ~15 us in all, and this runs once per request per decode step)."""
    prop: Proposal = _new(Proposal)
    prop.__dict__.update(tokens=tokens, parents=parents, score=score, match_len=match_len)
    return prop


# Parents of a chain of n tokens: (-1, 0, 1, ..., n - 2), built once per length.
_CHAIN_PARENTS: list[tuple[int, ...]] = [tuple(range(-1, n - 1)) for n in range(257)]


def _chain_parents(n: int) -> tuple[int, ...]:
    return _CHAIN_PARENTS[n] if n < len(_CHAIN_PARENTS) else tuple(range(-1, n - 1))


class GroupIndex:
    """Suffix index of one group. Not thread-safe; owners (DraftStore, DraftClient) lock around it."""

    def __init__(
        self,
        prompt_token_ids: Sequence[int] = (),
        *,
        max_depth: int = 64,
        levels: Sequence[int] = DEFAULT_LEVELS,
        max_spec_factor: float = 4.0,
        own_weight: float = OWN_WEIGHT,
        history_weight: float = HISTORY_WEIGHT,
    ) -> None:
        if not levels or any(k < 1 for k in levels):
            raise InvalidArgument("levels must be positive n-gram lengths", field="levels")
        self.levels: tuple[int, ...] = tuple(sorted(set(levels)))
        self.max_depth = max_depth
        self.max_spec_factor = max_spec_factor
        # Draft length cap per level: max_spec_factor x match length (SuffixDecoding).
        self._caps = [max(1, math.ceil(max_spec_factor * k)) for k in self.levels]
        self._tables: list[dict[int, int | list[int]]] = [{} for _ in self.levels]
        self._level_tables = tuple(zip(self.levels, self._tables, strict=True))  # the ingest loop's pairs
        self._seqs: list[list[int]] = []
        self._bases: list[int] = []  # leading prompt-tail tokens of each sequence (not appended)
        self._weights: list[float] = []  # count weight of each sequence's occurrences (by source)
        self.own_weight = own_weight
        self.history_weight = history_weight
        self._by_request: dict[str, int] = {}
        self._history: list[int] = []
        self.prompt: tuple[int, ...] = tuple(int(t) for t in prompt_token_ids)
        self._lead = list(self.prompt[-(self.levels[-1] - 1):]) if self.levels[-1] > 1 else []
        self.indexed_tokens = 0
        self.entries = 0
        self.lists = 0  # table values that are occurrence lists (keys with >= 2 occurrences)
        self._lead_tokens = 0  # of indexed_tokens, the sequences' leads (sharing the prompt's ints)
        # Slots of sequences truncated to 0 (no entry refers to them any more): the next new
        # sequence takes one, so resume cycles (truncate to 0, append again) do not grow _seqs.
        self._free: list[int] = []
        self._new_seq(list(self.prompt), base=0)

    # ---- ingest ---------------------------------------------------------------------------------

    def _new_seq(self, tokens: list[int], base: int, weight: float = 1.0) -> int:
        if self._free:
            s = self._free.pop()
            self._seqs[s] = []
            self._bases[s] = base
            self._weights[s] = weight
        else:
            s = len(self._seqs)
            self._seqs.append([])
            self._bases.append(base)
            self._weights.append(weight)
        self._lead_tokens += base
        self._extend(s, tokens)
        return s

    def _extend(self, s: int, tokens: Sequence[int]) -> None:
        seq = self._seqs[s]
        old = len(seq)
        seq.extend(tokens)
        new = len(seq)
        if new == old:
            return
        hi = s << _POS_BITS
        # Positions inside the prompt-tail lead would duplicate the prompt's own entries.
        base = self._bases[s]
        start = old + 1 if old >= base else base
        entries = 0
        lists = 0  # occurrence lists made (a key's second occurrence; once per key, off the common path)
        for k, table in self._level_tables:
            # Entry p = the k-gram seq[p-k:p], continuation at p. p == old was indexed by the last call.
            lo = k if k > start else start
            get = table.get
            if k == 1:
                # Level 1 is keyed by the token itself (no tuple, no hash call). The insertion is
                # written out twice so that neither loop pays a per-token branch.
                for p in range(lo, new + 1):
                    key = seq[p - 1]
                    v = get(key)
                    if v is None:
                        table[key] = hi | p
                    elif type(v) is int:
                        table[key] = [v, hi | p]
                        lists += 1
                    else:
                        v.append(hi | p)  # type: ignore[union-attr]
            else:
                for p in range(lo, new + 1):
                    key = hash(tuple(seq[p - k : p]))
                    v = get(key)
                    if v is None:
                        table[key] = hi | p
                    elif type(v) is int:
                        table[key] = [v, hi | p]
                        lists += 1
                    else:
                        v.append(hi | p)  # type: ignore[union-attr]
            if new >= lo:
                entries += new + 1 - lo
        self.entries += entries
        self.lists += lists
        self.indexed_tokens += new - old

    def append(self, request_id: str, offset: int, token_ids: Sequence[int]) -> int:
        """Appends token_ids at response position `offset`; returns how many tokens were new.

        Idempotent by offset: tokens already present (a retried or reordered append) are checked and
        skipped. A gap (offset beyond the current length) or an overlap with different tokens raises
        InvalidArgument and leaves the index unchanged.
        """
        if offset < 0:
            raise InvalidArgument(f"must be >= 0, got {offset}", field="offset")
        s = self._by_request.get(request_id)
        have = 0 if s is None else len(self._seqs[s]) - self._bases[s]
        if offset > have:
            raise InvalidArgument(
                f"gap: request {request_id!r} has {have} tokens, append starts at {offset}", field="offset"
            )
        overlap = min(have - offset, len(token_ids))
        if overlap and s is not None:
            b = self._bases[s] + offset
            existing = self._seqs[s][b : b + overlap]
            if existing != list(token_ids[:overlap]):
                raise InvalidArgument(
                    f"overlap with different tokens for request {request_id!r} at offset {offset}",
                    field="token_ids",
                )
        fresh = list(map(int, token_ids[overlap:]))
        if not fresh:
            return 0
        if s is None:
            s = self._new_seq(list(self._lead), base=len(self._lead))
            self._by_request[request_id] = s
        self._extend(s, fresh)
        return len(fresh)

    def truncate(self, request_id: str, offset: int) -> int:
        """Drops the response's tokens at or after `offset`; returns how many were dropped.

        Exact: every index entry those tokens created is removed (a list left with one occurrence
        becomes a bare int again, the order of the others is kept), so the index is the same as if
        they had never been appended. Truncating to 0 forgets the response entirely (a later
        append starts a new sequence, as a first append would). Cost: k dict operations per
        dropped token and level, like appending them. Used when a request resumes from its
        committed output after a failed attempt (draft.proto AppendRequest.truncate).
        """
        if offset < 0:
            raise InvalidArgument(f"must be >= 0, got {offset}", field="offset")
        s = self._by_request.get(request_id)
        if s is None:
            return 0
        seq = self._seqs[s]
        base = self._bases[s]
        cut = base + offset
        old = len(seq)
        if cut >= old:
            return 0
        hi = s << _POS_BITS
        # Entries p in [max(k, cut + 1), old] have a k-gram or continuation in the dropped tail; the
        # entry at p == cut stays (its continuation is the next append). Truncating to 0 also drops
        # p == base, the lead's entry, which _new_seq adds again for a fresh sequence.
        first = cut + 1 if offset else base
        for k, table in zip(self.levels, self._tables, strict=True):
            # The dropped entries per key, then each occurrence list rebuilt once (order kept: the
            # newest occurrences are the candidates). One list.remove per entry scanned the list
            # from the front for entries that are mostly at its end: dropping 4K tokens of a
            # 16 x 32K group took 1.5 s under the draft server's lock (session-22 review).
            drop: dict[int, set[int]] = {}
            for p in range(max(k, first), old + 1):
                key = seq[p - 1] if k == 1 else hash(tuple(seq[p - k : p]))
                drop.setdefault(key, set()).add(hi | p)
            for key, codes in drop.items():
                v = table[key]
                if type(v) is int:
                    del table[key]  # its one occurrence is the one dropped
                else:
                    kept = [c for c in v if c not in codes]  # type: ignore[union-attr]
                    if not kept:
                        del table[key]
                        self.lists -= 1
                    elif len(kept) == 1:
                        table[key] = kept[0]
                        self.lists -= 1
                    else:
                        v[:] = kept  # type: ignore[index]
                self.entries -= len(codes)
        dropped = old - cut
        self.indexed_tokens -= dropped
        if offset:
            del seq[cut:]
        else:
            self.indexed_tokens -= base
            self._lead_tokens -= base
            self._seqs[s] = []
            del self._by_request[request_id]
            self._free.append(s)  # nothing refers to s now (its lead's entry went too)
        return dropped

    def replace_from(self, request_id: str, offset: int, token_ids: Sequence[int]) -> tuple[int, int]:
        """Makes the response exactly its first `offset` tokens + token_ids with the least work:
        the tokens already equal are kept, the rest of the old tail is truncated, the new tail
        appended. Returns (dropped, appended); (0, 0) for a retry. A gap raises InvalidArgument."""
        if offset < 0:
            raise InvalidArgument(f"must be >= 0, got {offset}", field="offset")
        have = self.length(request_id)
        if offset > have:
            raise InvalidArgument(
                f"gap: request {request_id!r} has {have} tokens, append starts at {offset}", field="offset"
            )
        toks = [int(t) for t in token_ids]
        same = common_prefix(self.tokens_at(request_id, offset, len(toks)), toks)
        dropped = self.truncate(request_id, offset + same)
        added = self.append(request_id, offset + same, toks[same:]) if same < len(toks) else 0
        return dropped, added

    def add_history(self, token_ids: Sequence[int]) -> None:
        """Adds a response of an earlier iteration for the same prompt (RhymeRL HistoSpec)."""
        s = self._new_seq([*self._lead, *(int(t) for t in token_ids)], base=len(self._lead),
                          weight=self.history_weight)
        self._history.append(s)

    def history_tokens(self, n: int | None = None) -> list[tuple[int, ...]]:
        """The first n history responses added (all when None), as added (copies)."""
        ids = self._history if n is None else self._history[:n]
        return [tuple(self._seqs[s][self._bases[s] :]) for s in ids]

    def length(self, request_id: str) -> int:
        s = self._by_request.get(request_id)
        return 0 if s is None else len(self._seqs[s]) - self._bases[s]

    def tokens(self, request_id: str) -> list[int]:
        s = self._by_request.get(request_id)
        return [] if s is None else self._seqs[s][self._bases[s] :]

    def tokens_at(self, request_id: str, offset: int, n: int) -> list[int]:
        """Up to n tokens of the response from `offset` (without copying the whole response)."""
        s = self._by_request.get(request_id)
        if s is None:
            return []
        b = self._bases[s] + offset
        return self._seqs[s][b : b + n]

    def request_ids(self) -> list[str]:
        return list(self._by_request)

    @property
    def num_sequences(self) -> int:
        return len(self._seqs)

    @property
    def num_history(self) -> int:
        return len(self._history)

    def memory_bytes(self) -> int:
        """Estimated resident bytes (the cost model at TOKEN_BYTES; within +-25% of tracemalloc for
        similar and dissimilar siblings, tests/draft/test_index_memory.py). O(1): distinct keys are
        the tables' len(), the other counts are kept as it changes."""
        keys = token_keys = 0
        for k, table in self._level_tables:
            if k == 1:
                token_keys = len(table)
            else:
                keys += len(table)
        return (INDEX_BYTES + len(self.prompt) * PROMPT_TOKEN_BYTES
                + (self.indexed_tokens - self._lead_tokens) * TOKEN_BYTES + self._lead_tokens * LEAD_TOKEN_BYTES
                + keys * KEY_BYTES + token_keys * TOKEN_KEY_BYTES + (self.entries - keys - token_keys) * ENTRY_BYTES
                + self.lists * LIST_BYTES + len(self._seqs) * SEQ_BYTES)

    def append_bytes_bound(self, start: int, n: int) -> int:
        """An upper bound of the memory_bytes() growth from n new tokens of a response at position
        `start` (where they go once any truncation is done): the store makes room for it before the
        append. At 0 the response is a new sequence (its first append, or one truncated to 0)."""
        if n <= 0:
            return 0
        if start == 0:
            return sequences_bytes_bound(self.levels, len(self._lead), 1, n)
        return n * (TOKEN_BYTES + len(self.levels) * POSITION_BYTES_BOUND)

    def truncate_bytes_floor(self, n: int) -> int:
        """A lower bound of the memory_bytes() drop from truncating n tokens of a response: each
        token, and for each dropped position of the shortest level (all but its first k - 1
        positions of a sequence can be dropped ones) the least a dropped occurrence frees: a further
        occurrence (ENTRY_BYTES; a key's last one frees its key, more)."""
        if n <= 0:
            return 0
        return n * TOKEN_BYTES + max(0, n - self.levels[0] + 1) * ENTRY_BYTES

    def history_bytes_bound(self, count: int, tokens: int) -> int:
        """An upper bound of the memory_bytes() growth from add_history of `count` responses of
        `tokens` tokens in all."""
        return sequences_bytes_bound(self.levels, len(self._lead), count, tokens)

    def all_continuations(self, context: Sequence[int], k: int, max_len: int) -> list[list[int]]:
        """Every continuation (up to max_len tokens) of every occurrence of the context's last k
        tokens, uncapped: the candidate set of the ideal offline replay in bench.spec."""
        if k not in self.levels or len(context) < k:
            return []
        v = self._tables[self.levels.index(k)].get(_key(context, k))
        if v is None:
            return []
        codes = [v] if type(v) is int else v
        out = []
        for c in codes:  # type: ignore[union-attr]
            seq = self._seqs[c >> _POS_BITS]
            p = c & _POS_MASK
            if p < len(seq) and seq[p - k : p] == list(context[len(context) - k :]):
                out.append(seq[p : p + max_len])
        return out

    # ---- drafting -------------------------------------------------------------------------------

    def _continuations(self, level: int, context: Sequence[int], cap: int,
                       own: int) -> tuple[list[list[int]], list[float] | None]:
        """Sorted continuations (up to `cap` tokens) of the occurrences of the context's last k-gram,
        with their source weights (None: all 1, the plain counts; `own` = the requesting sequence).

        Sorting puts continuations that share a prefix next to each other, so the walk below works on
        index ranges and C-level slicing and comparisons instead of per-token Python. This slicing
        (one list per occurrence, ~0.3 us each here) is most of a proposal's cost.
        """
        k = self.levels[level]
        n = len(context)
        v = self._tables[level].get(context[n - 1] if k == 1 else hash(tuple(context[n - k :])))
        if v is None:
            return [], None
        seqs = self._seqs
        if type(v) is int:
            p = v & _POS_MASK
            c = seqs[v >> _POS_BITS][p : p + cap]
            return ([c] if c else []), None
        mask = _POS_MASK
        bits = _POS_BITS
        codes: list[int] = v[-MAX_CANDIDATES:]  # type: ignore[index]
        conts = [seqs[c >> bits][(c & mask) : (c & mask) + cap] for c in codes]
        # An occurrence at a sequence's end has no continuation yet: the empty lists sort first and
        # the walks skip them like any ended continuation; only "all empty" is no candidate at all.
        if own < 0 and not self._history:
            conts.sort()
            return (conts if conts[-1] else []), None
        weights = self._weights
        own_w = self.own_weight
        ws = [own_w if c >> bits == own else weights[c >> bits] for c in codes]
        if ws.count(1.0) == len(ws):
            conts.sort()
            return (conts if conts[-1] else []), None
        order = sorted(range(len(conts)), key=conts.__getitem__)  # stable: equal ones by recency
        last = conts[order[-1]]
        if not last:
            return [], None
        return [conts[i] for i in order], [ws[i] for i in order]

    def propose(
        self,
        context: Sequence[int],
        max_len: int,
        *,
        width: int = 1,
        min_token_prob: float = 0.1,
        request_id: str | None = None,
    ) -> Proposal:
        """Best draft for `context` (the request's prompt + output so far).

        Tries the longest n-gram level first; stops at the first level with a draft (see below).
        `request_id` names the requesting response: its own occurrences count `own_weight` times.
        """
        if max_len <= 0 or not context:
            return EMPTY
        if max_len > self.max_depth:
            max_len = self.max_depth
        best = EMPTY
        n = len(context)
        tried = 0
        levels = self.levels
        own = -1 if request_id is None else self._by_request.get(request_id, -1)
        for level in range(len(levels) - 1, -1, -1):
            k = levels[level]
            if n < k or (k == 1 and best.tokens):
                continue
            if k > 1 and tried >= 2:
                continue  # only the order-1 escape is left to try
            cap = self._caps[level]
            if cap > max_len:
                cap = max_len
            conts, ws = self._continuations(level, context, cap, own)
            if not conts:
                continue
            prop = (_linear(conts, ws, cap, min_token_prob, k) if width <= 1
                    else _tree(conts, ws, cap, width, min_token_prob, k))
            if prop.score > best.score:
                best = prop
            tried += 1
            # Longest match first (RhymeRL: the last 7, then 4 tokens); a shorter match is only tried
            # when the longer one yields no draft, and at most two levels >= 2 with occurrences are
            # evaluated. Measured on bench.spec rollouts: trying shorter levels after a non-empty
            # draft (keeping the best score) changed acceptance by < 0.1% and doubled the tail;
            # backing off to a shorter level when the longest has few occurrences (PPM style)
            # lowered acceptance (T = 0.7, G = 16, with history: 2.21 -> 2.14-2.18), and so did
            # mixing all match depths with weights growing with the match length (bench.spec_variants).
            # A level of 1 is PPM's order-1 escape: tried whenever no longer match drafted. A third
            # of the steps of a grouped + history replay have no 2-token match at all, and the most
            # frequent continuation of the last token alone still gives accepted tokens there
            # (T = 0.7, G = 16: 1.91 -> 2.03 per step).
            if prop.tokens:
                break
        return best


def sequences_bytes_bound(levels: Sequence[int], lead: int, count: int, tokens: int) -> int:
    """An upper bound of GroupIndex.memory_bytes() growth from `count` new sequences holding `tokens`
    tokens in all, each behind a copy of `lead` prompt tokens (_new_seq): per sequence its slot, its
    lead's tokens and at most one entry per level for the lead (the entry at p == lead; the lead's
    other positions are the prompt's own entries), and per token its slot and at most one entry
    per level, each at the most one position can add (POSITION_BYTES_BOUND: a new key, or a new
    occurrence list). Kept next to memory_bytes() so the two cannot drift apart."""
    per_level = len(levels) * POSITION_BYTES_BOUND
    return count * (SEQ_BYTES + lead * TOKEN_BYTES + per_level) + tokens * (TOKEN_BYTES + per_level)


def new_index_bytes_bound(levels: Sequence[int], prompt_len: int, history_count: int, history_tokens: int) -> int:
    """An upper bound of memory_bytes() of GroupIndex(prompt, levels=levels) after add_history of
    `history_count` responses of `history_tokens` tokens in all (the prompt is a sequence without a
    lead; its tail is every other sequence's lead)."""
    lead = min(prompt_len, max(levels) - 1)
    return (INDEX_BYTES + prompt_len * PROMPT_TOKEN_BYTES + sequences_bytes_bound(levels, 0, 1, prompt_len)
            + sequences_bytes_bound(levels, lead, history_count, history_tokens))


def _key(tokens: Sequence[int], k: int) -> int:
    """Table key of the last k tokens: the token itself for k == 1, else the hash of the k-gram."""
    n = len(tokens)
    return int(tokens[n - 1]) if k == 1 else hash(tuple(tokens[n - k :]))


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the common prefix. The usual case on resume, one a prefix of the other, is a
    single C-level list comparison (~100x faster than the loop for a long output)."""
    n = min(len(a), len(b))
    if list(a[:n]) == list(b[:n]):
        return n
    i = 0
    while a[i] == b[i]:
        i += 1
    return i


def _children(conts: list[list[int]], ws: list[float] | None, lo: int, hi: int, d: int,
              top: int) -> tuple[float, list[tuple[int, int, int, float]]]:
    """The `top` most frequent children at depth d of the node whose continuations are conts[lo:hi]
    (sorted; all share a d-token prefix). Plain counts: Counter over itemgetter and bisect on the
    sorted list, at C speed; source weights (ws): one scan over the runs of equal tokens.

    Returns (total count or weight of continuations with a child, [(token, start, end, count or
    weight)] most frequent first).
    """
    while lo < hi and len(conts[lo]) <= d:  # ended continuations (prefixes) sort first
        lo += 1
    if lo >= hi:
        return 0, []
    if ws is not None:
        runs = []
        i = lo
        while i < hi:
            tok = conts[i][d]
            j = i + 1
            while j < hi and conts[j][d] == tok:
                j += 1
            runs.append((tok, i, j, sum(ws[i:j])))
            i = j
        runs.sort(key=lambda r: -r[3])  # stable: ties keep the smaller token first
        return sum(ws[lo:hi]), runs[:top]
    counts = Counter(map(itemgetter(d), islice(conts, lo, hi)))
    prefix = conts[lo][:d]
    out = []
    for tok, _n in counts.most_common(top):
        a = bisect_left(conts, [*prefix, tok], lo, hi)
        b = bisect_left(conts, [*prefix, tok + 1], a, hi)
        out.append((tok, a, b, float(b - a)))
    return hi - lo, out


def _linear(conts: list[list[int]], ws: list[float] | None, cap: int, min_prob: float, match_len: int) -> Proposal:
    """Greedy most-frequent path over the sorted continuations (counts weighted by source when ws).

    conts[lo:hi] always share the d-token path prefix, so the children at depth d are contiguous
    runs of equal conts[i][d]: one scan over at most MAX_CANDIDATES entries counts them (no Counter,
    no bisect; ~4x cheaper on the forks that make the latency tail). Ties go to the smallest token
    (the first run), as before.
    """
    tokens: list[int] = []
    score = 0.0
    prob = 1.0
    lo, hi = 0, len(conts)
    d = 0
    cum: list[float] | None = None
    while d < cap:
        while lo < hi and len(conts[lo]) <= d:  # ended continuations (prefixes) sort first
            lo += 1
        if lo >= hi:
            break
        first, last = conts[lo], conts[hi - 1]
        if first[d] == last[d]:
            # Sorted: the first and last continuation agree at d, so all do (ratio 1). Take the
            # whole common run at once.
            e = d + 1
            m = min(len(first), cap)
            while e < m and first[e] == last[e]:
                e += 1
            tokens.extend(first[d:e])
            score += prob * (e - d)
            d = e
            continue
        best_a = best_n = 0
        i = lo
        if ws is None:
            while i < hi:
                tok = conts[i][d]
                j = i + 1
                while j < hi and conts[j][d] == tok:
                    j += 1
                if j - i > best_n:
                    best_a, best_n = i, j - i
                i = j
            prob *= best_n / (hi - lo)
        else:
            if cum is None:
                cum = [0.0, *accumulate(ws)]  # weight of conts[i:j] = cum[j] - cum[i]
            best_w = 0.0
            while i < hi:
                tok = conts[i][d]
                j = i + 1
                while j < hi and conts[j][d] == tok:
                    j += 1
                w = cum[j] - cum[i]
                if w > best_w:
                    best_a, best_n, best_w = i, j - i, w
                i = j
            prob *= best_w / (cum[hi] - cum[lo])
        if prob < min_prob:
            break
        tokens.append(conts[best_a][d])
        score += prob
        lo, hi = best_a, best_a + best_n
        d += 1
    return _proposal(tuple(tokens), _chain_parents(len(tokens)), score, match_len)


def _tree(conts: list[list[int]], ws: list[float] | None, cap: int, width: int, min_prob: float,
          match_len: int) -> Proposal:
    """Best-first top-`width` tree (SuffixDecoding tree speculation, Seer multi-path drafts).

    Nodes are expanded in order of path probability; at most `width` children per node, depth <= cap,
    and at most cap * width nodes (the token budget of `width` linear paths). Parents precede children.
    """
    budget = cap * width
    tokens: list[int] = []
    parents: list[int] = []
    score = 0.0
    # heap of (-path prob, tiebreak, parent index, depth, token, range of continuations below it)
    heap: list[tuple[float, int, int, int, int, int, int]] = []
    tie = 0

    def push_children(lo: int, hi: int, d: int, prob: float, parent: int) -> None:
        nonlocal tie
        total, runs = _children(conts, ws, lo, hi, d, width)
        for tok, a, b, w in runs:
            child_prob = prob * w / total
            if child_prob < min_prob:
                break
            tie += 1
            heapq.heappush(heap, (-child_prob, tie, parent, d, tok, a, b))

    push_children(0, len(conts), 0, 1.0, -1)
    while heap and len(tokens) < budget:
        neg_prob, _t, parent, d, tok, a, b = heapq.heappop(heap)
        idx = len(tokens)
        tokens.append(tok)
        parents.append(parent)
        score -= neg_prob
        if d + 1 < cap:
            push_children(a, b, d + 1, -neg_prob, idx)
    return _proposal(tuple(tokens), tuple(parents), score, match_len)
