"""Helpers of the end-to-end tests (batches, result collection)."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from seer.v1 import common_pb2, rollout_pb2, rollout_pb2_grpc

from services.cli.up import Suite


@contextmanager
def stopping_cleanly(s: Suite) -> Iterator[Suite]:
    """Yields the started suite; on exit stops it and asserts that every service exited 0 (graceful
    shutdown: each drains and exits 0 on SIGTERM)."""
    try:
        yield s
    finally:
        codes = s.stop()
        assert all(c == 0 for c in codes.values()), codes


@contextmanager
def scripted_suite(data_dir: Path, **kw: Any) -> Iterator[Suite]:
    """Buffer and scheduler processes for scripted workers (no model, no draft or KV service), with
    8-token chunks; every process must stop cleanly."""
    s = Suite(workers=0, draft=False, kvstore=False, data_dir=data_dir, chunk_size=8, heartbeat_interval=0.3,
              model_dir="", **kw)
    s.start(timeout=60)
    with stopping_cleanly(s):
        yield s


def make_batch(num_groups: int, group_size: int, max_tokens: int | list[int], *, prompt_len: int = 6,
               temperature: float = 0.0, batch_id: str | None = None) -> rollout_pb2.SubmitBatchRequest:
    groups = [
        rollout_pb2.PromptGroup(
            prompt_key=f"p{g}",
            prompt_token_ids=[1 + ((g * 13 + i * 7) % 900) for i in range(prompt_len)],
            group_size=group_size,
            max_tokens=max_tokens if isinstance(max_tokens, int) else max_tokens[g],
            sampling=common_pb2.SamplingParams(temperature=temperature, seed=1234 + g),
            labels={"answer": str(g)},
        )
        for g in range(num_groups)
    ]
    return rollout_pb2.SubmitBatchRequest(batch_id=batch_id or f"b-{uuid.uuid4().hex[:10]}", groups=groups)


def collect(stub: rollout_pb2_grpc.RolloutServiceStub, batch_id: str, timeout: float,
            cursor: int = 0) -> list[rollout_pb2.StreamResultsResponse]:
    return list(stub.StreamResults(rollout_pb2.StreamResultsRequest(batch_id=batch_id, cursor=cursor),
                                   timeout=timeout))
