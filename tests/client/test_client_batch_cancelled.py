"""A batch cancelled by someone else while a trainer awaits its results: iter_results, collect and
run_batch raise BatchCancelled (a SeerError, ABORTED) naming how many of its responses finished,
with the results received on it. The buffer ends the results stream of a cancelled batch as it does
a completed one's; before, the three returned the 1 finished response of 4 as if it were the whole
batch, and a GRPO loop went on with incomplete groups (the Node client's rollout() already rejected
ABORTED there). Real buffer on loopback (in process: real gRPC and RocksDB)."""

from __future__ import annotations

import dataclasses
import pickle
import threading

import pytest
from client_helpers import Buffer, finish_request, play_scheduler
from seer_client import BatchCancelled, PromptGroup, RolloutResult, SeerClient, SeerError

GROUPS = [PromptGroup(prompt=[1, 2, 3], group_size=4, max_tokens=4)]
MESSAGE = "was cancelled before it completed: 1 of 4 responses finished, 3 cancelled (the rest will not come)"


def test_iter_results_raises_after_yielding_what_it_got(buffer: Buffer) -> None:
    with SeerClient(buffer.address) as client:
        client.submit_batch("it", GROUPS)
        finish_request(buffer.address, "it/0/0")
        it = client.iter_results("it", timeout=30)
        assert next(it).request_id == "it/0/0"
        # Another process's cancel (an operator, `seer` on the command line) while the stream waits.
        with SeerClient(buffer.address) as other:
            assert other.cancel_batch("it") == 3
        with pytest.raises(BatchCancelled) as e:
            next(it)
        assert isinstance(e.value, SeerError) and e.value.code == "ABORTED"
        assert e.value.message == f"batch 'it' {MESSAGE}", e.value
        assert (e.value.batch_id, e.value.num_finished, e.value.num_requests, e.value.results) == ("it", 1, 4, [])


def test_collect_raises_with_the_results_received(buffer: Buffer) -> None:
    with SeerClient(buffer.address) as client:
        client.submit_batch("co", GROUPS)
        finish_request(buffer.address, "co/0/2")
        client.cancel_batch("co")
        with pytest.raises(BatchCancelled) as e:
            client.collect("co", timeout=30)
        assert [r.request_id for r in e.value.results] == ["co/0/2"]
        assert e.value.message == f"batch 'co' {MESSAGE}"
        # From a cursor past every result too: the batch is still incomplete.
        with pytest.raises(BatchCancelled) as e:
            client.collect("co", cursor=1, timeout=30)
        assert e.value.results == []


def test_run_batch_raises_and_cancels_nothing(buffer: Buffer, one_at_a_time: None) -> None:
    """on_result stands for another process: it cancels the batch after the first result."""
    def on_result(_r: RolloutResult) -> None:
        with SeerClient(buffer.address) as other:
            other.cancel_batch("rb")

    with SeerClient(buffer.address) as client:
        with pytest.raises(BatchCancelled) as e:
            client.run_batch("rb", GROUPS, on_result=on_result, timeout=30)
        assert [r.request_id for r in e.value.results] == ["rb/0/0"]
        assert e.value.message == f"batch 'rb' {MESSAGE}"
        # run_batch did not take it for a failed stream (cancel_on_error): no cancel of its own, no note.
        assert not getattr(e.value, "__notes__", None)
        status = client.get_batch("rb")
        assert (status.state, status.num_finished, status.num_cancelled) == ("cancelled", 1, 3)


def test_a_completed_batch_ends_quietly(buffer: Buffer) -> None:
    t = threading.Thread(target=play_scheduler, args=(buffer.address,), daemon=True)
    t.start()
    with SeerClient(buffer.address) as client:
        assert len(client.run_batch("done", GROUPS, timeout=30)) == 4
        # A cancel of a completed batch changes nothing: still complete.
        client.cancel_batch("done")
        assert len(client.collect("done", timeout=30)) == 4
        assert list(client.iter_results("done", cursor=4, timeout=30)) == []


