"""run_batch cancels its own submission when on_result raises or the results stream fails for good
(cancel_on_error, on by default), as it does on Ctrl-C. Before, only a KeyboardInterrupt cancelled:
the batch went on generating on the cluster with nobody reading it (the Node client's rollout()
cancels in both cases). Real buffer (in process: real gRPC and RocksDB); a scheduler thread that
finishes one request at a time, so a batch is still running after its first result."""

from __future__ import annotations

import threading
import time

import pytest
from client_helpers import Buffer, finish_request
from seer_client import CancelOutcome, PromptGroup, RolloutResult, SeerClient, SeerError, SeerTimeout
from test_node_client_api import _commit

from services.common import server as common_server

GROUPS = [PromptGroup(prompt=[1, 2, 3], group_size=4, max_tokens=4)]


class TrainerBug(Exception):
    pass


@pytest.mark.parametrize("error", [TrainerBug("reward crashed"), SeerTimeout("DEADLINE_EXCEEDED", "its own call")],
                         ids=["exception", "seer-timeout-of-its-own"])
def test_on_result_raising_cancels_the_batch(error: Exception, buffer: Buffer, one_at_a_time: None) -> None:
    """The exception propagates unchanged (the same object), with a note saying what the cancel
    did. A SeerTimeout on_result raised (a call of its own) is on_result's error, not the batch's
    timeout: cancelled too."""
    def on_result(_r: RolloutResult) -> None:
        raise error

    with SeerClient(buffer.address) as client:
        client.wait_ready(10)
        with pytest.raises(type(error)) as info:
            client.run_batch("cb", GROUPS, on_result=on_result, timeout=30)
        assert info.value is error
        assert getattr(info.value, "__notes__", []) == ["seer_client: batch cb: cancelled (3 unfinished responses)"]
        status = client.get_batch("cb")
        assert (status.state, status.num_finished, status.num_cancelled) == ("cancelled", 1, 3)


def test_cancel_on_error_false_leaves_it_running(buffer: Buffer, one_at_a_time: None) -> None:
    def on_result(_r: RolloutResult) -> None:
        raise TrainerBug("reward crashed")

    with SeerClient(buffer.address) as client:
        client.wait_ready(10)
        with pytest.raises(TrainerBug) as info:
            client.run_batch("keep", GROUPS, on_result=on_result, timeout=30, cancel_on_error=False)
        assert not getattr(info.value, "__notes__", [])
        assert client.get_batch("keep").state == "running"


def test_a_stream_failed_for_good_cancels_the_batch(buffer: Buffer) -> None:
    """The buffer is down longer than the client's retry_seconds: the stream fails for good
    (UNAVAILABLE). The cancel retries for a few seconds of its own and reaches the restarted buffer
    (the batch is stored in RocksDB, still running): cancelled, and the stream's error propagates."""
    with SeerClient(buffer.address, retry_seconds=0) as client, SeerClient(buffer.address) as observer:
        client.wait_ready(10)

        def restart() -> None:
            deadline = time.monotonic() + 20
            while time.monotonic() < deadline:
                try:
                    observer.get_batch("down")
                    break
                except SeerError:
                    time.sleep(0.02)
            time.sleep(0.3)  # into the results wait
            buffer.stop()  # the open stream breaks; retry_seconds 0: for good
            time.sleep(1.0)
            buffer.start()

        t = threading.Thread(target=restart, daemon=True)
        t.start()
        with pytest.raises(SeerError) as info:
            client.run_batch("down", GROUPS, timeout=30)
        t.join(10)
        assert not isinstance(info.value, SeerTimeout) and info.value.code == "UNAVAILABLE", info.value
        assert getattr(info.value, "__notes__", []) == ["seer_client: batch down: cancelled (4 unfinished responses)"]
        assert observer.get_batch("down").state == "cancelled"


