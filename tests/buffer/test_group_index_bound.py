"""Group indexes are 6 zero-padded digits in the store's keys: a batch with more than 10**6 groups
(possible with max_requests_per_batch above that) would put keys out of numeric order, and a restart
rebuilds the scheduler's snapshot (FIFO) and GetBatch's request list in key order. Such a batch is
refused, RESOURCE_EXHAUSTED naming `groups`, before anything is built or stored."""

from __future__ import annotations

import pytest

from services.buffer import store as keys
from services.buffer.model import ModelInfo
from services.buffer.records import GroupSpec, Sampling
from services.buffer.validation import MAX_GROUP_SIZE, validate_batch
from services.common.errors import ResourceExhausted

MODEL = ModelInfo(vocab_size=1000, max_context=4096, tokenizer=None)
SPEC = GroupSpec(prompt_key="p", prompt_token_ids=(1, 2), group_size=1, max_tokens=4, sampling=Sampling(seed=1))


def test_a_batch_of_more_than_a_million_groups_is_refused() -> None:
    with pytest.raises(ResourceExhausted) as e:
        validate_batch("b", [SPEC] * 1_000_001, MODEL, max_requests=10_000_000)
    assert e.value.field == "groups" and "1000001 groups" in str(e.value) and "1000000" in str(e.value)
    # Counted before any group is checked (a million of them take seconds): an invalid group
    # does not decide the answer.
    bad = GroupSpec(prompt_key="p", prompt_token_ids=(1,), group_size=0, max_tokens=4, sampling=Sampling(seed=1))
    with pytest.raises(ResourceExhausted):
        validate_batch("b", [bad] + [SPEC] * 1_000_000, MODEL, max_requests=10_000_000)


def test_every_allowed_index_keeps_key_order_numeric() -> None:
    groups = [0, 1, 9, 10, 99_999, 100_000, 999_998, 999_999]  # up to MAX_GROUPS_PER_BATCH - 1
    samples = [0, 1, 9, 10, 999, MAX_GROUP_SIZE - 1]
    pairs = [(g, s) for g in groups for s in samples]
    by_key = sorted(pairs, key=lambda p: keys.request_key("b", *p))
    assert by_key == sorted(pairs)
    assert sorted(groups, key=lambda g: keys.group_key("b", g)) == groups
    # Chunk keys add the chunk's seq (8 digits) after the same two indexes: every (group, sample,
    # seq) triple sorts numerically, a request's chunks in seq order (a restart replays them so).
    seqs = [0, 1, 9, 10, 99_999, 100_000]
    triples = [(g, s, q) for g, s in pairs for q in seqs]
    assert sorted(triples, key=lambda t: keys.chunk_key("b", t[0], t[1], t[2])) == sorted(triples)
    # The first index the bound keeps out would sort among the 100,000s.
    assert keys.request_key("b", 1_000_000, 0) < keys.request_key("b", 999_999, 0)
