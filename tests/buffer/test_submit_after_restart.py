"""A retried SubmitBatch of a stored batch is already_submitted even when the restarted buffer's
limits would now refuse its content (it was valid when accepted, and it is running)."""

from __future__ import annotations

from pathlib import Path

import pytest

from services.buffer.core import BufferCore
from services.buffer.model import ModelInfo
from services.buffer.records import GroupSpec, Sampling
from services.buffer.store import Store
from services.common.errors import AlreadyExists, InvalidArgument, ResourceExhausted


def _core(path: Path, max_context: int, max_requests: int) -> BufferCore:
    return BufferCore(Store(path), ModelInfo(vocab_size=1000, max_context=max_context, tokenizer=None),
                      max_requests_per_batch=max_requests)


def _groups(max_tokens: int = 100, group_size: int = 4) -> list[GroupSpec]:
    return [GroupSpec(prompt_key="p", prompt_token_ids=(1, 2, 3), group_size=group_size, max_tokens=max_tokens,
                      sampling=Sampling(temperature=1.0, seed=7))]


def test_retry_after_a_restart_with_smaller_limits_is_already_submitted(tmp_path: Path) -> None:
    core = _core(tmp_path / "db", max_context=4096, max_requests=64)
    assert not core.submit_batch("b", _groups()).already_submitted
    core.close()
    core = _core(tmp_path / "db", max_context=50, max_requests=2)  # both would refuse the batch now
    out = core.submit_batch("b", _groups())
    assert (out.already_submitted, out.num_requests) == (True, 4)
    # Different content is still a conflict, and a new batch is still validated.
    with pytest.raises(AlreadyExists):
        core.submit_batch("b", _groups(max_tokens=99))
    with pytest.raises(ResourceExhausted):
        core.submit_batch("c", _groups())
    with pytest.raises(InvalidArgument) as e:
        core.submit_batch("c", _groups(group_size=1))
    assert e.value.field == "groups[0].max_tokens"
    with pytest.raises(InvalidArgument) as e:
        core.submit_batch("b", _groups(), seed_scope="bad scope")
    assert e.value.field == "seed_scope"
    core.close()
