"""SeerClient's numbers of seconds and its other calls' arguments (real buffer): a NaN or a string
where seconds belong, or a non-str batch id, is a SeerError INVALID_ARGUMENT naming the argument,
raised at the call; an infinite timeout is no bound (it used to fail at once)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import pytest
from client_helpers import Buffer, _free_port, finish_request
from seer_client import PromptGroup, SeerClient, SeerError, SeerTimeout


@pytest.mark.parametrize("kw, field", [
    # Before: accepted; a NaN window made every `now + delay > deadline` False, so a call to a dead
    # address was retried forever (get_batch hung), and "60" failed with a bare TypeError at the
    # first failure.
    ({"retry_seconds": float("nan")}, "retry_seconds"),
    ({"retry_seconds": -1.0}, "retry_seconds"),
    ({"retry_seconds": "60"}, "retry_seconds"),
    # Before: accepted; every call then failed DEADLINE_EXCEEDED at once.
    ({"timeout": float("nan")}, "timeout"),
    ({"timeout": 0}, "timeout"),
    ({"timeout": "60"}, "timeout"),
])
def test_bad_seconds_in_the_constructor_name_the_argument(kw: dict[str, object], field: str) -> None:
    with pytest.raises(SeerError) as e:
        SeerClient(f"127.0.0.1:{_free_port()}", **kw)  # type: ignore[arg-type]
    assert e.value.code == "INVALID_ARGUMENT" and e.value.message.startswith(f"{field}:"), e.value.message


def test_retry_seconds_0_and_inf_are_accepted() -> None:
    with SeerClient(f"127.0.0.1:{_free_port()}", retry_seconds=0) as c:
        t0 = time.monotonic()
        with pytest.raises(SeerError) as e:
            c.get_batch("x")  # nothing listens: the first UNAVAILABLE is final
        assert e.value.code == "UNAVAILABLE" and time.monotonic() - t0 < 5
    SeerClient("127.0.0.1:1", retry_seconds=float("inf")).close()  # retry until it works


@pytest.mark.parametrize("call, field", [
    # Before: cancel_batch(5) was a bare TypeError and get_batch(None) was sent as batch "".
    (lambda c: c.get_batch(None), "batch_id"),
    (lambda c: c.get_batch(5), "batch_id"),
    (lambda c: c.get_batch("b", include_requests="yes"), "include_requests"),
    (lambda c: c.get_batch("b", include_requests=1), "include_requests"),
    (lambda c: c.cancel_batch(5), "batch_id"),
    (lambda c: c.update_weights(1, timeout=float("nan")), "timeout"),
    (lambda c: c.update_weights(1, timeout=0), "timeout"),
    (lambda c: c.iter_results("b", timeout=float("nan")), "timeout"),
    (lambda c: c.iter_results("b", timeout="5"), "timeout"),
])
def test_bad_arguments_of_the_other_calls_name_the_field(buffer: Buffer, call: Callable[[SeerClient], object],
                                                         field: str) -> None:
    with SeerClient(buffer.address, retry_seconds=0) as c, pytest.raises(SeerError) as e:
        call(c)
    assert e.value.code == "INVALID_ARGUMENT" and e.value.message.startswith(f"{field}:"), e.value.message


def test_an_infinite_iteration_timeout_is_no_bound(buffer: Buffer) -> None:
    # Before: timeout=inf raised SeerTimeout ("not complete after infs") at the first next(): grpc
    # fails a call with an infinite timeout at once.
    with SeerClient(buffer.address) as c:
        c.submit_batch("inf", [PromptGroup(prompt=[1, 2], group_size=1, max_tokens=4)])
        threading.Timer(0.3, finish_request, args=(buffer.address, "inf/0/0")).start()
        assert [r.request_id for r in c.iter_results("inf", timeout=float("inf"))] == ["inf/0/0"]
        # A deadline already passed stays a SeerTimeout, not an argument error.
        with pytest.raises(SeerTimeout):
            next(c.iter_results("inf", timeout=0))


def test_an_infinite_call_timeout_is_no_bound(buffer: Buffer) -> None:
    # Before: timeout=inf failed every call DEADLINE_EXCEEDED at once (update_weights' too).
    with SeerClient(buffer.address, timeout=float("inf")) as c:
        c.submit_batch("inf2", [PromptGroup(prompt=[1, 2], group_size=1, max_tokens=4)])
        assert c.get_batch("inf2").num_requests == 1
        assert c.cancel_batch("inf2") == 1


def test_none_and_huge_timeouts_are_no_bound(buffer: Buffer) -> None:
    """Review of session 26: timeout=None (no deadline, accepted before the checks) was refused,
    and a finite timeout of 1e10 s or more overflowed gRPC's deadline: the call failed at once."""
    with SeerClient(buffer.address, timeout=None) as c:  # type: ignore[arg-type]
        c.submit_batch("none", [PromptGroup(prompt=[1, 2], group_size=1, max_tokens=4)])
        assert c.get_batch("none").num_requests == 1
    with SeerClient(buffer.address, timeout=1e12) as c:
        assert c.get_batch("none").num_requests == 1
        threading.Timer(0.3, finish_request, args=(buffer.address, "none/0/0")).start()
        assert [r.request_id for r in c.iter_results("none", timeout=1e15)] == ["none/0/0"]


def test_wait_ready_refuses_nan_and_numpy_bools_are_bools(buffer: Buffer) -> None:
    np = pytest.importorskip("numpy")
    with SeerClient(buffer.address) as c:
        with pytest.raises(SeerError) as e:
            c.wait_ready(float("nan"))  # before: SeerTimeout "not ready after nans" at once
        assert e.value.code == "INVALID_ARGUMENT" and e.value.message.startswith("timeout:")
        c.submit_batch("np", [PromptGroup(prompt=[1, 2], group_size=1, max_tokens=4)])
        assert len(c.get_batch("np", include_requests=np.True_).requests) == 1  # protobuf took it before


def test_errors_survive_pickling() -> None:
    """An error crossing a process boundary (multiprocessing) failed to unpickle: Exception pickles
    its one formatted arg, which SeerError's __init__ does not take."""
    import pickle

    for err in (SeerError("NOT_FOUND", "batch_id: no batch 'x'"), SeerTimeout("DEADLINE_EXCEEDED", "after 5s")):
        back = pickle.loads(pickle.dumps(err))
        assert type(back) is type(err) and back.code == err.code and back.message == err.message
        assert str(back) == str(err)
