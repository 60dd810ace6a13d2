"""run_batch and collect take iter_results' `timeout`: before, they had none, so a batch that never
progresses (no worker, a stuck scheduler) blocked the trainer for ever, whatever SeerClient's own
per-call timeout said (a results stream is open-ended by design)."""

from __future__ import annotations

import pickle
import re
import threading
import time
from collections.abc import Callable

import pytest
from client_helpers import Buffer, batch_submitted, finish_request
from seer_client import PromptGroup, SeerClient, SeerError, SeerTimeout

GROUPS = [PromptGroup(prompt=[1, 2], group_size=2, max_tokens=4)]


def _bounded(call: Callable[[], object], bound: float) -> BaseException | None:
    """Runs `call` in a thread; the exception it raised, failing the test when still blocked after `bound`."""
    box: dict[str, BaseException] = {}

    def target() -> None:
        try:
            call()
        except BaseException as e:
            box["error"] = e

    t = threading.Thread(target=target, daemon=True)
    t.start()
    t.join(bound)
    assert not t.is_alive(), f"still blocked after {bound}s"
    return box.get("error")


def test_a_stalled_batch_times_out(buffer: Buffer) -> None:
    """No scheduler serves the buffer: the batch never progresses. One of its two requests is
    finished by hand, so the timeout also cuts a batch that progressed and then stalled."""
    seen: list[str] = []
    with SeerClient(buffer.address) as client:
        client.wait_ready(10)
        client.submit_batch("stall", GROUPS)
        finish_request(buffer.address, "stall/0/0")
        t0 = time.monotonic()
        err = _bounded(lambda: client.run_batch("stall", GROUPS, on_result=lambda r: seen.append(r.request_id),
                                                timeout=1.0), 15)
        assert isinstance(err, TimeoutError)  # before the SeerTimeout check, which narrows further
        assert isinstance(err, SeerTimeout) and err.code == "DEADLINE_EXCEEDED", repr(err)
        assert 0.9 <= time.monotonic() - t0 < 10
        assert "batch 'stall'" in err.message and "cursor 1" in err.message, err.message
        assert seen == ["stall/0/0"]
        # Not cancelled: the unfinished request is still pending, and collect is bounded the same way.
        assert client.get_batch("stall").num_cancelled == 0
        t0 = time.monotonic()
        err = _bounded(lambda: client.collect("stall", timeout=0.5), 15)
        assert isinstance(err, SeerTimeout), repr(err)
        assert 0.4 <= time.monotonic() - t0 < 10
        # Done batches still return everything; None stays "until the batch is done".
        finish_request(buffer.address, "stall/0/1")
        assert [r.cursor for r in client.collect("stall", timeout=10)] == [1, 2]
        assert len(client.run_batch("stall", GROUPS, timeout=None)) == 2


def test_a_bad_timeout_is_refused_before_the_batch_is_submitted(buffer: Buffer) -> None:
    with SeerClient(buffer.address) as client:
        with pytest.raises(SeerError, match="timeout: must be a number") as info:
            client.run_batch("never", GROUPS, timeout=float("nan"))
        assert info.value.code == "INVALID_ARGUMENT"
        with pytest.raises(SeerError, match="timeout: must be a number"):
            client.run_batch("never", GROUPS, timeout="10")  # type: ignore[arg-type]
        assert not batch_submitted(buffer.address, "never")
        with pytest.raises(SeerError, match="timeout: must be a number"):
            client.collect("never", timeout=float("nan"))


def test_a_timeout_says_what_it_knows_and_keeps_the_results(buffer: Buffer) -> None:
    """Every worker dead (here: none registered; one request of three finished by hand): run_batch
    ended on its timeout with only "results not complete after 1.5s (cursor 1)", and the result it
    had received was lost with the error. Now the SeerTimeout names the counts (received, missing)
    and how long no new result came, and carries the results on `.results` (collect's too), so a
    trainer can use them or resubmit the rest."""
    groups = [PromptGroup(prompt=[1, 2], group_size=3, max_tokens=4)]
    with SeerClient(buffer.address) as client:
        client.wait_ready(10)
        client.submit_batch("dead", groups, submission_token="tok-dead")
        finish_request(buffer.address, "dead/0/0")
        err = _bounded(lambda: client.run_batch("dead", groups, timeout=1.5, submission_token="tok-dead"), 15)
        assert isinstance(err, SeerTimeout), repr(err)
        assert [r.request_id for r in err.results] == ["dead/0/0"], err.results
        assert "1 of 3 results received, 2 missing" in err.message, err.message
        # The one result came at once (it was stored before the stream opened): none since then.
        m = re.search(r"no new result for ([0-9.]+)s", err.message)
        assert m is not None and 1.0 <= float(m.group(1)) <= 10, err.message
        assert "cursor 1" in err.message and err.submission_token == "tok-dead", err.message
        # collect keeps them too (its docstring said they were dropped); no size known there.
        err = _bounded(lambda: client.collect("dead", timeout=0.5), 15)
        assert isinstance(err, SeerTimeout), repr(err)
        assert [r.request_id for r in err.results] == ["dead/0/0"], err.results
        assert "1 result(s) received" in err.message and "no new result for" in err.message, err.message
        # Nothing at all arrived: said so, with an empty list.
        err = _bounded(lambda: client.collect("dead", cursor=1, timeout=0.5), 15)
        assert isinstance(err, SeerTimeout) and err.results == [], repr(err)
        assert "0 result(s) received" in err.message and "no new result for" in err.message, err.message
        # The batch is left running, as before.
        assert client.get_batch("dead").num_cancelled == 0


def test_a_timeout_with_its_results_pickles() -> None:
    """A SeerTimeout crossing a process boundary (multiprocessing) keeps its results and token."""
    timeout = SeerTimeout("DEADLINE_EXCEEDED", "batch 'x': ...", results=[])
    timeout.submission_token = "tok"
    again = pickle.loads(pickle.dumps(timeout))
    assert (again.code, again.message, again.results, again.submission_token) == (
        "DEADLINE_EXCEEDED", "batch 'x': ...", [], "tok")
