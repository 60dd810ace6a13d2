"""A submission is typed before its content is hashed for idempotency.

Before, content_hash ran on the groups as the in-process caller gave them: a numpy integer failed
json.dumps (a TypeError: INTERNAL at the server edge) before validation could type or name it, and
`seed=3` and `seed=3.0` were different content, so a retry spelling the seed the other way was
ALREADY_EXISTS. Now the groups are typed first (validation.typed_groups) and the typed groups are
hashed; well-typed input hashes as before (pinned below), and a batch an older buffer stored with
an odd spelling (hashed as sent) still matches its caller's retry. Real RocksDB, the buffer
restarted on its data dir, work items read through WatchWork over gRPC."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from buffer_helpers import BufferHandle, group, snapshot, submit

from services.buffer import codec, convert
from services.buffer.core import derive_seed
from services.buffer.records import GroupSpec, Sampling
from services.buffer.store import Store, batch_key
from services.buffer.validation import content_hash, legacy_content_hash, typed_groups
from services.common.errors import AlreadyExists, InvalidArgument


def _group(seed: Any = 3, stop_token_ids: tuple[Any, ...] = (), **kw: Any) -> GroupSpec:
    values: dict[str, Any] = {"prompt_key": "p", "prompt_token_ids": (1, 2, 3), "group_size": 2, "max_tokens": 8}
    values.update(kw)
    return GroupSpec(sampling=Sampling(temperature=1.0, top_k=2, seed=seed, stop_token_ids=stop_token_ids), **values)


def _seeds(buf: BufferHandle, batch_id: str) -> list[int]:
    items = sorted((it for it in snapshot(buf.internal) if it.batch_id == batch_id), key=lambda it: it.request_id)
    return [it.sampling.seed for it in items]


def test_a_numpy_integer_is_submitted_as_its_int(make_buffer: Callable[..., BufferHandle]) -> None:
    buf = make_buffer()
    odd = GroupSpec(prompt_key="p", prompt_token_ids=np.array([1, 2, 3]),  # type: ignore[arg-type]
                    group_size=np.int64(2), max_tokens=np.int32(8),  # type: ignore[arg-type]
                    sampling=Sampling(temperature=np.float64(1.0), top_k=np.int64(2), seed=np.uint64(3),  # type: ignore[arg-type]
                                      stop_token_ids=(np.int16(1),)))  # type: ignore[arg-type]
    # Before: TypeError "Object of type int64 is not JSON serializable" from content_hash (INTERNAL).
    out = buf.core.submit_batch("np", [odd])
    assert (out.num_requests, out.already_submitted) == (2, False)
    assert _seeds(buf, "np") == [derive_seed(3, "np", 0), derive_seed(3, "np", 1)]
    # The same content spelled with Python values is the same submission, also after a restart.
    plain = _group(stop_token_ids=(1,))
    assert buf.core.submit_batch("np", [plain]).already_submitted
    buf.stop()
    buf = make_buffer()
    assert buf.core.submit_batch("np", [odd]).already_submitted
    assert buf.core.submit_batch("np", [plain]).already_submitted
    assert list(buf.core._groups[("np", 0)].prompt_token_ids) == [1, 2, 3]
    with pytest.raises(AlreadyExists):
        buf.core.submit_batch("np", [_group(seed=np.uint64(4), stop_token_ids=(1,))])


def test_seed_3_and_3_0_are_one_content(make_buffer: Callable[..., BufferHandle]) -> None:
    buf = make_buffer()
    assert not buf.core.submit_batch("s", [_group(seed=3)]).already_submitted
    # Before: AlreadyExists "batch 's' was submitted before with different content".
    assert buf.core.submit_batch("s", [_group(seed=3.0)]).already_submitted
    assert buf.core.submit_batch("s", [_group(seed=3, prompt_token_ids=[1.0, 2, 3])]).already_submitted
    buf.stop()
    buf = make_buffer()
    assert buf.core.submit_batch("s", [_group(seed=3.0)]).already_submitted
    with pytest.raises(AlreadyExists):
        buf.core.submit_batch("s", [_group(seed=4.0)])
    with pytest.raises(InvalidArgument) as e:  # still typed: a fraction is no seed
        buf.core.submit_batch("s", [_group(seed=3.5)])
    assert e.value.field == "groups[0].sampling.seed"
    with pytest.raises(InvalidArgument) as e:
        buf.core.submit_batch("t", [_group(prompt_token_ids=(1, 2.5))])
    assert e.value.field == "groups[0].prompt_token_ids[1]"


def test_well_typed_submissions_hash_as_before(make_buffer: Callable[..., BufferHandle]) -> None:
    """Batches stored before typing came first keep matching their retries: a well-typed
    submission's hash is unchanged (the digests are the previous buffer's for this input)."""
    groups = [GroupSpec(prompt_key="p", prompt_token_ids=(1, 2, 3), group_size=2, max_tokens=8,
                        sampling=Sampling(temperature=0.7, top_p=0.9, top_k=5, seed=3, stop_token_ids=(4,)),
                        labels=(("a", "b"),)),
              GroupSpec(prompt_text="what is two", group_size=1, max_tokens=4)]
    assert typed_groups(groups) == groups
    assert content_hash("w", typed_groups(groups)) == \
        "62bb84a4e02998b66bc7b7b898e74f157361017ad11589c2bb64ad9a8ab68910"
    assert content_hash("w", typed_groups(groups), "scope-1") == \
        "7a84138b9936877b47fa6e8ac93042ab0b7a38336da4af234637bb058a4d1f05"
    # Over gRPC (protobuf types every field): the stored hash is the one of the groups as sent.
    buf = make_buffer()
    pb = [group(prompt_key="p", group_size=2), group(prompt_text="what is two", group_size=1)]
    submit(buf.rollout, "g", pb)
    assert buf.core._batches["g"].content_hash == legacy_content_hash("g", [convert.group_from_pb(g) for g in pb])
    assert submit(buf.rollout, "g", pb).already_submitted


def test_an_odd_spelling_an_older_buffer_stored_still_matches_its_retry(
        make_buffer: Callable[..., BufferHandle], tmp_path: Path) -> None:
    """An older buffer hashed the groups as sent: `seed=3.0, ignore_eos=1` stored that hash. The
    caller's retry after the upgrade, spelled the same way, is still already_submitted."""
    odd = [GroupSpec(prompt_key="p", prompt_token_ids=(1, 2, 3), group_size=2, max_tokens=8.0,  # type: ignore[arg-type]
                     sampling=Sampling(temperature=1, top_k=2, seed=3.0, ignore_eos=1))]  # type: ignore[arg-type]
    buf = make_buffer()
    buf.core.submit_batch("old", odd)
    buf.stop()
    legacy = legacy_content_hash("old", odd)
    assert legacy is not None and legacy != content_hash("old", typed_groups(odd))
    store = Store(tmp_path / "db")
    try:
        raw = store.get(batch_key("old"))
        assert raw is not None
        meta, arrays = codec.decode(raw)
        meta["content_hash"] = legacy  # as the older buffer stored it
        wb = store.new_batch()
        wb.put(batch_key("old"), codec.encode(meta, arrays))
        store.write(wb)
    finally:
        store.close()
    buf = make_buffer()
    assert buf.core.submit_batch("old", odd).already_submitted
    with pytest.raises(AlreadyExists):
        buf.core.submit_batch("old", [_group(seed=4)])
