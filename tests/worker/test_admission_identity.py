"""Two admissions of one request with the same dispatch epoch (a re-sent chunk racing the first,
both fetching KV) are distinct records: the first to finish must remove its own record, not its
twin's. With value equality it removed the twin's, so an Abort missed the chunk still fetching
(which then ran to its limit), that chunk's own remove raised ValueError after it was in the
engine, and a stale aborted record stayed behind. Glue over the fake engine and a gated pool."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence

from worker_fake_engine import FakeEngine, FakePool

from services.worker.core import ChunkFinish, ChunkJob, DoneEvent, Worker
from services.worker.engine import KVLayout, KVPages, SamplingParams


class _GatedPool(FakePool):
    """The first fetch blocks until `gate` is set; later fetches return at once (nothing found)."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = threading.Event()
        self.first_waiting = threading.Event()
        self._calls = 0
        self._lock = threading.Lock()

    def fetch_prefix(self, token_ids: Sequence[int], model_version: str, layout: KVLayout, *,
                     min_tokens: int = 0, cancelled: Callable[[], bool] | None = None) -> KVPages | None:
        with self._lock:
            self._calls += 1
            first = self._calls == 1
        if first:
            self.first_waiting.set()
            assert self.gate.wait(10)
        return None


def _job() -> ChunkJob:
    return ChunkJob(request_id="r", prompt_token_ids=tuple(range(1, 11)), max_new_tokens=400, max_tokens=400,
                    sampling=SamplingParams(temperature=0.0, ignore_eos=True), policy_version=0,
                    fetch_kv=True, dispatch_epoch=0)


def _done(h: object) -> DoneEvent:
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        ev = h.next_event(timeout=0.5)  # type: ignore[attr-defined]
        if isinstance(ev, DoneEvent):
            return ev
    raise AssertionError("chunk did not end")


def test_abort_reaches_the_twin_still_admitting() -> None:
    eng, pool = FakeEngine(), _GatedPool()
    w = Worker(eng, kv_pool=pool, kv_offload=False, speculation=False).start()
    try:
        result: dict[str, object] = {}

        def submit_a() -> None:
            try:
                result["a"] = w.submit(_job())
            except Exception as e:  # surfaced by the assertions below
                result["a"] = e

        ta = threading.Thread(target=submit_a)
        ta.start()
        assert pool.first_waiting.wait(10)
        hb = w.submit(_job())  # the twin: admitted while A still fetches; its finally ran
        assert w.abort("r")
        assert _done(hb).finish == ChunkFinish.ABORTED
        pool.gate.set()
        ta.join(10)
        ha = result["a"]
        assert not isinstance(ha, Exception), ha
        # The abort was meant for A too: it never runs.
        assert _done(ha).finish == ChunkFinish.ABORTED
        assert w._admitting == []
        assert not eng.has_unfinished()
    finally:
        w.close()
