"""After a restart the buffer lists pending work in submission order (not batch-id order): the
scheduler's queues are FIFO by the order it learns of requests, so the snapshot order decides which
batch runs first."""

from __future__ import annotations

import sys
import time
from pathlib import Path

from seer.v1 import rollout_pb2

from services.buffer.app import start as start_buffer
from services.buffer.config import BufferConfig
from services.buffer.core import BufferCore
from services.buffer.model import ModelInfo
from services.buffer.records import GroupSpec, Sampling
from services.buffer.store import Store
from services.common.server import start_server
from services.scheduler.config import SchedulerConfig
from services.scheduler.server import add_to_server
from services.scheduler.service import Dispatcher

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "e2e"))
from e2e_fake_worker import FakeWorker


def _core(path: Path) -> BufferCore:
    return BufferCore(Store(path), ModelInfo(vocab_size=1000, max_context=4096, tokenizer=None))


def _groups(n: int, size: int) -> list[GroupSpec]:
    return [GroupSpec(prompt_key=f"k{g}", prompt_token_ids=(1, 2, 3), group_size=size, max_tokens=8,
                      sampling=Sampling(seed=g)) for g in range(n)]


def test_the_snapshot_after_a_restart_keeps_submission_order(tmp_path: Path) -> None:
    core = _core(tmp_path / "db")
    for bid in ("zeta", "alpha", "mid"):  # submission order differs from id order
        core.submit_batch(bid, _groups(2, 2))
    before = [it.request_id for it in core.watch("t")[0]]
    assert [r.split("/")[0] for r in before[::4]] == ["zeta", "alpha", "mid"]
    core.close()
    core = _core(tmp_path / "db")
    after = [it.request_id for it in core.watch("t")[0]]
    assert after == before  # before the fix: alpha, mid, zeta
    core.submit_batch("beta", _groups(1, 1))  # later submissions still come last
    core.close()
    core = _core(tmp_path / "db")
    assert [it.request_id for it in core.watch("t")[0]] == [*before, "beta/0/0"]
    core.close()


def test_a_scheduler_after_a_buffer_restart_runs_the_first_submitted_batch_first(tmp_path: Path) -> None:
    """End to end: the real buffer restarted on its RocksDB, a fresh real scheduler (FIFO policy)
    and one worker of 8 slots; the first 8 chunks it runs are the first-submitted batch's."""
    cfg = BufferConfig(port=0, data_dir=str(tmp_path / "db"), model_dir="", grace_seconds=0.0)
    running, core = start_buffer(cfg)
    core.submit_batch("zeta", _groups(2, 4))
    core.submit_batch("alpha", _groups(2, 4))
    running.stop(0)
    running, core = start_buffer(cfg)
    # The default heartbeat (2 s; 3 missed = removed): no worker dies here, and 0.3 s removed a
    # worker whose beats a loaded machine held up for 0.9 s mid-test.
    dispatcher = Dispatcher(SchedulerConfig(port=0, buffer_address=running.address, policy="divided",
                                            chunk_size=8, heartbeat_interval=2.0, grace_seconds=0.0))
    sched = start_server("scheduler", dispatcher.cfg, lambda s: add_to_server(dispatcher, s), on_stop=dispatcher.stop)
    dispatcher.start()
    worker = None
    try:
        deadline = time.monotonic() + 10
        while dispatcher.stats().pending_requests < 16:
            assert time.monotonic() < deadline, "the scheduler did not take the snapshot"
            time.sleep(0.02)
        worker = FakeWorker("w0", sched.address, token_delay=0.05)
        while len(worker.started) < 8:
            assert time.monotonic() < deadline, "no chunks dispatched"
            time.sleep(0.02)
        first = {rid.split("/")[0] for rid, _seq in worker.started[:8]}
        assert first == {"zeta"}, worker.started[:8]  # before the fix: alpha (batch-id order)
        assert core.get_batch("zeta").state == rollout_pb2.BATCH_STATE_RUNNING
    finally:
        if worker is not None:
            worker.close()
        sched.stop(0)
        running.stop(0)
