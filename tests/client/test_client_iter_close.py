"""SeerClient.iter_results is a generator (typed so): closing it before the batch is done ends the
stream at once, and the buffer lets go of it (its reader of the batch, its stream slot)."""

from __future__ import annotations

import time

from client_helpers import Buffer, finish_request
from seer_client import PromptGroup, SeerClient


def test_closing_the_results_iterator_ends_the_stream(buffer: Buffer) -> None:
    core = buffer.core
    assert core is not None
    with SeerClient(buffer.address) as client:
        client.submit_batch("c", [PromptGroup(prompt=[1], group_size=2, max_tokens=4)])
        finish_request(buffer.address, "c/0/0")
        it = client.iter_results("c")
        assert next(it).request_id == "c/0/0"
        assert core._readers.get("c") == 1  # the server's stream is reading the batch
        it.close()  # the batch is not done (c/0/1 is pending): the stream would wait on
        deadline = time.monotonic() + 5
        # The server notices the cancelled call at its next poll (StreamResults' POLL_SECONDS).
        while core._readers.get("c") and time.monotonic() < deadline:
            time.sleep(0.05)
        assert "c" not in core._readers, "the stream stayed open after the iterator was closed"
