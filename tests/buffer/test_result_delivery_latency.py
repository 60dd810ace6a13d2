"""A result reaches a waiting StreamResults reader as soon as its commit is stored.

The stream waits on the core's condition (iter_results -> wait_results) and the commit that stores a
result notifies it; the 0.5 s poll (server.POLL_SECONDS) only re-checks that the client is still
there. Measured on loopback: ~1-3 ms from the final commit's start to the reader (median), also for
the commit that completes the batch (it builds the batch's history first). A guard: a result that
waited for the poll would take ~250 ms on median."""

from __future__ import annotations

import statistics
import threading
import time
from collections.abc import Callable

from buffer_helpers import CHUNK, STOP, BufferHandle, commit, group, submit, wait_for
from seer.v1 import rollout_pb2

REQUESTS = 5


def test_a_finished_request_reaches_the_reader_at_once(make_buffer: Callable[..., BufferHandle]) -> None:
    buf = make_buffer()
    submit(buf.rollout, "b", [group(group_size=REQUESTS, max_tokens=8)])
    arrived: dict[str, float] = {}
    opened = threading.Event()

    def read() -> None:
        stream = buf.rollout.StreamResults(rollout_pb2.StreamResultsRequest(batch_id="b"), timeout=30)
        stream.initial_metadata()  # sent when the stream is accepted
        opened.set()
        for r in stream:
            arrived[r.result.request_id] = time.perf_counter()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    assert opened.wait(10)
    delays = []
    for s in range(REQUESTS):  # the last one completes the batch
        rid = f"b/0/{s}"
        commit(buf.internal, rid, 0, [5, 6], CHUNK)
        time.sleep(0.05)  # the reader is waiting again
        t0 = time.perf_counter()
        commit(buf.internal, rid, 1, [7], STOP)
        assert wait_for(lambda: rid in arrived, timeout=5.0, poll=0.001)  # noqa: B023 (used at once)
        delays.append(arrived[rid] - t0)
    reader.join(10)
    # Generous for a loaded 2-core machine; a wait for the poll is ~0.25 s on median.
    assert statistics.median(delays) < 0.15, [round(d * 1000, 1) for d in delays]
