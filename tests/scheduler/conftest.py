"""Helpers for the scheduler core and simulator tests."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest

from services.scheduler.core import RequestInfo, SchedulerCore, SchedulerPolicyConfig, WorkerSpec


class FakeClock:
    """A settable clock (the core takes any callable; the simulator passes simulated time)."""

    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


def make_core(
    policy: str,
    clock: Callable[[], float],
    workers: int = 2,
    pages: int = 10_000,
    page_size: int = 16,
    batch: int = 64,
    **cfg: object,
) -> SchedulerCore:
    core = SchedulerCore(SchedulerPolicyConfig(policy=policy, **cfg), clock=clock)  # type: ignore[arg-type]
    for k in range(workers):
        core.add_worker(WorkerSpec(f"w{k}", total_pages=pages, page_size=page_size, max_batch_size=batch))
    return core


def add_group(
    core: SchedulerCore,
    gid: str,
    size: int,
    *,
    prompt_len: int = 32,
    max_tokens: int = 1000,
    lengths: list[int] | None = None,
    key: str | None = None,
) -> list[str]:
    ids = []
    for i in range(size):
        rid = f"{gid}-{i}"
        core.add_request(
            RequestInfo(
                rid,
                gid,
                key or f"key-{gid}",
                i,
                size,
                prompt_len,
                max_tokens,
                true_length=None if lengths is None else lengths[i],
            )
        )
        ids.append(rid)
    return ids


@pytest.fixture
def make_rig() -> Iterator[Callable[..., Any]]:
    """Dispatcher rigs (test_dispatcher_faults.Rig) with an optional scripted buffer or workers,
    closed at the end of the test."""
    from .test_dispatcher_faults import Rig

    made: list[Rig] = []

    def make(buffer: Any = None, workers: Any = None, **cfg: Any) -> Rig:
        r = Rig(**cfg)
        made.append(r)
        if buffer is not None:
            r.buffer = r.d._buffer = buffer
        if workers is not None:
            r.workers = r.d._worker_link_factory = workers
        return r

    yield make
    for r in made:
        r.close()
