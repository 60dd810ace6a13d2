"""The pure core under concurrency (real RocksDB, no gRPC), and the stored encodings."""

from __future__ import annotations

import random
import threading
from pathlib import Path

import pytest

from services.buffer import codec
from services.buffer.convert import WorkItemEncoder
from services.buffer.core import BufferCore, Commit
from services.buffer.model import ModelInfo
from services.buffer.records import (
    BatchRecord,
    BatchState,
    ChunkStats,
    FinishReason,
    GroupRecord,
    GroupSpec,
    HistoryIteration,
    RequestRecord,
    RequestState,
    RolloutResult,
    Sampling,
    decode_history,
    encode_history,
)
from services.buffer.store import Store
from services.common.errors import Aborted


def _core(path: Path) -> BufferCore:
    return BufferCore(Store(path), ModelInfo(vocab_size=1000, max_context=4096, tokenizer=None))


def _tokens(rid: str, start: int, n: int) -> list[int]:
    return [(hash((rid, p)) % 900) + 10 for p in range(start, start + n)]


def test_concurrent_commits_retries_and_streaming_are_exactly_once(tmp_path: Path) -> None:
    core = _core(tmp_path / "db")
    groups = [GroupSpec(prompt_key=f"p{g}", prompt_token_ids=(1, 2, 3), group_size=8, max_tokens=64,
                        sampling=Sampling(temperature=1.0, seed=g)) for g in range(6)]
    core.submit_batch("conc", groups)
    snapshot, sub = core.watch("t")
    lengths = {it.request_id: 5 + (hash(it.request_id) % 40) for it in snapshot}
    streamed: list[str] = []
    errors: list[BaseException] = []

    def stream() -> None:
        try:
            streamed.extend(r.request_id for _i, r in core.iter_results("conc", poll_seconds=0.05))
        except BaseException as e:  # pragma: no cover - reported below
            errors.append(e)

    def work(items: list[str], seed: int) -> None:
        rng = random.Random(seed)
        try:
            for rid in items:
                total, pos, seq = lengths[rid], 0, 0
                while pos < total:
                    n = min(rng.randint(1, 9), total - pos)
                    reason = FinishReason.STOP if pos + n == total else FinishReason.CHUNK
                    c = Commit(rid, seq, _tokens(rid, pos, n), [-0.1 * (pos + i) for i in range(n)], reason, 0)
                    assert core.commit_chunk(c).accepted
                    if rng.random() < 0.3:  # a retried commit (lost acknowledgement)
                        assert core.commit_chunk(c).duplicate
                    pos, seq = pos + n, seq + 1
        except BaseException as e:  # pragma: no cover - reported below
            errors.append(e)

    reader = threading.Thread(target=stream)
    reader.start()
    rids = sorted(lengths)
    workers = [threading.Thread(target=work, args=(rids[i::4], i)) for i in range(4)]
    for t in workers:
        t.start()
    for t in workers:
        t.join(60)
    reader.join(30)
    assert not errors, errors
    assert sorted(streamed) == rids  # every response exactly once
    results = {r.request_id: r for _i, r in core.iter_results("conc")}
    for rid, r in results.items():
        assert list(r.token_ids) == _tokens(rid, 0, lengths[rid])
        assert len(r.logprobs) == lengths[rid] and r.finish_reason == FinishReason.STOP
    status = core.get_batch("conc", include_requests=True)
    assert status.state == BatchState.COMPLETED and status.generated_tokens == sum(lengths.values())
    assert sum(len(it.lengths) for k in (f"p{g}" for g in range(6)) for it in core.history(k)[:1]) == 48
    core.unwatch(sub)
    core.close()


def test_conflicting_retry_is_refused_by_the_core(tmp_path: Path) -> None:
    core = _core(tmp_path / "db")
    core.submit_batch("b", [GroupSpec(prompt_token_ids=(1,), group_size=1, max_tokens=8)])
    core.commit_chunk(Commit("b/0/0", 0, [5, 6], [-1.0, -2.0], FinishReason.CHUNK, 0))
    with pytest.raises(Aborted) as e:
        core.commit_chunk(Commit("b/0/0", 0, [5, 6], [-1.0, -2.5], FinishReason.CHUNK, 0))
    assert e.value.field == "seq"
    core.close()


def test_synced_writes(tmp_path: Path) -> None:
    core = BufferCore(Store(tmp_path / "db", sync=True), ModelInfo(1000, 4096, None))
    core.submit_batch("s", [GroupSpec(prompt_token_ids=(1,), group_size=1, max_tokens=4)])
    assert core.commit_chunk(Commit("s/0/0", 0, [5], [-1.0], FinishReason.STOP, 0)).request_finished
    core.close()
    again = BufferCore(Store(tmp_path / "db"), ModelInfo(1000, 4096, None))
    assert [r.request_id for _i, r in again.iter_results("s")] == ["s/0/0"]
    again.close()


