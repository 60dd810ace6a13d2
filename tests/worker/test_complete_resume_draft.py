"""A chunk resuming an already complete output ends at once (no tokens, STOP / LENGTH) and tells the
draft group the response is finished, as a chunk that generated its last token does: otherwise the
group never completes on the draft server (its responses never become history) and siblings keep
the response open.

Real worker core (deterministic fake engine, worker_fake_engine.py) + real DraftClient + a real
draft server on a loopback port.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from worker_fake_engine import FakeEngine

from services.common.server import RunningServer
from services.draft.app import start
from services.draft.config import DraftConfig
from services.draft.store import DraftStore
from services.worker.core import ChunkFinish, ChunkJob, Worker
from services.worker.draft_client import DraftClient
from services.worker.engine import SamplingParams

PROMPT = (1, 2, 3)
EOS = 99  # FakeEngine's


def _wait(cond: Callable[[], bool], timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.02)


@pytest.fixture()
def server() -> Iterator[tuple[RunningServer, DraftStore]]:
    running, store = start(DraftConfig(port=0, grace_seconds=0.2))
    try:
        yield running, store
    finally:
        running.stop(0.2)


def _job(output: tuple[int, ...], **kw: Any) -> ChunkJob:
    base: dict[str, Any] = dict(request_id="r", prompt_token_ids=PROMPT, max_new_tokens=4, max_tokens=40,
                                sampling=SamplingParams(temperature=0.0, seed=7), policy_version=0, group_id="g",
                                prompt_key="k", group_size=2, output_token_ids=output, dispatch_epoch=3)
    base.update(kw)
    return ChunkJob(**base)


@pytest.mark.parametrize(("output", "max_tokens", "finish"), [
    ((4, 5, EOS), 40, ChunkFinish.STOP),
    ((4, 5, 6), 3, ChunkFinish.LENGTH),
])
def test_end_at_once_finishes_the_response_in_the_draft_group(
        server: tuple[RunningServer, DraftStore], output: tuple[int, ...], max_tokens: int,
        finish: ChunkFinish) -> None:
    running, store = server
    # Earlier attempts elsewhere: the sibling finished; r's tokens arrived but not its end (the
    # worker that committed them ended its chunk as CHUNK: another view of the stop ids, say).
    other = DraftClient(running.address, sync_interval_s=0.02)
    try:
        other.register_group("g", "k", PROMPT, group_size=2)
        other.append("g", "s", 0, [7, 8], finished=True)
        other.append("g", "r", 0, list(output))
        other.flush()
    finally:
        other.close()
    _wait(lambda: store.index_of("g").tokens("r") == list(output))
    client = DraftClient(running.address, sync_interval_s=0.02)
    w = Worker(FakeEngine(), draft=client).start()
    try:
        toks, _, done = w.run(_job(output, max_tokens=max_tokens))
        assert toks == [] and done.finish == finish
        # The response is finished on the server: the group completes and both responses are history.
        _wait(lambda: sorted(store._history.responses("k")) == sorted([output, (7, 8)]))
        assert store.stats().history_keys == 1
        assert client.stats().append_errors == 0
        # Under this attempt's epoch: an older attempt's late append is refused.
        assert store._groups["g"].epochs["r"] == 3
    finally:
        w.close()


def test_end_at_once_without_anything_on_the_server_sends_the_whole_response(
        server: tuple[RunningServer, DraftStore]) -> None:
    running, store = server
    client = DraftClient(running.address, sync_interval_s=0.02)
    w = Worker(FakeEngine(), draft=client).start()
    try:
        toks, _, done = w.run(_job((4, 5, EOS), group_size=1))
        assert toks == [] and done.finish == ChunkFinish.STOP
        _wait(lambda: store._history.responses("k") == [(4, 5, EOS)])
    finally:
        w.close()
