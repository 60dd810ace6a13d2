"""UpdateWeights is idempotent: a retry of the update that made a version current is success (its
first call may have timed out on the caller's side while the switch went on and was recorded)."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from services.buffer.core import BufferCore
from services.buffer.model import ModelInfo
from services.buffer.store import Store
from services.common.errors import FailedPrecondition, InvalidArgument


def _core(path: Path) -> BufferCore:
    return BufferCore(Store(path), ModelInfo(vocab_size=1000, max_context=4096, tokenizer=None))


def test_repeating_the_current_version_is_success(tmp_path: Path) -> None:
    core = _core(tmp_path / "db")
    calls: list[tuple[int, str]] = []

    def switch(version: int, source: str) -> int:
        calls.append((version, source))
        return 3

    assert core.update_weights(1, "/ckpt/1", switch).num_workers == 3
    again = core.update_weights(1, "/ckpt/1", switch)  # the caller's retry
    assert (again.version, again.num_workers) == (1, 3)
    assert core.update_weights(1, "", switch).version == 1  # "" = whatever weights version 1 has
    assert calls == [(1, "/ckpt/1")]  # the workers are not switched again
    assert core.policy() == (1, "/ckpt/1")
    # Version 1 with other weights is a conflict, not a retry; older versions stay refused.
    with pytest.raises(InvalidArgument) as e:
        core.update_weights(1, "/ckpt/other", switch)
    assert e.value.field == "source"
    with pytest.raises(InvalidArgument) as e:
        core.update_weights(0, "", switch)
    assert e.value.field == "version"
    core.close()
    # Also after a restart (the version and source are stored).
    core = _core(tmp_path / "db")
    assert core.update_weights(1, "/ckpt/1", switch).version == 1
    assert calls == [(1, "/ckpt/1")]
    core.close()


def test_a_retry_during_the_switch_names_the_version_in_progress(tmp_path: Path) -> None:
    import threading

    core = _core(tmp_path / "db")
    release = threading.Event()

    def slow_switch(version: int, source: str) -> int:
        release.wait(5)
        return 1

    t = threading.Thread(target=core.update_weights, args=(2, "/ckpt/2", slow_switch), daemon=True)
    t.start()
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        try:
            core.update_weights(2, "/ckpt/2", slow_switch)
        except FailedPrecondition as e:
            assert "version 2 is in progress" in str(e)
            break
        time.sleep(0.01)
    else:
        pytest.fail("the switch did not start")
    release.set()
    t.join(5)
    assert core.update_weights(2, "/ckpt/2", slow_switch).version == 2
    core.close()
