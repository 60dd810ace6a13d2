"""What a submission stores always decodes at recovery.

protobuf types every field of a SubmitBatch over gRPC, but an in-process caller of the core hands it
Python values: ignore_eos=1, seed=3.0, top_k=2.0. They were stored as given and the restart's
recovery, which checks every stored field's type (records.py), refused them: a batch accepted once
made the buffer fail to start. Now the submission makes each field its type (or refuses it naming
the field), and recovery reads the odd spellings an older buffer stored as what they meant. Real
RocksDB, the buffer restarted on its data dir, work items read through WatchWork over gRPC."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from buffer_helpers import BufferHandle, snapshot

from services.buffer import codec
from services.buffer.core import derive_seed
from services.buffer.records import GroupSpec, Sampling
from services.buffer.store import Store, group_key
from services.common.errors import InvalidArgument


def _odd_group(**sampling: Any) -> GroupSpec:
    s: dict[str, Any] = {"temperature": 1, "top_p": 1, "top_k": 2.0, "seed": 3.0, "stop_token_ids": (1.0,),
                         "ignore_eos": 1}
    s.update(sampling)
    return GroupSpec(prompt_key="p", prompt_token_ids=(1, 2, 3), group_size=2, max_tokens=8.0,  # type: ignore[arg-type]
                     sampling=Sampling(**s))


def _check_items(buf: BufferHandle, batch_id: str) -> None:
    items = sorted(snapshot(buf.internal), key=lambda it: it.request_id)
    assert [it.request_id for it in items] == [f"{batch_id}/0/0", f"{batch_id}/0/1"]
    for si, it in enumerate(items):
        assert it.max_tokens == 8 and it.group_size == 2
        s = it.sampling
        assert (s.temperature, s.top_k, list(s.stop_token_ids), s.ignore_eos) == (1.0, 2, [1], True)
        # The seed 3.0 is the seed 3: the same requests' seeds as an integer seed gives.
        assert s.seed == derive_seed(3, batch_id, si)


def test_odd_types_submitted_in_process_recover_after_a_restart(make_buffer: Callable[..., BufferHandle]) -> None:
    buf = make_buffer()
    out = buf.core.submit_batch("odd", [_odd_group()])
    assert out.num_requests == 2
    _check_items(buf, "odd")
    buf.stop()
    # Before: RecordError "'g/odd/000000' field 'max_tokens': an integer expected, got float 8.0" here.
    buf = make_buffer()
    _check_items(buf, "odd")
    g = buf.core._groups[("odd", 0)]
    assert type(g.max_tokens) is int and type(g.sampling.ignore_eos) is bool and type(g.sampling.seed) is int
    # An idempotent retry of the same in-process call is still recognized after the restart.
    assert buf.core.submit_batch("odd", [_odd_group()]).already_submitted


def test_odd_types_an_older_buffer_stored_are_read_at_recovery(make_buffer: Callable[..., BufferHandle],
                                                               tmp_path: Path) -> None:
    """A store written before submissions were normalized holds the values as they came."""
    buf = make_buffer()
    buf.core.submit_batch("old", [GroupSpec(prompt_key="p", prompt_token_ids=(1, 2, 3), group_size=2, max_tokens=8,
                                            sampling=Sampling(temperature=1.0, top_k=2, seed=3, stop_token_ids=(1,),
                                                              ignore_eos=True))])
    buf.stop()
    store = Store(tmp_path / "db")
    try:
        key = group_key("old", 0)
        raw = store.get(key)
        assert raw is not None
        meta, arrays = codec.decode(raw)
        meta["max_tokens"] = 8.0
        meta["sampling"].update(temperature=True, top_k=2.0, stop_token_ids=[1.0], ignore_eos=1)
        wb = store.new_batch()
        wb.put(key, codec.encode(meta, arrays))
        store.write(wb)
    finally:
        store.close()
    buf = make_buffer()  # before: RecordError naming 'g/old/000000' and max_tokens
    items = sorted(snapshot(buf.internal), key=lambda it: it.request_id)
    assert [(it.max_tokens, it.sampling.top_k, list(it.sampling.stop_token_ids), it.sampling.ignore_eos,
             it.sampling.temperature) for it in items] == [(8, 2, [1], True, 1.0)] * 2


@pytest.mark.parametrize(("group", "field"), [
    (_odd_group(seed=3.5), "groups[0].sampling.seed"),
    (_odd_group(ignore_eos=2), "groups[0].sampling.ignore_eos"),
    (_odd_group(top_k=True), "groups[0].sampling.top_k"),
    (_odd_group(temperature="1"), "groups[0].sampling.temperature"),
    (_odd_group(stop_token_ids=(1, 2.5)), "groups[0].sampling.stop_token_ids[1]"),
    (GroupSpec(prompt_token_ids=(1,), group_size="2", max_tokens=8), "groups[0].group_size"),  # type: ignore[arg-type]
    (GroupSpec(prompt_token_ids=(1,), group_size=1, max_tokens=8, labels=(("a", 1),)), "groups[0].labels"),  # type: ignore[arg-type]
])
def test_a_value_that_is_not_its_fields_type_is_refused_naming_the_field(
        make_buffer: Callable[..., BufferHandle], group: GroupSpec, field: str) -> None:
    buf = make_buffer()
    with pytest.raises(InvalidArgument) as e:
        buf.core.submit_batch("bad", [group])
    assert e.value.field == field, e.value
    assert "bad" not in buf.core._batches  # nothing stored


def test_numpy_scalars_are_their_values(make_buffer: Callable[..., BufferHandle]) -> None:
    """numpy scalars a trainer computes are what they mean. Before: temperature np.float32(0.5) was
    "must be a number, got float32 0.5", an np.int64 in a float field was refused, and
    ignore_eos np.bool_(True) was "must be a boolean, got bool True"."""
    np = pytest.importorskip("numpy")
    buf = make_buffer()
    group = GroupSpec(prompt_key="p", prompt_token_ids=(1, 2, 3), group_size=2, max_tokens=8,
                      sampling=Sampling(temperature=np.float32(0.5), top_p=np.int64(1), top_k=2, seed=3,
                                        ignore_eos=np.bool_(True)))
    assert buf.core.submit_batch("np", [group]).num_requests == 2
    items = sorted(snapshot(buf.internal), key=lambda it: it.request_id)
    assert [(it.sampling.temperature, it.sampling.top_p, it.sampling.ignore_eos) for it in items] == \
        [(0.5, 1.0, True)] * 2
    g = buf.core._groups[("np", 0)]
    assert type(g.sampling.temperature) is float and type(g.sampling.ignore_eos) is bool
    # A bool is still no number (numpy's neither), and its message names numpy's type.
    with pytest.raises(InvalidArgument) as e:
        buf.core.submit_batch("nb", [_odd_group(temperature=np.bool_(True))])
    assert e.value.field == "groups[0].sampling.temperature" and "numpy.bool" in str(e.value), e.value
    with pytest.raises(InvalidArgument) as e:
        buf.core.submit_batch("nb", [_odd_group(ignore_eos=np.float32(0.5))])
    assert e.value.field == "groups[0].sampling.ignore_eos", e.value


def test_a_submission_is_typed_once(make_buffer: Callable[..., BufferHandle], monkeypatch: pytest.MonkeyPatch) -> None:
    """Typing walks every prompt token (0.2-0.3 s a pass for 4,096 prompts of 4,096 tokens); it ran
    three times a submission (submit_batch, validate_batch, validate_group)."""
    from services.buffer import validation
    calls: list[str] = []
    real = validation._typed_tokens

    def counted(tokens: object, field: str) -> tuple[int, ...]:
        calls.append(field)
        return real(tokens, field)

    monkeypatch.setattr(validation, "_typed_tokens", counted)
    buf = make_buffer()
    buf.core.submit_batch("once", [_odd_group(), _odd_group()])
    assert calls.count("groups[0].prompt_token_ids") == 1 and calls.count("groups[1].prompt_token_ids") == 1, calls


def test_numpy_floats_of_any_width_with_integral_values_are_integers(make_buffer: Callable[..., BufferHandle]) -> None:
    """Before: np.float64(3.0) passed as an integer (a float subclass) but np.float32(3.0),
    np.float16 and a 0-d float array were "must be an integer, got numpy.float32 3.0"."""
    np = pytest.importorskip("numpy")
    buf = make_buffer()
    group = GroupSpec(prompt_key="p", prompt_token_ids=(1, np.float32(2.0), np.float16(3.0)),  # type: ignore[arg-type]
                      group_size=np.float32(2.0), max_tokens=np.array(8.0, dtype=np.float32),  # type: ignore[arg-type]
                      sampling=Sampling(temperature=1.0, top_k=np.float16(2.0), seed=np.float32(3.0),  # type: ignore[arg-type]
                                        stop_token_ids=(np.float32(1.0),)))  # type: ignore[arg-type]
    assert buf.core.submit_batch("nf", [group]).num_requests == 2
    g = buf.core._groups[("nf", 0)]
    assert list(g.prompt_token_ids) == [1, 2, 3]
    assert (g.group_size, g.max_tokens, g.sampling.top_k, g.sampling.seed, g.sampling.stop_token_ids) == \
        (2, 8, 2, 3, (1,))
    assert type(g.group_size) is int and type(g.sampling.seed) is int
    # Not integral, or not finite: still refused, naming the field.
    for bad in (np.float32(2.5), np.float32("nan"), np.float16("inf")):
        with pytest.raises(InvalidArgument) as e:
            buf.core.submit_batch("nf2", [_odd_group(top_k=bad)])
        assert e.value.field == "groups[0].sampling.top_k" and "must be an integer" in str(e.value), e.value
