"""Every worker setting reaches what it configures: the planner's spec_* knobs and the step clock
were config fields (flags, SEER_WORKER_* variables, Helm values) that build_worker never passed on,
so setting them changed nothing."""

from __future__ import annotations

import time

from worker_fake_engine import FakeEngine

from services.worker.adaptive import AdaptiveSpeculation
from services.worker.config import WorkerConfig
from services.worker.factory import build_planner, build_worker

_SET = {"spec_min_gain": 0.9, "spec_calibrated_min_gain": 0.4, "spec_pad_cost": 0.5, "spec_explore_budget": 0.1,
        "spec_guard_steps": 5, "spec_guard_backoff": 7, "spec_control_interval": 3}


def test_planner_options_reach_the_planner() -> None:
    planner = build_planner(WorkerConfig(speculation=True, **_SET))  # type: ignore[arg-type]
    assert isinstance(planner, AdaptiveSpeculation)
    got = {"spec_min_gain": planner.min_gain, "spec_calibrated_min_gain": planner.calibrated_min_gain,
           "spec_pad_cost": planner.pad_cost, "spec_explore_budget": planner.explore_budget,
           "spec_guard_steps": planner.guard_steps, "spec_guard_backoff": planner.guard_backoff,
           "spec_control_interval": planner.control_interval}
    assert got == _SET


def test_step_clock_reaches_the_worker() -> None:
    worker = build_worker(WorkerConfig(spec_step_clock="thread"), "w-0", engine=FakeEngine())
    try:
        assert worker._clock is time.thread_time
    finally:
        worker.close()


def test_the_kv_client_is_sized_for_the_workers_streams() -> None:
    """build_kv passes the worker's stream limit (capped) as the client's concurrent fetches: left
    at the default 16, a worker with more streams queued admissions behind a hung replica again."""
    from services.worker.factory import build_kv

    cfg = WorkerConfig(kv_addresses=("127.0.0.1:1", "127.0.0.1:2"), max_streams=40)
    kc = build_kv(cfg)
    assert kc is not None
    try:
        assert kc._io._max_workers == 2 * 2 * 40  # type: ignore[attr-defined]
    finally:
        kc.close()
