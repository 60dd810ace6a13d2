"""run_batch, the client's one-call API, cancels its own submission when Ctrl-C interrupts it (a
KeyboardInterrupt: SIGINT delivered to the main thread, as in a notebook or a script). Before, the
batch went on generating on the cluster with nobody reading it (only `seer rollout` cancelled), and
run_batch took no submission_token, so a trainer could not cancel only its own batch. Real buffer
(in process: real gRPC and RocksDB) with no scheduler: the batch never finishes by itself."""

from __future__ import annotations

import _thread
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import grpc
import pytest
from client_helpers import Buffer
from seer.v1 import rollout_pb2
from seer_client import PromptGroup, SeerClient, SeerError, SeerTimeout

GROUPS = [PromptGroup(prompt=[1, 2], group_size=2, max_tokens=4)]


def _stored(client: SeerClient, batch_id: str) -> bool:
    try:
        client.get_batch(batch_id)
    except SeerError as e:
        if e.code == "NOT_FOUND":
            return False
        raise
    return True


@pytest.fixture
def interrupt_when() -> Iterator[Callable[[Callable[[], bool]], None]]:
    """interrupt_when(cond): SIGINT to the main thread (a real KeyboardInterrupt where it runs)
    once cond() holds, polled from a helper thread."""
    threads: list[threading.Thread] = []

    def arm(cond: Callable[[], bool]) -> None:
        def run() -> None:
            deadline = time.monotonic() + 20
            while time.monotonic() < deadline:
                if cond():
                    time.sleep(0.2)  # into the results wait
                    _thread.interrupt_main()
                    return
                time.sleep(0.02)

        t = threading.Thread(target=run, daemon=True)
        t.start()
        threads.append(t)

    yield arm
    for t in threads:
        t.join(25)


def test_ctrl_c_while_waiting_cancels_the_batch(buffer: Buffer,
                                                interrupt_when: Callable[[Callable[[], bool]], None]) -> None:
    with SeerClient(buffer.address) as client, SeerClient(buffer.address) as observer:
        client.wait_ready(10)
        interrupt_when(lambda: _stored(observer, "nb"))
        with pytest.raises(KeyboardInterrupt) as info:
            client.run_batch("nb", GROUPS, timeout=30)
        status = client.get_batch("nb")
        assert (status.state, status.num_cancelled) == ("cancelled", 2)
        assert "seer_client: batch nb: cancelled (2 unfinished responses)" in getattr(info.value, "__notes__", [])


def test_the_cancel_can_be_turned_off(buffer: Buffer,
                                      interrupt_when: Callable[[Callable[[], bool]], None]) -> None:
    with SeerClient(buffer.address) as client:
        client.wait_ready(10)
        interrupt_when(lambda: _stored(client, "keep"))
        with pytest.raises(KeyboardInterrupt) as info:
            client.run_batch("keep", GROUPS, timeout=30, cancel_on_interrupt=False)
        assert client.get_batch("keep").state == "running"
        assert not getattr(info.value, "__notes__", [])


@pytest.mark.parametrize("token", [None, ""])
def test_another_runs_batch_under_the_id_is_left_running(
        token: str | None, buffer: Buffer, interrupt_when: Callable[[Callable[[], bool]], None]) -> None:
    """The id names a batch another run submitted (same content: this submission is
    already_submitted): the cancel names this submission's token, and that batch is left running.
    An empty token too is a fresh one (sent as is, the cancel named no submission and cancelled
    the other run's batch)."""
    with SeerClient(buffer.address) as other, SeerClient(buffer.address) as client:
        other.wait_ready(10)
        other.submit_batch("shared", GROUPS, submission_token="other-run")
        submitted = threading.Event()
        real = client.submit_batch

        def submit(*a: Any, **kw: Any) -> Any:
            out = real(*a, **kw)
            submitted.set()
            return out

        client.submit_batch = submit  # type: ignore[method-assign]
        interrupt_when(submitted.is_set)
        with pytest.raises(KeyboardInterrupt) as info:
            client.run_batch("shared", GROUPS, timeout=30, submission_token=token)
        assert client.get_batch("shared").state == "running"
        notes = getattr(info.value, "__notes__", [])
        assert len(notes) == 1 and "not cancelled: the batch id names another submission" in notes[0], notes


