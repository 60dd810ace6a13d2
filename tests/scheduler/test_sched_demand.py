"""seer_history while bound by KV demand: when the previous iteration's lengths say that the KV
demand exceeds what the KV serves within the longest response, the order is FIFO (like divided)
instead of longest-first by prior (bench.sim Kimi-K2: 0.914 -> 1.02 of the oracle)."""

from __future__ import annotations

from services.scheduler.core import RequestInfo, SchedulerCore
from services.scheduler.core.groups import kv_demand

from .conftest import FakeClock, make_core

PROMPT = 2000
CHUNK = 100
# Single-request groups in enqueue order, with the previous iteration's length of each prompt key.
PRIORS = {"a": 200, "b": 200, "c": 200, "d": 900, "e": 900}


def _core(clock: FakeClock, max_tokens: int, policy: str = "seer_history") -> SchedulerCore:
    """One worker whose KV holds two requests (prompt 2000 + chunk 100 = 132 pages of 16; 300 pages),
    with free batch slots. Demand (token-steps) = sum n (prompt + n / 2) = 5.67M; the KV serves
    4,800 tokens x max_tokens steps: 4.8M at max_tokens 1,000 (ratio 1.18, bound by KV demand), 48M
    at 10,000 (ratio 0.12, the critical path may bind)."""
    core = make_core(policy, clock, workers=1, pages=300, batch=64, chunk_size=CHUNK, starvation_seconds=1e9)
    for key, n in PRIORS.items():
        core.set_history(key, [n])
        core.add_request(RequestInfo(key, key, key, 0, 1, PROMPT, max_tokens))
    return core


def _order_after_kv_bound(core: SchedulerCore, clock: FakeClock) -> tuple[list[str], list[str]]:
    """First dispatches; then decisions that find nothing fitting (the detector sees the cluster
    KV-bound); then the two running chunks complete and the next two requests are picked."""
    first = core.next_dispatches()
    for _ in range(60):
        assert core.next_dispatches() == []
    clock.t += 10.0
    for d in first:
        core.on_chunk_done(d.request_id, d.worker_id, d.max_new_tokens, False)
    second = core.next_dispatches()
    return [d.request_id for d in first], [d.request_id for d in second]


def test_kv_demand_counts_token_steps_of_the_prior() -> None:
    # n tokens after a prompt of p hold p + j context at step j: n p + n^2 / 2 token-steps (x 2).
    assert kv_demand([100], 1, 50, 1000) == 2 * (100 * 50) + 100 * 100
    # Lengths are capped at max_tokens; a history of another size is scaled to the group's.
    assert kv_demand([5000], 2, 0, 1000) == 2 * 1000 * 1000
    assert kv_demand([], 4, 10, 100) == 0


def test_fifo_when_the_history_says_kv_demand_binds(clock: FakeClock) -> None:
    core = _core(clock, max_tokens=1000)
    first, second = _order_after_kv_bound(core, clock)
    assert first == ["d", "e"]  # longest prior first while the cluster is not KV-bound yet
    st = core.stats()
    assert st["kv_bound"] and st["kv_demand_bound"] and st["demand_switches"] == 1
    # FIFO: the short-prior requests queued first start before d and e resume.
    assert second == ["a", "b"]


def test_longest_first_kept_when_the_critical_path_may_bind(clock: FakeClock) -> None:
    core = _core(clock, max_tokens=10_000)  # same priors and KV; the longest response may be 10x longer
    first, second = _order_after_kv_bound(core, clock)
    assert first == ["d", "e"]
    st = core.stats()
    assert st["kv_bound"] and not st["kv_demand_bound"]
    assert second == ["d", "e"]


def test_seer_without_history_is_unchanged(clock: FakeClock) -> None:
    """Only seer_history knows a demand (seer has no prior lengths): seer keeps Algorithm 2's order."""
    core = _core(clock, max_tokens=1000, policy="seer")
    _order_after_kv_bound(core, clock)
    assert not core.stats()["kv_demand_bound"]


def test_groups_release_their_demand_when_they_finish(clock: FakeClock) -> None:
    core = _core(clock, max_tokens=1000)
    first, second = _order_after_kv_bound(core, clock)
    assert core.stats()["kv_demand_bound"]
    gen = dict.fromkeys(first, CHUNK)
    ds = [(rid, "w0", CHUNK) for rid in second]
    for _ in range(200):  # complete the running chunks, then decide again, until all finished
        clock.t += 10.0
        for rid, wid, n in ds:
            gen[rid] = gen.get(rid, 0) + n
            core.on_chunk_done(rid, wid, n, gen[rid] >= PRIORS[rid])
        ds = [(d.request_id, d.worker_id, d.max_new_tokens) for d in core.next_dispatches()]
        if core.pending_count() == 0 and core.in_flight_count() == 0:
            break
    assert gen == {k: v + (-v % CHUNK) for k, v in PRIORS.items()}  # each ran to its end
    assert core._kv_demand == 0 and not core._demand_caps  # the bookkeeping is exact
