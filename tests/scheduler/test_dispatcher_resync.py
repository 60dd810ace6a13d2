"""The core's generated count follows the buffer both ways after a resync (in-process, the scripted
buffer and worker links of test_dispatcher_faults; the real Dispatcher and dispatch loop).

A chunk held for resync (its commit came back duplicate) was settled with the tokens the snapshot
added, clamped to [0, chunk]: a buffer holding fewer tokens than before the chunk (a commit it
lost) left the core counting tokens that do not exist, and one holding more than the chunk added
(another dispatch's late commit) left it counting too few; our copy then equalled the buffer's, so
no later snapshot corrected the core. Counting too many, the core finished the request while the
buffer still listed it: it was never dispatched again and its batch never completed.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest

from .test_dispatcher_faults import Rig, item, wait_for
from .test_dispatcher_review14 import DuplicateBuffer


@pytest.mark.parametrize("buffer_holds", [0, 24])
def test_a_held_chunk_resolved_by_a_snapshot_takes_the_buffers_count(
        make_rig: Callable[..., Rig], buffer_holds: int) -> None:
    # max_tokens 32, chunks of 8: seq 0 is committed (8 tokens), seq 1 comes back duplicate.
    buf = DuplicateBuffer({("a", 1)})
    t = make_rig(buffer=buf)
    t.register("w0")
    t.run()
    t.d._add_items([item("a", max_tokens=32)])
    wait_for(lambda: t.d._requests["a"].resync is not None)
    assert t.d.core._requests["a"].generated == 8
    buf.duplicates.clear()
    before = len(buf.of("a"))
    t.workers.gate.clear()  # hold the next dispatch while we look at the core
    # The buffer holds `buffer_holds` tokens: fewer than before the held chunk (it lost seq 0), or
    # more than the chunk added (seq 1 and 2 of another dispatch landed).
    t.d._apply_snapshot([item("a", max_tokens=32, output=list(range(buffer_holds)), next_seq=buffer_holds // 8)])
    assert t.d._requests["a"].output == list(range(buffer_holds))
    assert t.d.core._requests["a"].generated == buffer_holds
    t.workers.gate.set()
    # It runs to its end from what the buffer holds.
    wait_for(lambda: "a" not in t.d._requests)
    assert t.d.core.history("k-a") == [32]
    after = buf.of("a")[before:]
    assert [c.seq for c in after] == list(range(buffer_holds // 8, 4))
    assert sum(len(c.token_ids) for c in after) == 32 - buffer_holds


def test_a_snapshot_corrects_a_queued_requests_count_down(make_rig: Callable[..., Rig]) -> None:
    """A queued request whose core count drifted above our copy (equal to the buffer's): a
    snapshot with the same output corrects the core too (it compared with our copy only)."""
    t = make_rig()
    t.d._add_items([item("a", max_tokens=32, output=list(range(8)), next_seq=1)])
    t.d.core.resync_generated("a", 16)  # the drift (as the held-chunk path above left it)
    t.d._apply_snapshot([item("a", max_tokens=32, output=list(range(8)), next_seq=1)])
    assert t.d.core._requests["a"].generated == 8
