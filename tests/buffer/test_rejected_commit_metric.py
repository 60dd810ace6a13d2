"""seer_buffer_rejected_commits_total counts malformed commits too (reason "invalid"): only the
core's own refusals (conflict, gap, version, ...) were counted, so a worker sending bad tokens or
logprobs every chunk showed nothing in the metric."""

from __future__ import annotations

import grpc
import pytest
from buffer_helpers import BufferHandle, commit, group, submit
from prometheus_client import REGISTRY


def _invalid() -> float:
    return REGISTRY.get_sample_value("seer_buffer_rejected_commits_total", {"reason": "invalid"}) or 0.0


def test_a_malformed_commit_is_counted(buf: BufferHandle) -> None:
    submit(buf.rollout, "m", [group()])
    before = _invalid()
    with pytest.raises(grpc.RpcError) as e:
        commit(buf.internal, "m/0/0", 0, [5, 6], logprobs=[-0.1])  # one logprob for two tokens
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert _invalid() == before + 1
    assert commit(buf.internal, "m/0/0", 0, [5, 6]).next_seq == 1  # the buffer serves on
