"""The worker keeps at most _MAX_GROUPS draft mirrors, least recently started first, but never
releases the mirror of a group with a chunk running here (its request drafts from it and appends to
it; released, its tokens would never reach the server and drafting would stop in the long tail)."""

from __future__ import annotations

import threading
from types import SimpleNamespace

import pytest
from worker_fake_engine import FakeEngine

from services.worker import core as core_mod
from services.worker.core import ChunkJob, Worker
from services.worker.draft_client import DraftClient
from services.worker.engine import SamplingParams


def _job(gid: str) -> ChunkJob:
    return ChunkJob(request_id="r-" + gid, prompt_token_ids=(1, 2, 3), max_new_tokens=6, max_tokens=40,
                    sampling=SamplingParams(temperature=0.0, seed=7), policy_version=0, group_id=gid,
                    prompt_key="", group_size=1)


def test_mirror_of_a_running_request_survives_the_lru() -> None:
    client = DraftClient(None)
    w = Worker(FakeEngine(), draft=client, gamma_max=4)
    try:
        w._register_group(_job("long"))
        w._active["r-long"] = SimpleNamespace(job=_job("long"))  # type: ignore[assignment]  # its chunk runs
        client.append("long", "r-long", 0, [4, 5, 6])
        w._register_group(_job("idle"))  # started and finished: evictable
        for i in range(core_mod._MAX_GROUPS):
            w._register_group(_job(f"g{i}"))
        assert client.has_group("long")
        assert not client.has_group("idle")
        client.append("long", "r-long", 3, [7, 8])
        assert client.own_length("long", "r-long") == 5
        assert len(w._registered_groups) == core_mod._MAX_GROUPS
    finally:
        w._active.clear()
        client.close()


def test_a_mirror_the_client_released_is_registered_again() -> None:
    client = DraftClient(None)
    w = Worker(FakeEngine(), draft=client, gamma_max=4)
    try:
        w._register_group(_job("g"))
        client.release_group("g")  # e.g. the server expired it while nothing of it ran here
        w._register_group(_job("g"))  # a later chunk of the group starts here
        assert client.has_group("g")
    finally:
        client.close()


def test_a_group_evicted_while_it_starts_again_keeps_its_new_mirror(monkeypatch: pytest.MonkeyPatch) -> None:
    # The eviction of "old" and the registration of "old" by another chunk starting at that moment:
    # the release must not land after the new registration (that chunk would draft and append to
    # nothing).
    client = DraftClient(None)
    w = Worker(FakeEngine(), draft=client, gamma_max=4)
    monkeypatch.setattr(core_mod, "_MAX_GROUPS", 2)
    release = client.release_group
    raced: list[threading.Thread] = []

    def release_while_old_starts_again(gid: str) -> None:
        if gid == "old" and not raced:
            t = threading.Thread(target=w._register_group, args=(_job("old"),))
            raced.append(t)
            t.start()
            t.join(0.5)  # with the eviction under the engine lock, it waits for it
        release(gid)

    monkeypatch.setattr(client, "release_group", release_while_old_starts_again)
    try:
        w._register_group(_job("old"))
        w._register_group(_job("a"))
        w._register_group(_job("b"))  # evicts "old"
        raced[0].join(5)
        assert "old" in w._registered_groups
        assert client.has_group("old")
    finally:
        client.close()
