"""SeerClient.iter_results against a buffer that accepts every stream and then fails it: retries
without a new result are bounded by retry_seconds (an accepted stream alone is not progress)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Generator

from client_helpers import Buffer
from seer_client import PromptGroup, SeerClient, SeerError

from services.buffer.records import RolloutResult
from services.common.errors import Unavailable


def test_streams_accepted_then_failed_every_time_end_in_an_error(buffer: Buffer) -> None:
    with SeerClient(buffer.address, retry_seconds=2.5) as client:
        client.submit_batch("f", [PromptGroup(prompt=[1], group_size=1, max_tokens=4)])
        assert buffer.core is not None
        opened: list[float] = []

        def failing(batch_id: str, cursor: int = 0, is_active: Callable[[], bool] = lambda: True,
                    poll_seconds: float = 0.5, submission_id: int = 0, unreadable: object = None
                    ) -> Generator[tuple[int, RolloutResult], None, None]:
            # The real server accepts the stream (headers sent), then its read fails a moment later
            # with UNAVAILABLE, every time (e.g. a store that fails reads while the server runs).
            opened.append(time.monotonic())
            time.sleep(0.1)
            raise Unavailable("the results log cannot be read")
            yield  # pragma: no cover - a generator, as the real one

        buffer.core.iter_results = failing  # type: ignore[method-assign]
        box: dict[str, BaseException] = {}

        def consume() -> None:
            try:
                list(client.iter_results("f"))
            except BaseException as e:
                box["error"] = e

        t0 = time.monotonic()
        t = threading.Thread(target=consume, daemon=True)
        t.start()
        t.join(12)  # before: still retrying (the window restarted at every accepted stream)
        assert not t.is_alive(), f"iter_results kept retrying ({len(opened)} streams accepted and failed)"
        err = box.get("error")
        assert isinstance(err, SeerError) and err.code == "UNAVAILABLE", err
        assert "no new result" in err.message and "cursor 0" in err.message, err.message
        assert "the results log cannot be read" in err.message
        assert len(opened) >= 2 and time.monotonic() - t0 < 10