class _InterruptedSubmit:
    """The client's stub, with SubmitBatch interrupted before its reply: the request sent and
    stored (`stored`), or still in flight (`in_flight`: sent after the cancel, by `send_late`)."""

    def __init__(self, stub: Any, stored: bool) -> None:
        self._stub, self._stored = stub, stored
        self.late: rollout_pb2.SubmitBatchRequest | None = None

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stub, name)

    def SubmitBatch(self, req: rollout_pb2.SubmitBatchRequest, timeout: float | None = None) -> Any:
        if self._stored:
            self._stub.SubmitBatch(req, timeout=timeout)  # stored; the reply is "lost" to the interrupt
        else:
            self.late = req
        raise KeyboardInterrupt


@pytest.mark.parametrize("stored", [True, False], ids=["stored-before-the-reply", "still-in-flight"])
def test_ctrl_c_during_the_submission(stored: bool, buffer: Buffer) -> None:
    """Interrupted before SubmitBatch's reply: the batch stored is cancelled; a submission still in
    flight is answered "not stored" and, when it arrives, refused (nothing runs either way)."""
    with SeerClient(buffer.address) as client:
        client.wait_ready(10)
        stub = _InterruptedSubmit(client._stub, stored)
        client._stub = stub  # type: ignore[assignment]
        with pytest.raises(KeyboardInterrupt) as info:
            client.run_batch("sub", GROUPS, timeout=30)
        notes = getattr(info.value, "__notes__", [])
        if stored:
            assert notes == ["seer_client: batch sub: cancelled (2 unfinished responses)"]
            assert client.get_batch("sub").state == "cancelled"
            return
        assert len(notes) == 1 and "this submission was not stored" in notes[0], notes
        assert stub.late is not None and stub.late.submission_token
        with pytest.raises(grpc.RpcError) as late:
            stub._stub.SubmitBatch(stub.late, timeout=10)
        assert late.value.code() == grpc.StatusCode.CANCELLED
        assert not _stored(client, "sub")


def test_a_given_token_is_the_submissions(buffer: Buffer, interrupt_when: Callable[[Callable[[], bool]], None]
                                          ) -> None:
    """Collecting again after a SeerTimeout with the first call's token: a Ctrl-C then cancels the
    batch (the token names the submission that stored it)."""
    with SeerClient(buffer.address) as client:
        client.wait_ready(10)
        with pytest.raises(SeerError):
            client.run_batch("again", GROUPS, timeout=0.2, submission_token="trainer-step-7")
        assert client.get_batch("again").state == "running"  # a timeout does not cancel
        interrupt_when(lambda: True)
        with pytest.raises(KeyboardInterrupt):
            client.run_batch("again", GROUPS, timeout=30, submission_token="trainer-step-7")
        assert client.get_batch("again").state == "cancelled"
        with pytest.raises(SeerError) as bad:
            client.run_batch("again2", GROUPS, submission_token="has space")
        assert bad.value.message.startswith("submission_token:")
        assert not _stored(client, "again2")


def test_a_timeout_hands_back_the_generated_token(buffer: Buffer,
                                                  interrupt_when: Callable[[Callable[[], bool]], None]) -> None:
    """run_batch's SeerTimeout carries the token it generated: collecting the batch again with it,
    a Ctrl-C still cancels the batch (with another token it is "another submission", left running,
    and the generated token was nowhere to be had)."""
    with SeerClient(buffer.address) as client:
        client.wait_ready(10)
        with pytest.raises(SeerTimeout) as timed_out:
            client.run_batch("again", GROUPS, timeout=0.3)
        token = timed_out.value.submission_token
        assert token and any(token in n for n in getattr(timed_out.value, "__notes__", []))
        interrupt_when(lambda: True)
        with pytest.raises(KeyboardInterrupt):
            client.run_batch("again", GROUPS, timeout=30, submission_token=token)
        assert client.get_batch("again").state == "cancelled"
