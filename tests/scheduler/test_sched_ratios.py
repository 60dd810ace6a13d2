"""The online-learned correction of group estimates (services/scheduler/core/ratios.py)."""

from __future__ import annotations

import pytest

from services.common.errors import InvalidArgument
from services.scheduler.core import SchedulerCore, SchedulerPolicyConfig
from services.scheduler.core.ratios import SiblingRatios

from .conftest import FakeClock, add_group, make_core


def test_ratio_quantile_per_group_shape() -> None:
    r = SiblingRatios(quantile=0.5, min_samples=3)
    assert r.factor(4, 1) is None  # nothing learned yet: the paper's plain maximum
    for top in (20, 30, 40):  # first finished 10, then the group's maximum arrives last
        r.observe([10, 10, 10, top], 4)
    assert r.samples(4, 1) == 3 and r.samples(4, 3) == 3 and r.samples(8, 1) == 0
    assert r.factor(4, 1) == pytest.approx(3.0)  # median of 2, 3, 4
    assert r.factor(4, 0) is None and r.factor(4, 4) is None and r.factor(8, 1) is None
    # A group whose first finished was already its maximum teaches a ratio of 1.
    for _ in range(20):
        r.observe([50, 10, 10, 10], 4)
    assert r.factor(4, 1) == pytest.approx(1.0)


def test_disabled_or_too_few_samples_is_no_correction() -> None:
    off = SiblingRatios(quantile=0.0, min_samples=1)
    off.observe([10, 40], 2)
    assert off.factor(2, 1) is None
    few = SiblingRatios(quantile=0.9, min_samples=5)
    for _ in range(4):
        few.observe([10, 40], 2)
    assert few.factor(2, 1) is None
    few.observe([10, 40], 2)
    assert few.factor(2, 1) == pytest.approx(4.0)


def test_bad_estimate_config_names_the_field() -> None:
    with pytest.raises(InvalidArgument) as e:
        SchedulerCore(SchedulerPolicyConfig(estimate_quantile=1.5))
    assert e.value.field == "estimate_quantile"
    with pytest.raises(InvalidArgument) as e:
        SchedulerCore(SchedulerPolicyConfig(estimate_min_samples=0))
    assert e.value.field == "estimate_min_samples"


def _finish_group(core: SchedulerCore, gid: str, lengths: list[int]) -> None:
    """Run every member of `gid` to completion in `lengths` order (one chunk each)."""
    ids = add_group(core, gid, len(lengths), max_tokens=1000)
    running: dict[str, str] = {}
    for d in core.next_dispatches():
        running[d.request_id] = d.worker_id
    for rid, n in zip(ids, lengths, strict=True):
        core.on_chunk_done(rid, running[rid], n, finished=True)


@pytest.mark.parametrize("quantile", [0.0, 0.9])
def test_learned_correction_lifts_a_group_that_looks_short(clock: FakeClock, quantile: float) -> None:
    """Completed pairs taught that the second sibling runs 3x the first: a running pair whose first
    member finished at 100 is estimated at 300 and ranks above a triple whose first finished at
    200 (no triple completed, so no correction). With the plain maximum the triple ranks first."""
    core = make_core(
        "seer", clock, workers=1, batch=64, chunk_size=1000, estimate_quantile=quantile, estimate_min_samples=4
    )
    for k in range(4):
        _finish_group(core, f"done{k}", [50, 150])
    add_group(core, "a", 2)
    add_group(core, "b", 3)
    ds = {d.request_id: d for d in core.next_dispatches()}
    core.on_chunk_done("a-0", ds["a-0"].worker_id, 100, finished=True)
    core.on_chunk_done("b-0", ds["b-0"].worker_id, 200, finished=True)
    for rid in ("a-1", "b-1", "b-2"):
        core.on_chunk_done(rid, ds[rid].worker_id, 50, finished=False)
    first = core.next_dispatches(limit=1)[0].request_id
    assert core.group_estimate("b") == 200
    if quantile:
        assert core.group_estimate("a") == 300 and first == "a-1"
    else:
        assert core.group_estimate("a") == 100 and first.startswith("b-")
