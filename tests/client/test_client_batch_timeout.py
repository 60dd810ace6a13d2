"""run_batch and collect take iter_results' `timeout`: before, they had none, so a batch that never
progresses (no worker, a stuck scheduler) blocked the trainer for ever, whatever SeerClient's own
per-call timeout said (a results stream is open-ended by design)."""

from __future__ import annotations

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
