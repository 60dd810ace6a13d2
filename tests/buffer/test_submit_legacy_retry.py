"""A retry of a batch an older buffer stored is already_submitted, also when this buffer would refuse
the submission now.

Typing (validation.typed_groups) runs before the stored-batch lookup, and it refuses spellings an
older buffer accepted and stored, hashed as sent (top_k=True, group_size=True): such a retry was
INVALID_ARGUMENT for a batch that is stored and running. And the MAX_STOP_TOKENS bound had moved into
typing, so a batch stored with more stop tokens (by a buffer without the bound) was refused at its
retry too. Now a refused typing still finds a stored batch whose hash is that of the groups as sent,
and the stop-token bound is checked after the lookup. Real RocksDB; the records are rewritten as the
older buffer wrote them, the buffer restarted on its data dir."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from buffer_helpers import BufferHandle

from services.buffer import codec, validation
from services.buffer.records import GroupSpec, Sampling
from services.buffer.store import Store, batch_key, group_key
from services.buffer.validation import legacy_content_hash
from services.common.errors import AlreadyExists, InvalidArgument


def _spec(sampling: dict[str, Any] | None = None, **group: Any) -> GroupSpec:
    g: dict[str, Any] = {"prompt_key": "p", "prompt_token_ids": (1, 2, 3), "group_size": 2, "max_tokens": 8}
    g.update(group)
    s: dict[str, Any] = {"temperature": 1.0, "top_k": 2, "seed": 3}
    s.update(sampling or {})
    return GroupSpec(sampling=Sampling(**s), **g)


def _store_as_older_buffer(data_dir: Path, batch_id: str, sent: list[GroupSpec],
                           group_meta: dict[str, Any] | None = None,
                           sampling_meta: dict[str, Any] | None = None) -> None:
    """The records an older buffer wrote for `sent`: the batch's hash of the groups as sent, the
    group's fields as they came."""
    legacy = legacy_content_hash(batch_id, sent)
    assert legacy is not None
    store = Store(data_dir)
    try:
        wb = store.new_batch()
        raw = store.get(batch_key(batch_id))
        assert raw is not None
        meta, arrays = codec.decode(raw)
        meta["content_hash"] = legacy
        wb.put(batch_key(batch_id), codec.encode(meta, arrays))
        raw = store.get(group_key(batch_id, 0))
        assert raw is not None
        meta, arrays = codec.decode(raw)
        meta.update(group_meta or {})
        meta["sampling"].update(sampling_meta or {})
        wb.put(group_key(batch_id, 0), codec.encode(meta, arrays))
        store.write(wb)
    finally:
        store.close()


@pytest.mark.parametrize(("odd", "group_meta", "sampling_meta"), [
    (_spec({"top_k": True}), {}, {"top_k": True}),
    (_spec({"seed": True}), {}, {"seed": True}),
    (_spec({"temperature": True}), {}, {"temperature": True}),
    (_spec(group_size=True), {"group_size": True}, {}),
    (_spec(max_tokens=True), {"max_tokens": True}, {}),
], ids=["top_k", "seed", "temperature", "group_size", "max_tokens"])
def test_a_spelling_typing_refuses_is_still_already_submitted(
        make_buffer: Callable[..., BufferHandle], tmp_path: Path, odd: GroupSpec, group_meta: dict[str, Any],
        sampling_meta: dict[str, Any]) -> None:
    buf = make_buffer()
    # The same content, well typed (True is 1): what the older buffer's records hold, but for the
    # spelling, rewritten below.
    plain = _spec({k: int(v) for k, v in sampling_meta.items()}, **{k: int(v) for k, v in group_meta.items()})
    buf.core.submit_batch("old", [plain])
    buf.stop()
    _store_as_older_buffer(tmp_path / "db", "old", [odd], group_meta, sampling_meta)
    buf = make_buffer()
    # Before: InvalidArgument "groups[0]...: must be an integer, got bool True" (or "a number").
    out = buf.core.submit_batch("old", [odd])
    assert out.already_submitted and out.num_requests == buf.core._batches["old"].num_requests
    # Still refused, naming the field: a new batch so spelled, and a stored id with other content.
    with pytest.raises(InvalidArgument) as e:
        buf.core.submit_batch("new", [odd])
    assert e.value.field is not None and e.value.field.startswith("groups[0].")
    assert "new" not in buf.core._batches
    other = _spec({"top_k": True, "seed": 4}) if "seed" not in sampling_meta else _spec({"seed": True, "top_k": 5})
    with pytest.raises(InvalidArgument):
        buf.core.submit_batch("old", [other])


def test_more_stop_tokens_than_the_bound_stored_before_it_is_already_submitted(
        make_buffer: Callable[..., BufferHandle], monkeypatch: pytest.MonkeyPatch) -> None:
    stop = (1,) * (validation.MAX_STOP_TOKENS + 75)
    group = _spec({"stop_token_ids": stop})
    buf = make_buffer()
    with monkeypatch.context() as m:
        m.setattr(validation, "MAX_STOP_TOKENS", 4096)  # the older buffer's bound (or none)
        buf.core.submit_batch("many", [group])
    buf.stop()
    buf = make_buffer()
    # Before: InvalidArgument "groups[0].sampling.stop_token_ids: at most 1024, got 1099".
    assert buf.core.submit_batch("many", [group]).already_submitted
    with pytest.raises(AlreadyExists):
        buf.core.submit_batch("many", [_spec({"stop_token_ids": stop[:-1]})])
    with pytest.raises(InvalidArgument) as e:  # a new batch is still bounded
        buf.core.submit_batch("fresh", [group])
    assert e.value.field == "groups[0].sampling.stop_token_ids" and "at most 1024, got 1099" in str(e.value)
