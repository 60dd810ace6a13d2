"""Releases against a hung KV store (real gRPC on loopback; the store takes RPCs and never
answers): each one waits its whole deadline on the single kv-release thread, so they must not
pile up without bound, and Worker.close must not wait for every queued one (it did: 9 queued
releases made close take 9 deadlines). Dropped releases cost nothing lasting: the store's LRU
evicts the pages."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest
from hung_kv import hung_kv_nodes
from worker_fake_engine import FakeEngine

import services.worker.core as core
from services.worker.core import ChunkFinish, ChunkJob, Worker
from services.worker.engine import SamplingParams
from services.worker.kv_client import KVClient
from services.worker.server import worker_stats_to_proto


@pytest.fixture
def hung_nodes() -> Iterator[list[str]]:
    """Two KV store nodes whose Release never answers."""
    with hung_kv_nodes(("Release",), n=2) as addrs:
        yield addrs


def _finish(w: Worker, n: int) -> None:
    """n responses end (LENGTH): each queues a Release."""
    for i in range(n):
        _, _, done = w.run(ChunkJob(request_id=f"r{i}", prompt_token_ids=(1, 2, 3), max_new_tokens=2,
                                    max_tokens=2, sampling=SamplingParams(temperature=0.0), policy_version=0))
        assert done.finish == ChunkFinish.LENGTH


def test_close_does_not_wait_for_every_queued_release(hung_nodes: list[str],
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(core, "_RELEASE_CLOSE_WAIT_S", 0.3)
    w = Worker(FakeEngine(), kv_pool=KVClient(hung_nodes, exists_timeout_s=1.0, tune_malloc=False),
               kv_offload=False, speculation=False).start()
    _finish(w, 8)
    t0 = time.monotonic()
    w.close()
    # Was 8 deadlines (8 s); now the bounded wait plus the KV client cancelling the running call.
    assert time.monotonic() - t0 < 2.0


def test_releases_beyond_the_bound_are_dropped_and_counted(hung_nodes: list[str],
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(core, "_MAX_PENDING_RELEASES", 2)
    monkeypatch.setattr(core, "_RELEASE_CLOSE_WAIT_S", 0.1)
    w = Worker(FakeEngine(), kv_pool=KVClient(hung_nodes, exists_timeout_s=5.0, tune_malloc=False),
               kv_offload=False, speculation=False).start()
    try:
        _finish(w, 6)
        # 2 queued or running (the store answers none within 5 s); the other 4 dropped.
        assert w.stats().kv_releases_dropped == 4
        assert worker_stats_to_proto(w.stats()).kv_releases_dropped == 4  # GetWorkerStats carries it
    finally:
        t0 = time.monotonic()
        w.close()
    # The running release (fanned out to both replicas on the KV client's pool) is cancelled by
    # the client's close, not waited out (its deadline is 5 s).
    assert time.monotonic() - t0 < 2.0


def test_a_batch_finishing_in_one_step_drops_no_release_against_a_healthy_store() -> None:
    """48 requests reach max_tokens in the same steps; the store answers each Release in 50 ms (busy,
    not hung). None is dropped (a cap of 32 dropped a healthy burst's releases; review, session 27)."""
    import threading

    from worker_fake_engine import FakePool

    class SlowRelease(FakePool):
        def release(self, model_version: str, request_id: str) -> None:
            time.sleep(0.05)
            super().release(model_version, request_id)

    eng = FakeEngine()
    eng.step_delay = 0.02
    pool = SlowRelease()
    w = Worker(eng, kv_pool=pool, kv_offload=False, speculation=False).start()
    n = 48
    gate = threading.Barrier(n)

    def go(i: int) -> None:
        gate.wait()
        w.run(ChunkJob(request_id=f"r{i}", prompt_token_ids=(1, 2, 3), max_new_tokens=20, max_tokens=20,
                       sampling=SamplingParams(temperature=0.0, ignore_eos=True), policy_version=0))

    threads = [threading.Thread(target=go, args=(i,)) for i in range(n)]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        deadline = time.monotonic() + 10
        while len(pool.released) < n and time.monotonic() < deadline:
            time.sleep(0.05)
        assert w.stats().kv_releases_dropped == 0
        assert len(pool.released) == n
    finally:
        w.close()
