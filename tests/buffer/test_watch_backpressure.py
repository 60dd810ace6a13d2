"""A WatchWork watcher that stops reading is dropped once watch_queue_events events wait for it: its
stream ends RESOURCE_EXHAUSTED naming the limit, its queue is freed, the other watchers keep
receiving everything, and a watch after the drop gets the whole state in its snapshot."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc
import pytest
from buffer_helpers import BufferHandle, Watcher, commit, group, snapshot, submit, wait_for
from prometheus_client import REGISTRY
from seer.v1 import buffer_pb2, buffer_pb2_grpc, rollout_pb2

from services.buffer.config import BufferConfig
from services.buffer.core import BufferCore
from services.buffer.events import Added, Cancelled, Subscription, WatcherDropped
from services.buffer.model import ModelInfo
from services.buffer.records import GroupSpec, Sampling
from services.buffer.store import Store
from services.common import config

LIMIT = 64  # watch_queue_events of these tests (>= max_requests_per_batch, as the config requires)
PROMPT = [40_000 + i for i in range(2_000)]  # ~6 KB an item on the wire: the window fills in a few


def _subs(buf: BufferHandle) -> set[Subscription]:
    hub: Any = buf.core._hub
    with hub._lock:
        return set(hub._subs)


def _dropped_total() -> float:
    return REGISTRY.get_sample_value("seer_buffer_watchers_dropped_total") or 0.0


class Reader(Watcher):
    """A WatchWork stream drained by a thread: every event, then its end; and its live events."""

    def __init__(self, stub: buffer_pb2_grpc.BufferInternalServiceStub, name: str) -> None:
        self.live: list[Any] = []
        self.in_live = False
        super().__init__(stub, name, timeout=60)

    def live_events(self, n: int, timeout: float = 20.0) -> list[Any]:
        """The first n events after snapshot_done, as ("added", request_id) / ("cancelled",
        request_id) (they accumulate across calls)."""
        deadline = time.monotonic() + timeout
        while len(self.live) < n:
            ev = self.events.get(timeout=max(0.01, deadline - time.monotonic()))
            if ev.HasField("snapshot_done"):
                self.in_live = True
            elif self.in_live and ev.HasField("added"):
                self.live.extend(("added", it.request_id) for it in ev.added.items)
            elif self.in_live and ev.HasField("cancelled_request_id"):
                self.live.append(("cancelled", ev.cancelled_request_id))
        return self.live[:n]


def _big_group(**kw: Any) -> rollout_pb2.PromptGroup:
    return group(prompt_token_ids=PROMPT, group_size=8, max_tokens=8, **kw)


def test_stuck_watcher_is_dropped_while_a_reader_gets_everything(make_buffer: Callable[..., BufferHandle]) -> None:
    # Prompts of 2,000 ids around 40,000 (3 bytes each as varints): the model limits are raised for them.
    buf = make_buffer(watch_queue_events=LIMIT, max_requests_per_batch=LIMIT, vocab_size=50_000,
                      max_context=4_096)
    reader = Reader(buf.internal, "reader")
    # The stuck watcher never reads. Without BDP probing its client announces a 64 KiB window and
    # no more, so the buffer's send to it blocks after ~10 items, as for a hung scheduler.
    stuck_channel = grpc.insecure_channel(buf.address, options=[("grpc.http2.bdp_probe", 0)])
    try:
        assert wait_for(lambda: len(_subs(buf)) == 1, timeout=10.0)
        before = _subs(buf)
        dropped_before = _dropped_total()
        stuck_call = buffer_pb2_grpc.BufferInternalServiceStub(stuck_channel).WatchWork(
            buffer_pb2.WatchWorkRequest(watcher_id="stuck"), timeout=60)
        assert wait_for(lambda: len(_subs(buf)) == 2, timeout=10.0)
        (stuck,) = _subs(buf) - before

        # 10 batches of 32 requests (4 groups of 8), one of them cancelled: 352 live events for a
        # bound of 64. Nothing waits for the stuck watcher: every call returns. Each batch is
        # submitted once the reader has the one before: the reader is never behind by more than
        # a batch, as a scheduler that keeps up (the default bound is 4 of the largest batches).
        expected: list[tuple[str, str]] = []
        for b in range(10):
            submit(buf.rollout, f"b{b}", [_big_group() for _ in range(4)])
            expected += [("added", f"b{b}/{g}/{s}") for g in range(4) for s in range(8)]
            assert reader.live_events(len(expected)) == expected
        commit(buf.internal, "b7/1/2", 0, [5, 6, 7])
        buf.rollout.CancelBatch(rollout_pb2.CancelBatchRequest(batch_id="b3"))
        expected += [("cancelled", f"b3/{g}/{s}") for g in range(4) for s in range(8)]

        # The stuck watcher was dropped, and its stream ended without it reading a byte more: the
        # handler thread blocked sending to it returned (and unsubscribed), freeing its stream slot.
        assert wait_for(lambda: stuck not in _subs(buf), timeout=10.0), (
            f"the watcher that stopped reading was never dropped ({len(stuck)} events queued)")
        assert stuck.dropped and len(stuck) == 0  # its queue is freed
        assert stuck.peak <= LIMIT  # and never held more than the bound
        assert _dropped_total() == dropped_before + 1
        assert wait_for(lambda: stuck.closed, timeout=10.0), "the dropped stream's handler is still blocked sending"

        # The reader, on the same buffer, got every event in order.
        assert reader.live_events(len(expected)) == expected
        assert reader.end is None  # and is still watching

        # What the stuck client gets when it reads again: what was sent before, then the status.
        with pytest.raises(grpc.RpcError) as info:
            for _ in stuck_call:
                pass
        err: Any = info.value
        assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, (err.code(), err.details())
        assert "watch_queue_events" in err.details() and str(LIMIT) in err.details(), err.details()
        assert "'stuck'" in err.details(), err.details()

        # Watching again (what the scheduler does on any error of its feed) gives the whole state:
        # every unfinished request in submission order, the cancelled batch gone, the resume point
        # of the partly generated request.
        items = snapshot(buf.internal)
        assert [it.request_id for it in items] == [rid for kind, rid in expected
                                                   if kind == "added" and not rid.startswith("b3/")]
        partly = next(it for it in items if it.request_id == "b7/1/2")
        assert (list(partly.output_token_ids), partly.next_seq) == ([5, 6, 7], 1)
        assert all(list(it.prompt_token_ids) == PROMPT for it in items)
    finally:
        reader.close()
        stuck_channel.close()


def test_a_watch_after_the_drop_follows_live_events(make_buffer: Callable[..., BufferHandle]) -> None:
    """The watcher that was dropped watches again and is fed as before (no state of the drop stays)."""
    buf = make_buffer(watch_queue_events=LIMIT, max_requests_per_batch=LIMIT, vocab_size=50_000,
                      max_context=4_096)
    stuck_channel = grpc.insecure_channel(buf.address, options=[("grpc.http2.bdp_probe", 0)])
    try:
        call = buffer_pb2_grpc.BufferInternalServiceStub(stuck_channel).WatchWork(
            buffer_pb2.WatchWorkRequest(watcher_id="sched"), timeout=60)
        assert wait_for(lambda: len(_subs(buf)) == 1, timeout=10.0)
        (stuck,) = _subs(buf)
        for b in range(4):
            submit(buf.rollout, f"b{b}", [_big_group() for _ in range(4)])
        assert wait_for(lambda: stuck not in _subs(buf), timeout=10.0)
        with pytest.raises(grpc.RpcError) as info:
            for _ in call:
                pass
        assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED  # type: ignore[attr-defined]

        again = Reader(buf.internal, "sched")
        try:
            assert wait_for(lambda: len(_subs(buf)) == 1, timeout=10.0)
            submit(buf.rollout, "late", [group(group_size=2)])
            assert again.live_events(2) == [("added", "late/0/0"), ("added", "late/0/1")]
        finally:
            again.close()
        assert [it.request_id for it in snapshot(buf.internal)][-2:] == ["late/0/0", "late/0/1"]
    finally:
        stuck_channel.close()


# ---- the core alone (what the server builds on) ----------------------------------------------------

def _core(path: Path, limit: int) -> BufferCore:
    return BufferCore(Store(path), ModelInfo(vocab_size=1000, max_context=4096, tokenizer=None),
                      watch_queue_events=limit)


def _groups(n: int, size: int = 1) -> list[GroupSpec]:
    return [GroupSpec(prompt_key=f"p{g}", prompt_token_ids=(1, 2, 3), group_size=size, max_tokens=4,
                      sampling=Sampling(temperature=1.0, seed=g)) for g in range(n)]


def test_core_drops_only_the_watcher_past_the_bound(tmp_path: Path) -> None:
    core = _core(tmp_path / "db", 8)
    try:
        _snap, slow = core.watch("slow", peer="ipv4:10.0.0.1:5")
        _snap, fast = core.watch("fast")
        reasons: list[str] = []
        slow.on_drop(reasons.append)
        fast_got: list[Any] = []
        core.submit_batch("a", _groups(8))  # exactly the bound: both keep it
        fast_got += fast.take(100, 0)
        assert len(slow) == 8 and not slow.dropped and reasons == []
        core.submit_batch("b", _groups(1))  # one more than slow can hold
        assert slow.dropped and len(slow) == 0 and slow.peak == 8
        assert len(reasons) == 1 and "watch_queue_events 8" in reasons[0] and "'slow'" in reasons[0]
        with pytest.raises(WatcherDropped) as info:
            slow.take(100, 0)
        assert info.value.code_name == "RESOURCE_EXHAUSTED" and info.value.field == "watch_queue_events"
        assert len(core._hub) == 1  # the fast one is left
        fast_got += fast.take(100, 0)
        core.cancel_batch("a")
        fast_got += fast.take(100, 0)
        core.submit_batch("c", _groups(2))
        assert len(slow) == 0  # no longer fed
        fast_got += fast.take(100, 0)
        added = [e.item.request_id for e in fast_got if isinstance(e, Added)]
        cancelled = [e.request_id for e in fast_got if isinstance(e, Cancelled)]
        assert added == [f"a/{g}/0" for g in range(8)] + ["b/0/0", "c/0/0", "c/1/0"]
        assert sorted(cancelled) == sorted(f"a/{g}/0" for g in range(8))
        assert fast.peak <= 8
        # A callback registered after the drop runs at once (the server registers after watch()).
        late: list[str] = []
        slow.on_drop(late.append)
        assert late == reasons
        core.unwatch(slow)
        core.unwatch(fast)
        snap, again = core.watch("slow")
        assert [it.request_id for it in snap] == ["b/0/0", "c/0/0", "c/1/0"]
        core.unwatch(again)
    finally:
        core.close()


def test_a_waiting_stream_wakes_on_its_drop(tmp_path: Path) -> None:
    """A stream waiting for events learns of its drop at once, not after its poll interval."""
    core = _core(tmp_path / "db", 4)
    try:
        _snap, sub = core.watch("w")
        out: list[BaseException] = []

        def wait() -> None:
            try:
                sub.take(10, 30.0)
                sub.take(10, 30.0)
            except WatcherDropped as e:
                out.append(e)

        t = threading.Thread(target=wait, daemon=True)
        t.start()
        time.sleep(0.1)
        core.submit_batch("big", _groups(5))
        t.join(5)
        assert not t.is_alive() and len(out) == 1
        core.unwatch(sub)
    finally:
        core.close()


def test_watch_queue_events_config() -> None:
    assert BufferConfig().watch_queue_limit() == 4 * 65536
    assert BufferConfig(max_requests_per_batch=1000).watch_queue_limit() == 4000
    assert BufferConfig(watch_queue_events=5000, max_requests_per_batch=1000).watch_queue_limit() == 5000
    cfg = config.load(BufferConfig, "buffer", ["--watch-queue-events", "70000"], env={})
    assert cfg.watch_queue_limit() == 70000
    cfg = config.load(BufferConfig, "buffer", [], env={"SEER_BUFFER_WATCH_QUEUE_EVENTS": "80000"})
    assert cfg.watch_queue_events == 80000
    # A bound below the largest batch would drop every watcher at each such batch.
    with pytest.raises(ValueError, match="watch_queue_events: must be >= max_requests_per_batch"):
        BufferConfig(watch_queue_events=100, max_requests_per_batch=1000).validate()
    with pytest.raises(ValueError, match="watch_queue_events"):
        BufferConfig(watch_queue_events=-1).validate()
