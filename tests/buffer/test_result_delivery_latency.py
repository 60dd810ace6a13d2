"""A result reaches a waiting StreamResults reader as soon as its commit is stored.

The stream waits on the core's condition (iter_results -> wait_results) and the commit that stores a
result notifies it; the poll (server.POLL_SECONDS, 0.5 s) only re-checks that the client is still
there. Measured on loopback: ~1-3 ms from the final commit's start to the reader (median), also for
the commit that completes the batch (it builds the batch's history first).

No timing bound: the poll is made 60 s here, each final commit lands while the reader is inside
wait_results (observed, not slept for), and the result must arrive within 10 s, which only the
commit's notification can do. (A median bound on the delay, 50 ms then 150 ms, failed on a loaded
machine; a reader not yet waiting when the commit landed made it pass without testing anything.)"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import pytest
from buffer_helpers import CHUNK, STOP, BufferHandle, commit, group, submit, wait_for
from seer.v1 import rollout_pb2

from services.buffer import server

REQUESTS = 5
POLL = 60.0  # the stream's poll: a result that waited for it would miss the 10 s below


def test_a_finished_request_reaches_the_reader_at_once(make_buffer: Callable[..., BufferHandle],
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(server, "POLL_SECONDS", POLL)  # read by the handler per call
    buf = make_buffer()
    submit(buf.rollout, "b", [group(group_size=REQUESTS, max_tokens=8)])
    # The reader's handler thread inside wait_results (entered, not yet returned): a commit now
    # must wake it.
    waits = {"entered": 0, "left": 0}
    real_wait = buf.core.wait_results

    def wait_results(batch_id: str, cursor: int, timeout: float) -> None:
        assert timeout == POLL
        waits["entered"] += 1
        try:
            real_wait(batch_id, cursor, timeout)
        finally:
            waits["left"] += 1

    buf.core.wait_results = wait_results  # type: ignore[method-assign]
    arrived: dict[str, float] = {}

    def read() -> None:
        stream = buf.rollout.StreamResults(rollout_pb2.StreamResultsRequest(batch_id="b"), timeout=120)
        for r in stream:
            arrived[r.result.request_id] = time.perf_counter()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    delays = []
    for s in range(REQUESTS):  # the last one completes the batch
        rid = f"b/0/{s}"
        commit(buf.internal, rid, 0, [5, 6], CHUNK)  # no result: the reader sleeps on
        assert wait_for(lambda: waits["entered"] > waits["left"], timeout=10.0), "the reader is not waiting"
        t0 = time.perf_counter()
        commit(buf.internal, rid, 1, [7], STOP)
        assert wait_for(lambda: rid in arrived, timeout=10.0, poll=0.001), (  # noqa: B023 (used at once)
            f"{rid} did not reach the waiting reader: its commit did not wake the stream")
        delays.append(arrived[rid] - t0)
    reader.join(10)
    assert not reader.is_alive() and sorted(arrived) == [f"b/0/{s}" for s in range(REQUESTS)]
    assert all(d < POLL / 2 for d in delays), [round(d * 1000, 1) for d in delays]
