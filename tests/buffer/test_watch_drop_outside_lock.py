"""A dropped watcher's stream is ended outside the buffer core's lock.

The core publishes work events under its lock, and a publish that drops a watcher (its queue past
watch_queue_events) ends that watcher's gRPC stream through the drop callback (server.end_stream):
the stream's handler thread, blocked sending to a client that stopped reading, cannot see the drop
itself. Run under the lock, a slow end of that stream (a call into gRPC; a deadlock should gRPC call
back) stalled every other call of the buffer, each waiting for the lock. Now the publish hands the
callbacks back and the core runs them after releasing its lock: only the call whose publish dropped
the watcher waits for the end."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import grpc
import pytest
from buffer_helpers import STOP, BufferHandle, commit, group, snapshot, submit, wait_for
from seer.v1 import buffer_pb2, buffer_pb2_grpc, rollout_pb2

from services.buffer import server
from services.buffer.events import Subscription

QUEUE = 16  # events the stuck watcher may have queued
PROMPT = [40_000 + i for i in range(2_000)]  # ~6 KB an item on the wire: 16 items pass a 64 KiB window
# How long the dropped stream's end may be held while the other calls run: they are checked while
# it is held (no timing bound on them), and it is released as soon as they are done.
END_HOLD_SECONDS = 30.0


def _subs(buf: BufferHandle) -> set[Subscription]:
    hub: Any = buf.core._hub
    with hub._lock:
        return set(hub._subs)


def test_a_slow_end_of_a_dropped_stream_does_not_block_other_calls(
        make_buffer: Callable[..., BufferHandle], monkeypatch: pytest.MonkeyPatch) -> None:
    buf = make_buffer(vocab_size=50_000, max_context=4_096)
    submit(buf.rollout, "other", [group(group_size=2)])
    item = next(it for it in snapshot(buf.internal) if it.batch_id == "other")
    assert wait_for(lambda: not _subs(buf), 10.0)  # snapshot()'s watcher is gone
    # Below max_requests_per_batch (which the config refuses): a small batch overflows the queue.
    buf.core._hub.max_queued_events = QUEUE

    ending, release = threading.Event(), threading.Event()
    real_end = server.end_stream

    def slow_end(context: grpc.ServicerContext, code: grpc.StatusCode, details: str) -> None:
        ending.set()
        release.wait(END_HOLD_SECONDS)  # a stream whose end takes long: until the test lets it go
        real_end(context, code, details)

    monkeypatch.setattr(server, "end_stream", slow_end)  # the servicer's callback looks it up per call
    # A watcher that never reads: without BDP probing its client announces a 64 KiB window and no
    # more, so the handler blocks sending the first batch's items and never sees its drop itself.
    stuck_channel = grpc.insecure_channel(buf.address, options=[("grpc.http2.bdp_probe", 0)])
    try:
        stuck_call = buffer_pb2_grpc.BufferInternalServiceStub(stuck_channel).WatchWork(
            buffer_pb2.WatchWorkRequest(watcher_id="stuck"), timeout=60)
        assert wait_for(lambda: len(_subs(buf)) == 1, 10.0)
        (stuck,) = _subs(buf)
        submit(buf.rollout, "fill", [group(prompt_token_ids=PROMPT, group_size=8) for _ in range(2)])
        assert wait_for(lambda: len(stuck) == 0, 10.0)  # taken by the handler, now blocked sending them
        time.sleep(0.2)
        dropping: dict[str, Any] = {}

        def submit_dropping() -> None:  # QUEUE + 1 events: the stuck watcher is dropped
            dropping["resp"] = submit(buf.rollout, "big", [group(group_size=8), group(group_size=8),
                                                           group(group_size=1)])

        t = threading.Thread(target=submit_dropping, daemon=True)
        t.start()
        try:
            assert ending.wait(10.0), ("the stuck watcher's stream was not ended by its drop", stuck.dropped)
            # While the dropped stream's end is held: the buffer's other calls go on. Before, each
            # waited for the core's lock, held through the whole end (their 10 s deadlines expire).
            submit(buf.rollout, "third", [group(group_size=1)])
            commit(buf.internal, item.request_id, 0, [5, 6], STOP)
            status = buf.rollout.GetBatch(rollout_pb2.GetBatchRequest(batch_id="other"), timeout=10)
            assert status.num_finished == 1
            # The publishing call itself runs the callback (after the lock): it waits for the end.
            assert "resp" not in dropping and t.is_alive()
        finally:
            release.set()
        t.join(10)
        assert not t.is_alive() and dropping["resp"].num_requests == 17
        # The stream still ends with the drop's status, and its blocked handler returned.
        assert wait_for(lambda: stuck.closed, 10.0), "the dropped stream's handler is still blocked sending"
        with pytest.raises(grpc.RpcError) as info:
            for _ in stuck_call:
                pass
        err: Any = info.value
        assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "watch_queue_events" in err.details()
    finally:
        stuck_channel.close()
