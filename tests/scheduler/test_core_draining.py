"""A draining worker (its heartbeat says it stops) gets no new chunk; its chunks in flight run on.

The scheduler placed chunks on a stopping worker until it was gone: each was refused UNAVAILABLE
and retried elsewhere (tests/worker/test_worker_draining.py runs it over gRPC)."""

from __future__ import annotations

import pytest

from services.common.errors import NotFound

from .conftest import FakeClock, add_group, held, hold_core, make_core, starve_big


@pytest.mark.parametrize("policy", ["divided", "seer", "baseline"])
def test_no_chunk_is_placed_on_a_draining_worker(clock: FakeClock, policy: str) -> None:
    core = make_core(policy, clock, chunk_size=8)
    ids = add_group(core, "g", 4, max_tokens=32)
    first = {d.request_id: d.worker_id for d in core.next_dispatches()}
    assert set(first) == set(ids)
    on_w0 = [rid for rid, wid in first.items() if wid == "w0"]
    core.set_draining("w0", True)
    assert core.is_draining("w0")
    more = add_group(core, "h", 4, max_tokens=32)
    placed = {d.request_id: d.worker_id for d in core.next_dispatches()}
    assert set(placed) == set(more) and set(placed.values()) == {"w1"}
    # Its chunks in flight run on: neither re-queued nor refused, and their results count.
    assert core.in_flight_count() == 8
    for rid in on_w0:
        core.on_chunk_done(rid, "w0", 8, finished=False)
    # Their next chunks go elsewhere.
    assert on_w0
    again = {d.request_id: d.worker_id for d in core.next_dispatches() if d.request_id in on_w0}
    assert again == dict.fromkeys(on_w0, "w1")
    assert core.stats()["workers"]["w0"]["draining"] is True


def test_a_draining_worker_with_no_other_gets_nothing(clock: FakeClock) -> None:
    core = make_core("divided", clock, workers=1, chunk_size=8)
    add_group(core, "g", 2, max_tokens=32)
    core.set_draining("w0", True)
    assert core.next_dispatches() == []
    core.set_draining("w0", False)  # a heartbeat without the flag: placeable again
    assert len(core.next_dispatches()) == 2


def test_a_hold_moves_off_a_worker_that_begins_to_drain(clock: FakeClock) -> None:
    core = hold_core(clock, "divided", workers=2, starvation_seconds=5.0)
    starve_big(core, clock)
    ((holder, _),) = held(core).items()
    core.set_draining(holder, True)
    assert held(core) == {}  # released at once, like for a quarantine
    core.next_dispatches()
    other = "w1" if holder == "w0" else "w0"
    assert list(held(core)) == [other]  # taken again on the worker that stays


def test_unknown_worker_is_named(clock: FakeClock) -> None:
    core = make_core("divided", clock, workers=1)
    with pytest.raises(NotFound, match="worker_id"):
        core.set_draining("nope", True)


def test_a_draining_worker_does_not_count_as_the_other_trusted_one(clock: FakeClock) -> None:
    """on_worker_fault never quarantines the last worker chunks can go to: one that is leaving does
    not count (its quarantine would leave no worker for the requests to wait on)."""
    core = make_core("divided", clock, worker_failure_limit=1, chunk_size=8)
    add_group(core, "g", 1)
    ((d,),) = [core.next_dispatches()]
    other = "w1" if d.worker_id == "w0" else "w0"
    core.set_draining(other, True)
    core.on_chunk_failed(d.request_id, d.worker_id)
    assert core.on_worker_fault(d.worker_id, d.request_id, "engine failed") is False
    assert not core.is_quarantined(d.worker_id)