def test_a_timeout_still_leaves_the_batch_running(buffer: Buffer) -> None:
    with SeerClient(buffer.address) as client:
        client.wait_ready(10)
        with pytest.raises(SeerTimeout) as info:
            client.run_batch("slow", GROUPS, timeout=0.3)
        notes = getattr(info.value, "__notes__", [])
        assert len(notes) == 1 and "not cancelled" in notes[0], notes
        assert client.get_batch("slow").state == "running"


def test_on_result_exiting_cancels_the_batch(buffer: Buffer, one_at_a_time: None) -> None:
    """sys.exit() in on_result (a BaseException, not an Exception): cancelled too. Before, it left
    the batch running, with no note."""
    def on_result(_r: RolloutResult) -> None:
        raise SystemExit(3)

    with SeerClient(buffer.address) as client:
        client.wait_ready(10)
        with pytest.raises(SystemExit) as info:
            client.run_batch("exit", GROUPS, on_result=on_result, timeout=30)
        assert getattr(info.value, "__notes__", []) == ["seer_client: batch exit: cancelled (3 unfinished responses)"]
        assert client.get_batch("exit").state == "cancelled"


def test_on_result_raising_on_the_last_result_says_the_batch_completed(buffer: Buffer) -> None:
    """The batch is complete when on_result raises on its last result: the cancel changes nothing,
    and the note says so (it said "cancelled (0 unfinished responses)" of a completed batch)."""
    groups = [PromptGroup(prompt=[1, 2, 3], group_size=2, max_tokens=4)]
    seen: list[RolloutResult] = []

    def on_result(r: RolloutResult) -> None:
        seen.append(r)
        if len(seen) == 2:
            raise TrainerBug("reward crashed on the last one")

    with SeerClient(buffer.address) as client:
        client.wait_ready(10)
        client.submit_batch("last", groups, submission_token="tok-last")
        finish_request(buffer.address, "last/0/0")
        finish_request(buffer.address, "last/0/1")
        with pytest.raises(TrainerBug) as info:
            client.run_batch("last", groups, on_result=on_result, timeout=30, submission_token="tok-last")
        notes = getattr(info.value, "__notes__", [])
        assert notes == ["seer_client: batch last: nothing to cancel: the batch had completed"], notes
        assert client.get_batch("last").state == "completed"
        assert client.cancel_submission("last", "tok-last") == CancelOutcome("last", "completed")


@pytest.mark.parametrize("own_token", [True, False], ids=["same-token", "fresh-token"])
def test_results_left_out_by_the_buffer_cancel_nothing(own_token: bool, buffer: Buffer,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """A result over the buffer's message limit is left out, and the stream that skipped it ends
    RESOURCE_EXHAUSTED once the batch is done. run_batch took that for a failed stream: it cancelled
    the completed batch (or, with a fresh token, had the buffer record that token as cancelled) and
    noted "cancelled (0 unfinished responses)"."""
    buffer.stop()
    monkeypatch.setattr(common_server, "MAX_MESSAGE_BYTES", 4096)  # read when the server starts
    buffer.start()
    groups = [PromptGroup(prompt=[1, 2, 3], group_size=2, max_tokens=2000)]
    with SeerClient(buffer.address) as client:
        client.wait_ready(10)
        client.submit_batch("lo", groups, submission_token="tok-lo")
        for seq in range(8):  # the first result (cursor 0): 2000 tokens, over the limit
            _commit(buffer.address, "lo/0/0", seq, [4 + (i % 14) for i in range(250)], last=seq == 7)
        finish_request(buffer.address, "lo/0/1")
        with pytest.raises(SeerError) as info:
            client.run_batch("lo", groups, timeout=30, submission_token="tok-lo" if own_token else None)
        assert info.value.code == "RESOURCE_EXHAUSTED" and "left out" in info.value.message, info.value
        assert not getattr(info.value, "__notes__", []), info.value.__notes__
        assert client.get_batch("lo").state == "completed"
