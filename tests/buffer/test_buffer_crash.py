"""kill -9 of a real buffer process: nothing acknowledged is lost, each result is streamed once."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from buffer_helpers import BufferProcess, commit, finish_all, group, run_chunk, snapshot, submit, token_for
from seer.v1 import buffer_pb2_grpc, rollout_pb2, rollout_pb2_grpc


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture
def proc(tmp_path: Path) -> Iterator[BufferProcess]:
    p = BufferProcess(tmp_path / "db", _free_port(), tmp_path / "buffer.log")
    p.start()
    yield p
    p.stop()


def _stubs(address: str) -> tuple[grpc.Channel, Any, Any]:
    ch = grpc.insecure_channel(address)
    grpc.channel_ready_future(ch).result(timeout=10)
    return ch, rollout_pb2_grpc.RolloutServiceStub(ch), buffer_pb2_grpc.BufferInternalServiceStub(ch)


def _length(item: Any) -> int:
    return 3 + (item.group_index + item.sample_index) % 4  # 3..6 tokens, 2-3 chunks of 2


def test_kill9_mid_batch_then_resume(proc: BufferProcess) -> None:
    ch, rollout, internal = _stubs(proc.address)
    submit(rollout, "crash", [group(group_size=4, max_tokens=8, prompt_key=f"p{g}") for g in range(4)])
    items = sorted(snapshot(internal), key=lambda it: it.request_id)
    assert len(items) == 16
    # Half the requests finish; the other half get their first chunk only.
    finish_all(internal, items[:8], length=_length)
    for it in items[8:]:
        run_chunk(internal, it, 0, 0, 2, _length(it))
    # The trainer reads 5 results, then the buffer dies hard.
    stream = rollout.StreamResults(rollout_pb2.StreamResultsRequest(batch_id="crash"), timeout=10)
    seen = [next(stream) for _ in range(5)]
    stream.cancel()
    cursor = seen[-1].cursor
    ch.close()
    proc.kill9()

    proc.start()
    ch, rollout, internal = _stubs(proc.address)
    # The work feed resumes every unfinished request exactly where its acknowledged chunks ended.
    resumed = {it.request_id: it for it in snapshot(internal)}
    assert sorted(resumed) == sorted(it.request_id for it in items[8:])
    for rid, it in resumed.items():
        assert (it.next_seq, list(it.output_token_ids)) == (1, [token_for(rid, 0), token_for(rid, 1)])
    # A retry of a chunk acknowledged before the crash is recognized as a duplicate.
    last = items[8]
    assert commit(internal, last.request_id, 0, [token_for(last.request_id, p) for p in range(2)]).duplicate
    finish_all(internal, resumed.values(), length=_length)
    rest = list(rollout.StreamResults(rollout_pb2.StreamResultsRequest(batch_id="crash", cursor=cursor), timeout=10))
    results = [r.result for r in seen] + [r.result for r in rest]
    assert [r.cursor for r in rest] == list(range(cursor + 1, 17))
    ids = [r.request_id for r in results]
    assert sorted(ids) == sorted(it.request_id for it in items)  # each exactly once, nothing lost
    for r in results:
        assert list(r.token_ids) == [token_for(r.request_id, p) for p in range(len(r.token_ids))]
        assert len(r.token_ids) == _length(next(it for it in items if it.request_id == r.request_id))
    status = rollout.GetBatch(rollout_pb2.GetBatchRequest(batch_id="crash"))
    assert (status.state, status.num_finished) == (rollout_pb2.BATCH_STATE_COMPLETED, 16)
    ch.close()


def test_kill9_during_a_commit_storm_loses_no_acknowledged_chunk(proc: BufferProcess) -> None:
    ch, rollout, internal = _stubs(proc.address)
    submit(rollout, "storm", [group(group_size=8, max_tokens=1000) for _ in range(2)])
    items = snapshot(internal)
    acked: dict[str, int] = {}  # request id -> highest seq acknowledged
    stop = threading.Event()

    def committer(my_items: list[Any]) -> None:
        seq = 0
        while not stop.is_set() and seq < 500:
            for it in my_items:
                try:
                    run_chunk(internal, it, seq, 2 * seq, 2, 1000)
                except grpc.RpcError:
                    return
                acked[it.request_id] = seq
            seq += 1

    threads = [threading.Thread(target=committer, args=(items[i::2],)) for i in range(2)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 20
    while len(acked) < 16 and time.monotonic() < deadline:  # every request has at least one chunk
        time.sleep(0.02)
    time.sleep(0.1)
    proc.kill9()  # mid-storm: commits are in flight
    stop.set()
    for t in threads:
        t.join(10)
    ch.close()
    assert acked, "no commit was acknowledged before the kill"

    proc.start()
    ch, rollout, internal = _stubs(proc.address)
    after = {it.request_id: it for it in snapshot(internal)}
    assert len(after) == 16  # the storm was stopped long before any request could finish
    for rid, seq in acked.items():
        it = after[rid]
        assert it.next_seq >= seq + 1, (rid, seq, it.next_seq)
        assert list(it.output_token_ids) == [token_for(rid, p) for p in range(2 * it.next_seq)]
    # The batch counters agree with the chunks (the commit and its counters were one write).
    status = rollout.GetBatch(rollout_pb2.GetBatchRequest(batch_id="storm", include_requests=True))
    assert status.generated_tokens == sum(len(it.output_token_ids) for it in after.values())
    assert {r.request_id: r.num_chunks for r in status.requests} == {k: v.next_seq for k, v in after.items()}
    ch.close()


def test_sigterm_stops_gracefully_and_keeps_state(proc: BufferProcess) -> None:
    ch, rollout, internal = _stubs(proc.address)
    submit(rollout, "graceful", [group(group_size=2)])
    commit(internal, "graceful/0/0", 0, [5, 6])
    ch.close()
    assert proc.proc is not None
    proc.proc.terminate()
    assert proc.proc.wait(30) == 0
    proc.start()
    ch, rollout, internal = _stubs(proc.address)
    assert {it.request_id: it.next_seq for it in snapshot(internal)} == {"graceful/0/0": 1, "graceful/0/1": 0}
    assert submit(rollout, "graceful", [group(group_size=2)]).already_submitted
    ch.close()