def test_a_batch_retention_deleted_ends_quietly(buffer: Buffer) -> None:
    """A reader back at the end of a batch that retention deleted meanwhile: the stream ends OK (it
    had every result), and the batch's state is gone with it: no NOT_FOUND from the check."""
    buffer.stop()
    buffer.cfg = dataclasses.replace(buffer.cfg, retain_batches=1)
    buffer.start()
    with SeerClient(buffer.address) as client:
        client.submit_batch("old", [PromptGroup(prompt=[1], group_size=1, max_tokens=4)])
        finish_request(buffer.address, "old/0/0")
        assert [r.cursor for r in client.collect("old", timeout=30)] == [1]
        client.submit_batch("new", [PromptGroup(prompt=[1], group_size=1, max_tokens=4)])
        finish_request(buffer.address, "new/0/0")  # finished after it: "old" is deleted
        with pytest.raises(SeerError) as gone:
            client.get_batch("old")
        assert gone.value.code == "NOT_FOUND"
        assert client.collect("old", cursor=1, timeout=30) == []


def test_it_pickles_with_its_results() -> None:
    e = BatchCancelled("batch 'x' was cancelled", batch_id="x", num_finished=1, num_requests=4)
    e.add_note("a note")
    back = pickle.loads(pickle.dumps(e))
    assert (type(back), back.code, back.message, back.batch_id, back.num_finished, back.num_requests,
            back.results, back.__notes__) == (BatchCancelled, "ABORTED", e.message, "x", 1, 4, [], ["a note"])
    assert str(back) == "ABORTED: batch 'x' was cancelled"


def test_a_check_that_cannot_be_made_keeps_the_results(buffer: Buffer, monkeypatch: pytest.MonkeyPatch) -> None:
    """The buffer goes down between the end of a complete stream and the cancel check's GetBatch:
    collect returns every result (logged), where it raised UNAVAILABLE and the caller lost a
    complete batch's results over a question answered only in the rare cancelled case."""
    t = threading.Thread(target=play_scheduler, args=(buffer.address,), daemon=True)
    t.start()
    with SeerClient(buffer.address, retry_seconds=0.5) as client:
        assert len(client.run_batch("whole", GROUPS, timeout=30)) == 4
        real = client._cancelled_elsewhere

        def buffer_gone_first(*args: object, **kwargs: object) -> BatchCancelled | None:
            buffer.stop()
            return real(*args, **kwargs)  # type: ignore[arg-type]

        monkeypatch.setattr(client, "_cancelled_elsewhere", buffer_gone_first)
        assert [r.cursor for r in client.collect("whole", timeout=30)] == [1, 2, 3, 4]


def test_the_prompt_hint_names_the_clients_field(buffer: Buffer) -> None:
    """A buffer without a tokenizer refuses a text prompt; the message's field is the client's
    `prompt`, and so is its hint (it said "send prompt_token_ids instead")."""
    with SeerClient(buffer.address) as client:
        with pytest.raises(SeerError) as info:
            client.submit_batch("text", [PromptGroup(prompt="hello", group_size=1, max_tokens=4)])
        message = info.value.message
        assert message.startswith("groups[0].prompt: ") and "prompt_token_ids" not in message, message


def test_run_batch_does_not_return_a_short_batch_when_the_check_fails(
        buffer: Buffer, one_at_a_time: None, monkeypatch: pytest.MonkeyPatch) -> None:
    """run_batch knows the batch's size: a stream that ended after 1 of 4 results is short, so a
    cancel check that cannot be made (the buffer gone) is an error naming both counts. The first
    version of the quiet end returned the 1 result as the whole batch."""
    def on_result(_r: RolloutResult) -> None:
        with SeerClient(buffer.address) as other:
            other.cancel_batch("short")

    with SeerClient(buffer.address, retry_seconds=0.5) as client:
        real = client._cancelled_elsewhere

        def buffer_gone_first(*args: object, **kwargs: object) -> BatchCancelled | None:
            buffer.stop()
            return real(*args, **kwargs)  # type: ignore[arg-type]

        monkeypatch.setattr(client, "_cancelled_elsewhere", buffer_gone_first)
        with pytest.raises(SeerError) as e:
            client.run_batch("short", GROUPS, on_result=on_result, timeout=30)
        assert e.value.code == "UNAVAILABLE" and "ended after 1 of 4 results" in e.value.message, e.value
