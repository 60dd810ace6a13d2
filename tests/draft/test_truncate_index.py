"""GroupIndex.truncate / replace_from: exact removal, checked against a freshly built index.

The property: after any interleaving of appends, history and truncates, the index (its n-gram
tables including the order of occurrences, its counters and every proposal) is the same as an
index built from scratch by replaying only the surviving tokens, in their original order.
"""

from __future__ import annotations

import random
from typing import Any

import pytest

from services.common.errors import InvalidArgument
from services.draft.index import _POS_BITS, _POS_MASK, GroupIndex


def _owners(idx: GroupIndex) -> dict[int, str]:
    names = {0: "prompt"}
    for rid, s in idx._by_request.items():
        names[s] = f"req:{rid}"
    for i, s in enumerate(idx._history):
        names[s] = f"hist:{i}"
    return names


def canonical(idx: GroupIndex) -> list[dict[int, Any]]:
    """Tables with sequence numbers replaced by owner names (a re-created response gets another
    number) and positions made relative to the response start; int-vs-list kept as is."""
    names = _owners(idx)

    def name(code: int) -> tuple[str, int]:
        s = code >> _POS_BITS
        return names[s], (code & _POS_MASK) - idx._bases[s]

    out = []
    for table in idx._tables:
        out.append({key: (name(v) if type(v) is int else [name(c) for c in v])  # type: ignore[union-attr]
                    for key, v in table.items()})
    return out


def _random_ops(rng: random.Random, n_ops: int) -> list[tuple[str, Any]]:
    """Appends (per request, contiguous), history, truncates, in a random interleaving. A small
    alphabet makes repeated n-grams (lists of occurrences) common."""
    lengths: dict[str, int] = {}
    ops: list[tuple[str, Any]] = []
    for _ in range(n_ops):
        r = rng.random()
        rid = rng.choice("abcd")
        if r < 0.6:
            toks = [rng.randrange(6) for _ in range(rng.randint(1, 5))]
            ops.append(("append", (rid, lengths.get(rid, 0), toks)))
            lengths[rid] = lengths.get(rid, 0) + len(toks)
        elif r < 0.7:
            ops.append(("history", [rng.randrange(6) for _ in range(rng.randint(0, 8))]))
        else:
            have = lengths.get(rid, 0)
            off = rng.randint(0, have + 1)  # beyond the end: a no-op
            ops.append(("truncate", (rid, off)))
            lengths[rid] = min(have, off)
    return ops


def _apply(idx: GroupIndex, ops: list[tuple[str, Any]]) -> None:
    for kind, arg in ops:
        if kind == "append":
            idx.append(*arg)
        elif kind == "history":
            idx.add_history(arg)
        else:
            idx.truncate(*arg)


def _surviving(ops: list[tuple[str, Any]]) -> list[tuple[str, Any]]:
    """The ops with every token a later truncate drops removed (and no truncates)."""
    out: list[list[Any]] = []  # mutable [kind, arg]
    for kind, arg in ops:
        if kind == "truncate":
            rid, off = arg
            for op in out:
                if op[0] == "append" and op[1][0] == rid:
                    r, o, toks = op[1]
                    op[1] = (r, o, toks[: max(0, off - o)])
        else:
            out.append([kind, arg])
    return [(k, a) for k, a in out if k != "append" or a[2]]


@pytest.mark.parametrize("seed", range(40))
def test_truncate_equals_fresh_build(seed: int) -> None:
    rng = random.Random(seed)
    prompt = [rng.randrange(6) for _ in range(rng.randint(0, 9))]
    levels = rng.choice([(2, 4, 7), (1, 3), (2,)])
    ops = _random_ops(rng, 60)
    idx = GroupIndex(prompt, levels=levels)
    _apply(idx, ops)
    fresh = GroupIndex(prompt, levels=levels)
    _apply(fresh, _surviving(ops))
    assert canonical(idx) == canonical(fresh)
    assert idx.entries == fresh.entries
    assert idx.indexed_tokens == fresh.indexed_tokens
    for rid in "abcd":
        assert idx.tokens(rid) == fresh.tokens(rid)
    for _ in range(30):
        ctx = [rng.randrange(6) for _ in range(rng.randint(1, 10))]
        for width in (1, 3):
            assert idx.propose(ctx, 8, width=width) == fresh.propose(ctx, 8, width=width)


def test_truncate_then_append_continues_and_to_zero_forgets() -> None:
    idx = GroupIndex([1, 2, 3])
    idx.append("r", 0, [4, 5, 6, 7, 8])
    assert idx.truncate("r", 9) == 0 and idx.truncate("x", 0) == 0
    assert idx.truncate("r", 2) == 3
    assert idx.tokens("r") == [4, 5] and idx.length("r") == 2
    idx.append("r", 2, [9])  # the new attempt's tokens are accepted
    assert idx.tokens("r") == [4, 5, 9]
    assert idx.propose([1, 2, 3, 4, 5], 4).tokens == (9,)
    assert idx.truncate("r", 0) == 3
    assert "r" not in idx.request_ids() and idx.propose([1, 2, 3, 4, 5], 4).tokens == ()
    assert idx.entries == GroupIndex([1, 2, 3]).entries
    with pytest.raises(InvalidArgument) as e:
        idx.truncate("r", -1)
    assert e.value.field == "offset"


def test_replace_from_minimal_and_idempotent() -> None:
    idx = GroupIndex([1, 2, 3])
    idx.append("r", 0, [4, 5, 6, 7, 8])
    assert idx.replace_from("r", 0, [4, 5, 6, 7, 8]) == (0, 0)  # a retry
    assert idx.replace_from("r", 1, [5, 6]) == (2, 0)  # committed output shorter: the tail goes
    assert idx.replace_from("r", 0, [4, 5, 6, 10]) == (0, 1)
    assert idx.tokens("r") == [4, 5, 6, 10]
    with pytest.raises(InvalidArgument) as e:
        idx.replace_from("r", 9, [1])
    assert e.value.field == "offset"


def test_reviewer_stale_continuation_is_gone() -> None:
    """/tmp/review/stale_draft.py: the re-dispatched chunk must not get the dead attempt's tokens."""
    rng = random.Random(1)
    prompt = [rng.randrange(1000) for _ in range(20)]
    committed = [rng.randrange(1000) for _ in range(30)]
    dead = [rng.randrange(1000) for _ in range(40)]
    g = GroupIndex(prompt)
    g.append("r", 0, committed + dead)
    assert g.propose(prompt + committed, 8, request_id="r").tokens == tuple(dead[:8])  # the bug's premise
    g.replace_from("r", 0, committed)  # what the worker's resume does
    assert g.propose(prompt + committed, 8, request_id="r").tokens == ()
    assert g.append("r", len(committed), [7, 7, 7]) == 3