def test_records_round_trip() -> None:
    b = BatchRecord("b", "h", 3, 1.5, 2, 10, BatchState.CANCELLED, 4, 6, 99)
    assert BatchRecord.decode(b.encode(), key=b"b/b") == b
    g = GroupRecord("b", 1, "k", codec.i32([1, 2, 3]), 4, 16,
                    Sampling(0.7, 0.9, 5, 2**64 - 1, (1, 2), True), {"answer": "5"})
    g2 = GroupRecord.decode(g.encode(), key=b"g")
    assert g2 == g and g2.sampling.stop_token_ids == (1, 2)
    r = RequestRecord("b", 1, 2, 2**64 - 1, RequestState.FINISHED, 3, 17, FinishReason.LENGTH,
                      ChunkStats(1, 2, 3, 4, 5, 6, 0.25, 8))
    assert RequestRecord.decode(r.encode(), key=b"r") == r
    res = RolloutResult("b/1/2", "b", 1, 2, "k", codec.i32([7, 8]), codec.f32([-0.5, -0.25]), FinishReason.STOP,
                        3, ChunkStats(steps=2), 1, 0.5, {"a": "b"}, "text")
    assert RolloutResult.decode(res.encode(), key=b"l") == res
    hist = [HistoryIteration("b", 3, [2, 1], [codec.i32([1, 2]), codec.i32([3])]),
            HistoryIteration("a", 2, [0], [codec.i32()])]
    assert decode_history(encode_history(hist), key=b"h/k") == hist
    with pytest.raises(ValueError):
        codec.decode(b"nope")


def test_trace_context_rides_on_every_work_item_and_survives_a_restart(tmp_path: Path) -> None:
    """The submitter's trace context is stored with the batch and handed on with each of its work
    items (so the scheduler's dispatch spans join the trainer's trace), also after a restart; a
    resubmission keeps the first context, and a batch without one hands on none."""
    parent = {"traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"}
    core = _core(tmp_path / "db")
    core.submit_batch("t", [GroupSpec(prompt_token_ids=(1, 2), group_size=2, max_tokens=4)], trace_context=parent)
    core.submit_batch("t", [GroupSpec(prompt_token_ids=(1, 2), group_size=2, max_tokens=4)],
                      trace_context={"traceparent": "00-ffffffffffffffffffffffffffffffff-b7ad6b7169203331-01"})
    core.submit_batch("u", [GroupSpec(prompt_token_ids=(3,), group_size=1, max_tokens=4)])
    items, sub = core.watch("w")
    core.unwatch(sub)
    by_batch = {(w.batch_id, w.request_id): dict(w.trace_context) for w in items}
    assert by_batch == {("t", "t/0/0"): parent, ("t", "t/0/1"): parent, ("u", "u/0/0"): {}}
    pb = WorkItemEncoder().encode(next(w for w in items if w.batch_id == "t"))
    assert dict(pb.trace_context) == parent
    core.close()
    again = _core(tmp_path / "db")
    items, sub = again.watch("w")
    again.unwatch(sub)
    assert {w.request_id: dict(w.trace_context) for w in items}["t/0/1"] == parent
    again.close()


def test_feed_batches_keep_order_and_limits() -> None:
    """WatchWork messages: items in order, at most max_items and max_tokens token ids each (an item
    over the token limit goes alone), and a cancellation flushes the items queued before it."""
    from types import SimpleNamespace

    from services.buffer.events import Added, Cancelled, batches, coalesce

    def item(name: str, n: int) -> SimpleNamespace:
        return SimpleNamespace(name=name, prompt_token_ids=[0] * n, output_token_ids=[],
                               sampling=SimpleNamespace(stop_token_ids=()))

    items = [item(f"i{k}", n) for k, n in enumerate([3, 3, 3, 9, 1, 1, 1, 1, 1])]
    cut = [[it.name for it in b] for b in batches(items, max_items=3, max_tokens=6)]
    assert cut == [["i0", "i1"], ["i2"], ["i3"], ["i4", "i5", "i6"], ["i7", "i8"]]
    events: list[Added | Cancelled] = [Added(items[0]), Added(items[1]), Cancelled("x"), Added(items[4]),
                                       Cancelled("y")]
    msgs = [m.request_id if isinstance(m, Cancelled) else [it.name for it in m] for m in coalesce(events)]
    assert msgs == [["i0", "i1"], "x", ["i4"], "y"]


def test_submission_numbers_never_repeat_across_a_restart_after_retention(tmp_path: Path) -> None:
    """A batch id used again is told from its deleted namesake by its submission number. The
    counter was rebuilt from the stored batches after a restart, so once retention deleted the
    newest batch a later one got that batch's number again (its requests would be taken for a
    re-delivery of the deleted one's)."""
    def core() -> BufferCore:
        return BufferCore(Store(tmp_path / "db"), ModelInfo(vocab_size=1000, max_context=4096, tokenizer=None),
                          retain_batches=1)

    spec = [GroupSpec(prompt_token_ids=(1, 2), group_size=1, max_tokens=4)]
    first = core()
    first.submit_batch("x", spec)
    first.submit_batch("y", spec)
    numbers = {w.batch_id: w.submit_seq for w in first.watch("w")[0]}
    assert numbers == {"x": 1, "y": 2}
    first.cancel_batch("y")
    first.cancel_batch("x")  # y, the newest submission, is the oldest finished: retention deletes it
    first.close()
    again = core()
    again.submit_batch("y", spec)
    (item,) = [w for w in again.watch("w2")[0] if w.batch_id == "y"]
    assert item.submit_seq == 3
    again.close()
