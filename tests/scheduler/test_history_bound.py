"""History priors are bounded by prompt keys (history_max_prompts, least recently used dropped), and
a dropped key is asked of the buffer again when its prompt comes back.

Before session 24 the core kept one entry per distinct prompt key ever seen and the dispatcher one
"asked" mark per key, for the process's life; a key marked asked was never asked again."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import pytest
from seer.v1 import buffer_pb2

from services.common.errors import InvalidArgument
from services.scheduler.core import SchedulerCore, SchedulerPolicyConfig

from .conftest import FakeClock, add_group, make_core
from .test_dispatcher_faults import FakeBuffer, item


def test_the_least_recently_used_key_is_dropped_first() -> None:
    core = make_core("seer_history", FakeClock(), history_max_prompts=2)
    core.set_history("k1", [10, 20])
    core.set_history("k2", [30])
    add_group(core, "g1", 1, key="k1")  # a new group of k1 uses its prior: k2 is now the oldest
    core.set_history("k3", [40])
    assert (core.has_history("k1"), core.has_history("k2"), core.has_history("k3")) == (True, False, True)
    assert core.history_evicted == 1


def test_a_completed_group_records_its_history_within_the_bound() -> None:
    clock = FakeClock()
    core = make_core("seer", clock, workers=1, history_max_prompts=1, chunk_size=1000)
    for gid in ("g1", "g2"):
        (rid,) = add_group(core, gid, 1, max_tokens=50)
        (d,) = core.next_dispatches()
        assert d.request_id == rid
        core.on_chunk_done(rid, d.worker_id, 12, True)
    assert core.history("key-g2") == [12]
    assert not core.has_history("key-g1")
    assert core.history_evicted == 1


def test_the_bound_is_validated() -> None:
    with pytest.raises(InvalidArgument) as e:
        SchedulerCore(SchedulerPolicyConfig(policy="seer_history", history_max_prompts=0))
    assert e.value.field == "history_max_prompts"


class HistoryBuffer(FakeBuffer):
    """A buffer that holds a history for some prompt keys and records every key it was asked for."""

    def __init__(self, held: dict[str, list[int]]) -> None:
        super().__init__()
        self.held = held
        self.asked: list[str] = []
        self._asked_lock = threading.Lock()

    def history(self, prompt_keys: Any, timeout: float = 10.0) -> list[buffer_pb2.PromptHistory]:
        with self._asked_lock:
            self.asked.extend(prompt_keys)
        return [buffer_pb2.PromptHistory(prompt_key=k, lengths=self.held[k]) for k in prompt_keys if k in self.held]


def _item(rid: str, key: str) -> buffer_pb2.WorkItem:
    it = item(rid)
    it.prompt_key = key
    return it


def test_a_dropped_key_is_asked_of_the_buffer_again(make_rig: Callable[..., Any]) -> None:
    buf = HistoryBuffer({"k-a": [5, 9], "k-b": [7]})
    t = make_rig(buffer=buf, policy="seer_history", history_max_prompts=1)
    t.d._add_items([_item("a1", "k-a")])
    t.d._add_items([_item("b1", "k-b")])  # the bound is 1 prompt: k-a is dropped
    assert not t.d.core.has_history("k-a") and t.d.core.history("k-b") == [7]
    t.d._add_items([_item("a2", "k-a")])  # k-a's prompt comes back (the next iteration)
    assert buf.asked == ["k-a", "k-b", "k-a"]
    assert t.d.core.history("k-a") == [5, 9]


def test_a_key_without_history_is_asked_once_and_one_with_history_not_again(make_rig: Callable[..., Any]) -> None:
    buf = HistoryBuffer({"k-a": [5]})
    t = make_rig(buffer=buf, policy="seer_history")
    t.d._add_items([_item("n1", "k-new"), _item("a1", "k-a")])
    t.d._add_items([_item("n2", "k-new"), _item("a2", "k-a")])  # more members, in a later feed message
    assert sorted(buf.asked) == ["k-a", "k-new"]


def test_a_key_the_buffer_had_none_for_is_asked_again_once_recorded_and_dropped(
        make_rig: Callable[..., Any]) -> None:
    """A fresh run: the buffer has no history for any key when its prompt first comes; the group
    completes and the core records it; the bound drops it; the prompt comes back. The dispatcher
    kept the key marked "no history at the buffer" and never asked again (review, session 24)."""
    from .test_dispatcher_faults import wait_for

    buf = HistoryBuffer({})
    t = make_rig(buffer=buf, policy="seer_history", history_max_prompts=1)
    t.register("w0")
    t.run()
    t.d._add_items([_item("a1", "k-a")])
    wait_for(lambda: t.d.core.has_history("k-a"))  # completed: 16 tokens
    buf.held["k-a"] = [16]  # the buffer recorded it too
    t.d._add_items([_item("b1", "k-b")])
    wait_for(lambda: t.d.core.has_history("k-b") and not t.d.core.has_history("k-a"))
    t.d._add_items([_item("a2", "k-a")])
    assert buf.asked == ["k-a", "k-b", "k-a"]


def test_priors_found_in_one_message_reach_their_groups_beyond_the_bound(make_rig: Callable[..., Any]) -> None:
    """One feed message with more keys found at the buffer than history_max_prompts: each group
    still gets its prior (they were set before the groups existed, so the first were dropped)."""
    buf = HistoryBuffer({"k-a": [5], "k-b": [7]})
    t = make_rig(buffer=buf, policy="seer_history", history_max_prompts=1)
    t.d._add_items([_item("a1", "k-a"), _item("b1", "k-b")])
    assert t.d.core._groups["g-a1"].prior is not None
    assert t.d.core._groups["g-b1"].prior is not None


# ---- the pooled log-length spread (history_estimate="posterior") ---------------------------------


def _pooled_sd(*histories: list[int]) -> float:
    from services.scheduler.core.groups import log_spread

    parts = [log_spread(h) for h in histories]
    return float((sum(ss for ss, _ in parts) / sum(dof for _, dof in parts)) ** 0.5)


def test_a_key_fetched_again_after_the_bound_dropped_it_counts_once_in_the_pooled_spread(
        make_rig: Callable[..., Any]) -> None:
    """k-a is dropped by the bound and fetched again when its prompt comes back. Its spread was added
    to the pool once per fetch, and a dropped key's share stayed, so the prompts that come back most
    (and ones long gone: k-b, wide) weighed in every group's log_sd (the posterior estimate's s)."""
    buf = HistoryBuffer({"k-a": [100, 110], "k-b": [10, 1000], "k-c": [50, 60]})
    t = make_rig(buffer=buf, policy="seer_history", history_estimate="posterior", history_max_prompts=2)
    t.d._add_items([_item("a1", "k-a")])
    t.d._add_items([_item("b1", "k-b")])
    t.d._add_items([_item("c1", "k-c")])  # k-a dropped
    t.d._add_items([_item("a2", "k-a")])  # k-a's prompt comes back: fetched again; k-b dropped
    assert buf.asked == ["k-a", "k-b", "k-c", "k-a"]
    # The keys held now, each once (without the fix: k-a twice and k-b's dropped share still in).
    assert t.d.core._groups["g-a2"].log_sd == pytest.approx(_pooled_sd([50, 60], [100, 110]))


def test_a_key_set_again_replaces_its_share_of_the_pooled_spread() -> None:
    core = make_core("seer_history", FakeClock(), history_estimate="posterior")
    core.set_history("k1", [10, 1000])
    core.set_history("k2", [100, 110])
    for _ in range(3):
        core.set_history("k1", [10, 1000])  # the same key again (e.g. a snapshot after a reconnect)
    add_group(core, "g", 2, key="k2")
    assert core._groups["g"].log_sd == pytest.approx(_pooled_sd([10, 1000], [100, 110]))
    core.set_history("k1", [])  # no history any more: its share goes too
    add_group(core, "h", 2, key="k2")
    assert core._groups["h"].log_sd == pytest.approx(_pooled_sd([100, 110]))
