"""The error texts that name the first MAX_NAMED_TOO_LARGE of a list and count the rest ("...; x
and 4 more") build that tail with one helper (server.named_and_more; three places wrote it by hand).
The texts are pinned here, exactly, at the edges: none left over, one, several."""

from __future__ import annotations

from services.buffer.core import UnreadableRequest, UnreadableResult
from services.buffer.records import RecordError
from services.buffer.server import MAX_NAMED_TOO_LARGE, _unreadable_error, named_and_more, unreadable_requests_text


def test_named_and_more_counts_only_the_unnamed() -> None:
    assert named_and_more([], 0) == ""
    assert named_and_more(["a"], 1) == "a"
    assert named_and_more(["a", "b"], 2) == "a; b"
    assert named_and_more(["a", "b"], 3) == "a; b and 1 more"
    assert named_and_more(["a"], 25) == "a and 24 more"
    assert named_and_more([], 3) == " and 3 more"  # nothing named: the count alone (not reached)


def _requests(n: int) -> list[UnreadableRequest]:
    return [UnreadableRequest("b", f"b/0/{i}", RecordError(f"req/{i}".encode(), "seed", "missing")) for i in range(n)]


def _results(n: int) -> list[UnreadableResult]:
    return [UnreadableResult("b", i, RecordError(f"res/{i}".encode(), "", "not JSON")) for i in range(n)]


def test_unreadable_requests_name_the_first_twenty_and_count_the_rest() -> None:
    assert MAX_NAMED_TOO_LARGE == 20
    head = ("stored request record(s) of batch 'b' cannot be decoded and are listed as unknown (state "
            "UNSPECIFIED; every other request is as stored): ")
    one = "request 'b/0/0': stored record 'req/0' field 'seed': missing"
    assert unreadable_requests_text("b", _requests(1)) == "1 " + head + one
    twenty = unreadable_requests_text("b", _requests(20))
    assert twenty.endswith("field 'seed': missing") and twenty.count("request 'b/0/") == 20
    more = unreadable_requests_text("b", _requests(23))
    assert more.startswith("23 " + head + one + "; ")
    assert more.endswith("request 'b/0/19': stored record 'req/19' field 'seed': missing and 3 more")
    assert "b/0/20" not in more


def test_unreadable_results_and_oversize_ones_count_their_rest_apart() -> None:
    head = ("stored result(s) of batch 'b' cannot be decoded and were left out of the stream (every other "
            "result was sent): ")
    err = _unreadable_error("b", _results(1), [], 0, 100, max_bytes=100_000)
    assert err.field == "cursor"
    assert str(err) == "cursor: 1 " + head + "cursor 0: stored record 'res/0': not JSON"
    too_large = [f"request 'b/0/{i}' (cursor {i}): 200 bytes" for i in range(2)]
    err = _unreadable_error("b", _results(21), too_large, 5, 100, max_bytes=100_000)
    text = str(err)
    assert text.startswith("cursor: 21 " + head + "cursor 0: stored record 'res/0': not JSON; ")
    assert ("cursor 19: stored record 'res/19': not JSON and 1 more; also 5 result(s) over the 100-byte "
            "message limit were left out: request 'b/0/0' (cursor 0): 200 bytes; request 'b/0/1' (cursor 1): "
            "200 bytes and 3 more") in text
    assert text.endswith("and 3 more")
    # Every oversize one named: no count after them.
    assert str(_unreadable_error("b", _results(1), too_large, 2, 100, max_bytes=100_000)).endswith(
        "request 'b/0/1' (cursor 1): 200 bytes")
