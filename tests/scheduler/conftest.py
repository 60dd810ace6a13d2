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


# ---- the starvation hold (test_core_starved_hold, test_core_hold_review) ------------------------

HOLD_PAGE, HOLD_CHUNK = 16, 64
SMALL_PROMPT = 32  # a small request: one chunk of 6 pages (prompt + chunk), then it is finished
BIG_PROMPT = 400  # its first chunk needs 29 pages: more than a busy 40-page worker has free


def hold_core(
    clock: FakeClock, policy: str, workers: int = 1, pages: int = 40, batch: int = 64, **cfg: object
) -> SchedulerCore:
    """Workers w0.. of `pages` pages of HOLD_PAGE tokens, chunks of HOLD_CHUNK tokens."""
    return make_core(policy, clock, workers=workers, pages=pages, page_size=HOLD_PAGE, batch=batch,
                     chunk_size=HOLD_CHUNK, **cfg)


# The small requests' submission: later than the big one's (incarnation 0, 1, ...), so that running
# them postpones the big one by newer work, which is what starts its starvation clock.
SMALL_SUBMISSION = 100


def add_small(core: SchedulerCore, n: int) -> str:
    core.add_request(RequestInfo(f"s{n}", f"gs{n}", f"ks{n}", 0, 1, SMALL_PROMPT, HOLD_CHUNK,
                                 incarnation=SMALL_SUBMISSION))
    return f"s{n}"


def add_big(core: SchedulerCore, incarnation: int = 0) -> None:
    """The big request (a later incarnation: the same id submitted again, in a new group)."""
    core.add_request(RequestInfo("big", f"gbig{incarnation or ''}", "kbig", 0, 1, BIG_PROMPT, 1000,
                                 incarnation=incarnation))


def held(core: SchedulerCore) -> dict[str, tuple[str | None, int]]:
    """worker id -> (request held for, pages held), for the workers holding pages."""
    return {w.worker_id: (w.held_for, w.held_pages) for w in core._workers.values() if w.held_for}


def starve_big(core: SchedulerCore, clock: FakeClock, smalls: int = 12) -> list[tuple[str, str]]:
    """Fills the workers with `smalls` small chunks (6 per 40-page worker, of a later submission), then
    adds the big request and lets it starve: it fits nowhere, so it takes a hold. The small chunks running, as
    (request id, worker id)."""
    for n in range(smalls):
        add_small(core, n)
    running = [(d.request_id, d.worker_id) for d in core.next_dispatches()]
    assert len(running) == smalls
    add_big(core)
    clock.t += 10.0
    assert core.next_dispatches() == []
    return running


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
