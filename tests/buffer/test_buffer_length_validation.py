"""LENGTH means the response reached max_tokens: an early LENGTH would silently truncate it."""

from __future__ import annotations

import grpc
import pytest
from buffer_helpers import LENGTH, BufferHandle, commit, expect_error, group, snapshot, submit


def test_length_short_of_max_tokens_is_refused_naming_finish_reason(buf: BufferHandle) -> None:
    submit(buf.rollout, "c", [group(group_size=1, max_tokens=8)])
    rid = "c/0/0"
    msg = expect_error(lambda: commit(buf.internal, rid, 0, [5, 6, 7], reason=LENGTH),
                       grpc.StatusCode.INVALID_ARGUMENT, "finish_reason")
    assert "max_tokens 8" in msg
    # Nothing was appended: the request is still open at seq 0.
    item = snapshot(buf.internal)[0]
    assert (list(item.output_token_ids), item.next_seq) == ([], 0)
    # Over two chunks, LENGTH at exactly max_tokens finishes it.
    assert not commit(buf.internal, rid, 0, [5, 6, 7]).request_finished
    expect_error(lambda: commit(buf.internal, rid, 1, [8], reason=LENGTH), grpc.StatusCode.INVALID_ARGUMENT,
                 "finish_reason")
    assert commit(buf.internal, rid, 1, [8, 9, 10, 11, 12], reason=LENGTH).request_finished


def test_a_temperature_too_small_for_the_workers_is_refused_at_submission() -> None:
    from services.buffer.records import Sampling
    from services.buffer.validation import _validate_sampling
    from services.common.errors import InvalidArgument

    with pytest.raises(InvalidArgument) as e:
        _validate_sampling(Sampling(temperature=1e-9), 49152, "groups[0].sampling")
    assert e.value.field == "groups[0].sampling.temperature"
    _validate_sampling(Sampling(temperature=0.0), 49152, "groups[0].sampling")
    _validate_sampling(Sampling(temperature=0.7), 49152, "groups[0].sampling")
