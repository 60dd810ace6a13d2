"""Anti-starvation counts postponement by NEWER work only (pure core, no gRPC).

The rule served any request that had waited starvation_seconds (30 s by default) ahead of the
priority order. In one synchronous RL iteration every request waits far longer than that by design
(longest-first defers the short ones), so at paper scale the rule turned Seer into FIFO (bench.sim,
Qwen2-VL-72B: 0.957 -> 0.874 of the oracle). A request's starvation clock now starts only when a
chunk of a later submission (RequestInfo.incarnation: the buffer's submit_seq) has been dispatched
while it waits.
"""

from __future__ import annotations

from services.scheduler.core import RequestInfo, SchedulerCore, SchedulerPolicyConfig

from .conftest import FakeClock, make_core

CHUNK = 10  # tokens per chunk; each chunk below takes 10 s (1 s per token)


def _add(core: SchedulerCore, left: dict[str, int], rid: str, true_length: int, submission: int) -> None:
    """Adds a request of one sample; `left` tracks the tokens each request has still to generate."""
    core.add_request(RequestInfo(rid, f"g-{rid}", f"k-{rid}", 0, 1, 8, 1000, true_length=true_length,
                                 incarnation=submission))
    left[rid] = true_length


def _start(clock: FakeClock, submission: int, lengths: dict[str, int]) -> tuple[SchedulerCore, dict[str, int], str]:
    """Oracle (longest-first by true length) on one worker with one batch slot, at the service's
    default starvation_seconds, with `lengths` (request id -> true length) of one submission queued;
    returns the core, the tokens left per request and the request dispatched first."""
    assert SchedulerPolicyConfig().starvation_seconds == 30.0
    core = make_core("oracle", clock, workers=1, batch=1, chunk_size=CHUNK)
    left: dict[str, int] = {}
    for rid, n in lengths.items():
        _add(core, left, rid, n, submission)
    (d,) = core.next_dispatches()
    return core, left, d.request_id


def _run_chunk(core: SchedulerCore, clock: FakeClock, rid: str, left: dict[str, int]) -> str:
    """Ends `rid`'s running chunk 10 s later, and returns the request dispatched next."""
    clock.t += 10.0
    left[rid] -= CHUNK
    core.on_chunk_done(rid, "w0", CHUNK, finished=left[rid] <= 0)
    (d,) = core.next_dispatches()
    return d.request_id


def test_one_submission_waits_long_without_starving(clock: FakeClock) -> None:
    """One batch: the short request waits 200 s (well past 30 s) behind the long one, and the
    priority order stands: nothing is newer than it. The rule served it first after 30 s."""
    core, left, first = _start(clock, 3, {"short": 5, "long": 200})
    order = [first]
    while order[-1] != "short":
        order.append(_run_chunk(core, clock, order[-1], left))
    assert order == ["long"] * 20 + ["short"]
    assert clock.t == 200.0
    assert core.stats()["starvation_dispatches"] == 0


def test_an_older_submission_is_served_once_newer_work_postponed_it_for_the_threshold(clock: FakeClock) -> None:
    core, left, rid = _start(clock, 1, {"short": 5, "mid": 50})
    assert rid == "mid"
    for _ in range(4):  # t = 10 .. 40: short waits 40 s behind its own batch's mid: not starved
        rid = _run_chunk(core, clock, rid, left)
        assert rid == "mid"
    _add(core, left, "long", 200, submission=2)  # t = 40: a newer submission (another trainer's batch)
    rid = _run_chunk(core, clock, rid, left)  # t = 50: mid finished; long outranks short
    assert rid == "long"
    for _ in range(3):  # t = 60, 70, 80: short postponed by newer work for at most 30 s
        rid = _run_chunk(core, clock, rid, left)
        assert rid == "long"
    rid = _run_chunk(core, clock, rid, left)  # t = 90: 40 s since long's first dispatch
    assert rid == "short"
    assert core.stats()["starvation_dispatches"] == 1


def test_an_older_submission_arriving_after_newer_work_started_is_postponed_from_its_arrival(
        clock: FakeClock) -> None:
    """A scheduler restart resumes requests in any order: an older submission's request that comes
    after a later submission's chunks already run is postponed by newer work from its arrival."""
    core, left, rid = _start(clock, 2, {"long": 200})
    clock.t = 5.0
    _add(core, left, "short", 5, submission=1)
    for _ in range(3):  # t = 10, 20, 30: short postponed 25 s
        rid = _run_chunk(core, clock, rid, left)
        assert rid == "long"
    rid = _run_chunk(core, clock, rid, left)  # t = 40: 35 s
    assert rid == "short"
    assert core.stats()["starvation_dispatches"] == 1


def test_pieces_of_one_batch_count_as_one_submission(clock: FakeClock) -> None:
    """A batch delivered in two pieces (one submit_seq): the second piece's requests running ahead of
    the first piece's is the policy's order, not newer work."""
    core, left, rid = _start(clock, 4, {"short": 5, "long": 100})
    assert rid == "long"
    rid = _run_chunk(core, clock, rid, left)
    _add(core, left, "longest", 300, submission=4)  # t = 10: the batch's second piece
    order = [rid]
    while order[-1] != "short":
        order.append(_run_chunk(core, clock, order[-1], left))
    assert order == ["long"] + ["longest"] * 30 + ["long"] * 8 + ["short"]  # short waited 400 s
    assert core.stats()["starvation_dispatches"] == 0


def test_a_finished_submission_leaves_nothing_behind(clock: FakeClock) -> None:
    """Per-submission state lives while the core tracks a request of it (bounded memory)."""
    core, left, rid = _start(clock, 1, {"a": 5})
    _add(core, left, "b", 5, submission=2)
    assert sorted(core._starvation._subs) == [1, 2]
    core.on_chunk_done(rid, "w0", 5, finished=True)
    (d,) = core.next_dispatches()
    core.on_chunk_done(d.request_id, "w0", 5, finished=True)
    assert core._starvation._subs == {}
