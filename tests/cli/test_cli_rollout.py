"""`seer rollout`: a submitted batch does not outlive an interrupted run; prompt loading edge cases.

The interrupt tests use a real buffer (in process: real gRPC and RocksDB) and the real CLI."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
from seer_client import PromptGroup, SeerClient, SeerError

import services.buffer.core as buffer_core
from services.buffer.core import BufferCore
from services.cli import rollout
from tests.client.client_helpers import Buffer, play_scheduler

ROOT = Path(__file__).resolve().parents[2]


def _wait_submitted(address: str, batch_id: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    with SeerClient(address, retry_seconds=1.0) as client:
        while time.monotonic() < deadline:
            try:
                client.get_batch(batch_id)
                return
            except SeerError:
                time.sleep(0.1)
    raise AssertionError(f"batch {batch_id} never submitted")


@contextmanager
def _rollout(address: str, prompts: Path, batch_id: str, *, sigint_ignored: bool = False,
             on_exit: Callable[[], None] | None = None) -> Iterator[subprocess.Popen[str]]:
    """The real CLI in a subprocess, with faulthandler on (SIGABRT dumps its stacks, see _stop). On
    the way out (a failed assertion included) `on_exit` runs first (releasing what the buffer holds
    for the test), then a CLI still running is killed: the one try/stop/kill of every interrupt test.

    sigint_ignored: started as a background job of a non-interactive shell starts it (`cmd &`),
    with SIGINT ignored, which exec keeps: the disposition the test itself had when its suite ran
    in such a job (the intermittent hang: the subprocess never saw the SIGINT)."""
    cmd = [sys.executable, "-m", "services.cli", "rollout", "--prompts", str(prompts), "--group-size", "2",
           "--max-tokens", "4", "--address", address, "--no-progress", "--batch-id", batch_id]
    if sigint_ignored:
        cmd = [sys.executable, "-c", "import os, signal, sys; signal.signal(signal.SIGINT, signal.SIG_IGN); "
               "os.execv(sys.executable, sys.argv[1:])", *cmd]
    p = subprocess.Popen(cmd, cwd=ROOT, env=dict(os.environ, PYTHONFAULTHANDLER="1"),
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        yield p
    finally:
        if on_exit is not None:
            on_exit()
        if p.poll() is None:
            p.kill()
            p.communicate()


def _stop(p: subprocess.Popen[str], sig: int, timeout: float = 30.0) -> str:
    """Sends `sig` and returns stderr once the command exits. Still running after `timeout`: its
    Python stacks (faulthandler on SIGABRT) go into the failure, so a hang says where it was stuck."""
    p.send_signal(sig)
    try:
        return p.communicate(timeout=timeout)[1]
    except subprocess.TimeoutExpired:
        p.send_signal(signal.SIGABRT)
        try:
            _, err = p.communicate(timeout=10)
        except subprocess.TimeoutExpired:
            p.kill()
            _, err = p.communicate()
        raise AssertionError(f"still running {timeout}s after {signal.Signals(sig).name}; its stacks:\n{err}") from None


@pytest.mark.parametrize(("sig", "sigint_ignored"), [(signal.SIGINT, False), (signal.SIGINT, True),
                                                     (signal.SIGTERM, False)],
                         ids=["sigint", "sigint-inherited-ignored", "sigterm"])
def test_ctrl_c_cancels_the_submitted_batch(sig: int, sigint_ignored: bool, buffer: Buffer, tmp_path: Path) -> None:
    """Before: only the tool's own --timeout cancelled; Ctrl-C left the batch generating on the
    cluster (here it would stay pending forever: no scheduler). Then: a CLI started with SIGINT
    ignored (inherited from a background job: how the test hung under a loaded parallel run)
    ignored the SIGINT and streamed on for ever; SIGTERM killed it with the batch left running."""
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"prompt_token_ids": [1, 2, 3], "prompt_key": "k"}) + "\n")
    with _rollout(buffer.address, prompts, "cli-int", sigint_ignored=sigint_ignored) as p:
        _wait_submitted(buffer.address, "cli-int")
        time.sleep(0.5)  # into the result stream
        err = _stop(p, sig)
    assert p.returncode == 128 + sig, err
    assert "batch cli-int: cancelled it" in err, err
    assert f"interrupted ({signal.Signals(sig).name})" in err, err
    with SeerClient(buffer.address) as client:
        assert client.get_batch("cli-int").state == "cancelled"


def test_an_interrupt_during_submission_cancels_the_batch(buffer: Buffer, monkeypatch: pytest.MonkeyPatch) -> None:
    """A Ctrl-C landing after the buffer stored the batch but before SubmitBatch's reply reached
    the CLI (a slow reply under load). Before: the submission was outside the cancelling try, so
    the batch was left pending (generating, with a scheduler) after the CLI exited."""
    real_submit = SeerClient.submit_batch

    def submit_then_interrupted(self: SeerClient, *args: Any, **kwargs: Any) -> Any:
        real_submit(self, *args, **kwargs)
        raise KeyboardInterrupt  # as the SIGINT handler raises it, at the reply

    monkeypatch.setattr(SeerClient, "submit_batch", submit_then_interrupted)
    groups = [PromptGroup(prompt=[1, 2, 3], group_size=2, max_tokens=4)]
    with pytest.raises(KeyboardInterrupt):
        rollout.run(buffer.address, groups, "cli-sub", progress=False, timeout=30)
    with SeerClient(buffer.address) as client:
        assert client.get_batch("cli-sub").state == "cancelled"


def test_an_error_while_results_stream_cancels_the_batch(buffer: Buffer) -> None:
    """Any way out of run() after submission (here: the on_result callback raises after the first
    result) cancels what is left, then lets the error through."""
    stop, gate = threading.Event(), threading.Semaphore(1)  # one request at a time
    sched = threading.Thread(target=play_scheduler, args=(buffer.address,), kwargs={"stop": stop, "gate": gate},
                             daemon=True)
    sched.start()

    def on_result(_r: Any) -> None:
        raise RuntimeError("trainer-side bug")

    groups = [PromptGroup(prompt=[1, 2, 3], group_size=4, max_tokens=4)]
    try:
        with pytest.raises(RuntimeError, match="trainer-side bug"):
            rollout.run(buffer.address, groups, "cli-err", progress=False, on_result=on_result, timeout=30)
        with SeerClient(buffer.address) as client:
            assert client.get_batch("cli-err").state == "cancelled"
    finally:
        stop.set()
        gate.release(100)


@pytest.mark.parametrize("case", ["already-exists", "failed-precondition"])
def test_a_refused_submission_cancels_nothing(case: str, buffer: Buffer, tmp_path: Path,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    """A submission the buffer refused stored nothing, so there is nothing of ours to cancel.
    Before: the refusal went through the cancelling path: with --batch-id naming another run's
    batch (other content: ALREADY_EXISTS) that other run's batch was cancelled; any other refusal
    printed a stray "nothing to cancel" line."""
    with SeerClient(buffer.address) as client:  # another run's batch, running
        client.submit_batch("shared", [PromptGroup(prompt=[7, 8, 9], group_size=4, max_tokens=4)])
    p = tmp_path / "p.jsonl"
    if case == "already-exists":
        p.write_text(json.dumps({"prompt_token_ids": [1, 2, 3]}) + "\n")
        batch_id, expected = "shared", "ALREADY_EXISTS"
    else:  # a text prompt, and the buffer has no tokenizer
        p.write_text("hello\n")
        batch_id, expected = "mine", "FAILED_PRECONDITION"
    code = rollout.main(["--prompts", str(p), "--group-size", "2", "--max-tokens", "4", "--address",
                         buffer.address, "--no-progress", "--batch-id", batch_id])
    err = capsys.readouterr().err
    assert code == 1 and expected in err, err
    assert "cancel" not in err, err
    with SeerClient(buffer.address) as client:
        assert client.get_batch("shared").state == "running"  # not cancelled


class _SubmitGate:
    """Holds the in-process buffer's SubmitBatch of `batch_id` before the core looks at it, outside
    the core's lock (validation, where a big batch spends its time, is there too), until released:
    the race window made certain, also for an id that names a stored batch (whose submission never
    reaches the validation)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, batch_id: str) -> None:
        self.entered, self.release, self.handled = threading.Event(), threading.Event(), threading.Event()
        real_submit = BufferCore.submit_batch

        def submit(core: BufferCore, bid: str, *a: Any, **kw: Any) -> Any:
            try:
                if bid == batch_id:
                    self.entered.set()
                    assert self.release.wait(30), "submission gate never released"
                return real_submit(core, bid, *a, **kw)
            finally:
                if bid == batch_id:
                    self.handled.set()

        monkeypatch.setattr(BufferCore, "submit_batch", submit)


def _one_prompt(tmp_path: Path) -> Path:
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"prompt_token_ids": [1, 2, 3], "prompt_key": "k"}) + "\n")
    return prompts


def test_a_submission_interrupted_before_it_was_stored_is_not_left_running(
        buffer: Buffer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Ctrl-C while the buffer still holds the submission unstored: the CLI's cancel finds nothing.
    Before that: it said "nothing to cancel" and exited, and the buffer then stored the batch, left
    running. Then: it retried the cancel for 3 s and said the submission "may still be stored".
    Now the cancel names the submission's token, the buffer refuses that submission from then on,
    and the CLI says at once, for certain, that nothing was stored."""
    gate = _SubmitGate(monkeypatch, "cli-race")
    with _rollout(buffer.address, _one_prompt(tmp_path), "cli-race", on_exit=gate.release.set) as p:
        assert gate.entered.wait(30), "the submission never reached the buffer"
        t0 = time.monotonic()
        err = _stop(p, signal.SIGINT)  # the CLI exits while the buffer still holds the submission
        took = time.monotonic() - t0
    assert p.returncode == 130, err
    assert "batch cli-race: nothing to cancel: this run's submission was not stored" in err, err
    assert "may still be stored" not in err, err
    assert took < rollout.NOT_FOUND_RETRY, f"took {took:.1f}s: waited for a final answer"
    assert gate.handled.wait(30)
    with SeerClient(buffer.address, retry_seconds=1.0) as client, pytest.raises(SeerError, match="NOT_FOUND"):
        client.get_batch("cli-race")


def test_a_submission_the_cancel_overtook_is_never_stored(
        buffer: Buffer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The interrupted submission reaches the buffer's write after the CLI's cancel found nothing,
    its call's cancellation not seen (a slow network). Before: the CLI retried the cancel for 3 s
    (and said "nothing to cancel" with the batch left running when the write came later). Now the
    cancel's "not stored" is final: the buffer refuses the submission's token from then on."""
    gate = _SubmitGate(monkeypatch, "cli-late")
    refused: list[BaseException] = []
    real_submit, real_cancel = BufferCore.submit_batch, BufferCore.cancel_batch

    def submit_unaware(core: BufferCore, bid: str, *a: Any, **kw: Any) -> Any:
        kw.pop("is_active", None)  # the call's cancellation has not reached the buffer
        try:
            return real_submit(core, bid, *a, **kw)
        except buffer_core.SubmitCancelled as e:
            refused.append(e)
            raise

    def cancel(core: BufferCore, bid: str, *a: Any, **kw: Any) -> Any:
        try:
            return real_cancel(core, bid, *a, **kw)
        except KeyError:  # NotFound: the CLI's cancel came first; now let the submission go on
            if bid == "cli-late":
                gate.release.set()
            raise

    monkeypatch.setattr(BufferCore, "submit_batch", submit_unaware)
    monkeypatch.setattr(BufferCore, "cancel_batch", cancel)
    with _rollout(buffer.address, _one_prompt(tmp_path), "cli-late", on_exit=gate.release.set) as p:
        assert gate.entered.wait(30), "the submission never reached the buffer"
        err = _stop(p, signal.SIGINT)
    assert p.returncode == 130, err
    assert "batch cli-late: nothing to cancel: this run's submission was not stored" in err, err
    assert gate.handled.wait(30)
    assert refused and "submission_token" in str(refused[0]), refused
    with SeerClient(buffer.address, retry_seconds=1.0) as client, pytest.raises(SeerError, match="NOT_FOUND"):
        client.get_batch("cli-late")


@pytest.mark.parametrize("content", ["same", "other"])
def test_an_interrupt_before_the_reply_leaves_another_runs_batch_running(
        content: str, buffer: Buffer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """--batch-id names another run's live batch and the Ctrl-C comes before SubmitBatch's reply
    (which would have been already_submitted, or ALREADY_EXISTS). Before: the cancel named the
    batch id only, and cancelled the other run's batch. Now it names this run's submission token:
    the other batch is left running, and the line says so."""
    other = [7, 8, 9] if content == "other" else [1, 2, 3]
    with SeerClient(buffer.address) as client:  # another run's batch, running
        client.submit_batch("shared", [PromptGroup(prompt=other, group_size=2, max_tokens=4, prompt_key="k")])
    gate = _SubmitGate(monkeypatch, "shared")
    with _rollout(buffer.address, _one_prompt(tmp_path), "shared", on_exit=gate.release.set) as p:
        assert gate.entered.wait(30), "the submission never reached the buffer"
        err = _stop(p, signal.SIGINT)
    assert p.returncode == 130, err
    assert "batch shared: not cancelled: the batch id names another submission" in err, err
    with SeerClient(buffer.address) as client:
        assert client.get_batch("shared").state == "running"


def test_an_interrupt_after_an_already_submitted_reply_leaves_the_batch_running(
        buffer: Buffer, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """The reply came (already_submitted: another run submitted the same batch first), then the
    Ctrl-C. Before: cancelled by id, the other run's batch. Now: not this run's submission, left
    running."""
    groups = [PromptGroup(prompt=[1, 2, 3], group_size=2, max_tokens=4)]
    with SeerClient(buffer.address) as client:
        client.submit_batch("cli-dup", groups)
    real_submit = SeerClient.submit_batch

    def submit_then_interrupted(self: SeerClient, *args: Any, **kwargs: Any) -> Any:
        assert real_submit(self, *args, **kwargs).already_submitted
        raise KeyboardInterrupt

    monkeypatch.setattr(SeerClient, "submit_batch", submit_then_interrupted)
    with pytest.raises(KeyboardInterrupt):
        rollout.run(buffer.address, groups, "cli-dup", progress=False, timeout=30)
    assert "batch cli-dup: not cancelled" in capsys.readouterr().err
    with SeerClient(buffer.address) as client:
        assert client.get_batch("cli-dup").state == "running"


def test_a_second_signal_during_the_cancel_is_reported(buffer: Buffer, tmp_path: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """A second Ctrl-C while the cancel waits (a slow or restarting buffer). Before: the run ended
    saying nothing about the batch, which may still be running."""
    entered, release = threading.Event(), threading.Event()
    real_cancel = BufferCore.cancel_batch

    def slow_cancel(core: BufferCore, bid: str, *a: Any, **kw: Any) -> Any:
        entered.set()
        release.wait(30)
        return real_cancel(core, bid, *a, **kw)

    monkeypatch.setattr(BufferCore, "cancel_batch", slow_cancel)
    with _rollout(buffer.address, _one_prompt(tmp_path), "cli-2nd", on_exit=release.set) as p:
        _wait_submitted(buffer.address, "cli-2nd")
        p.send_signal(signal.SIGINT)
        assert entered.wait(30), "the CLI never cancelled"
        err = _stop(p, signal.SIGINT)
    assert p.returncode == 130, err
    assert "cancelling batch cli-2nd was interrupted: it may still be running" in err, err


def test_limit_must_be_positive(tmp_path: Path) -> None:
    """Before: the limit was checked after the first append, so --limit 0 (or -1) gave one prompt."""
    p = tmp_path / "p.txt"
    p.write_text("a\nb\nc\n")
    for bad in (0, -1):
        with pytest.raises(ValueError, match="--limit"):
            rollout.load_prompts(p, limit=bad)
    assert [x["prompt"] for x in rollout.load_prompts(p, limit=2)] == ["a", "b"]
    assert len(rollout.load_prompts(p)) == 3


def test_id_zero_is_the_key(tmp_path: Path) -> None:
    """Before: `a or b or c` dropped a falsy 0 id and used a hash of the prompt instead."""
    p = tmp_path / "p.jsonl"
    p.write_text('{"prompt": "a", "id": 0}\n{"prompt": "b", "prompt_key": "", "key": "k"}\n{"prompt": "c"}\n')
    keys = [x["prompt_key"] for x in rollout.load_prompts(p)]
    assert keys[:2] == ["0", "k"]
    assert len(keys[2]) == 16  # no key at all: a hash of the prompt


def test_main_reports_a_bad_limit(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    p = tmp_path / "p.txt"
    p.write_text("a\n")
    code = rollout.main(["--prompts", str(p), "--group-size", "1", "--max-tokens", "1", "--limit", "0",
                         "--no-progress"])
    assert code == 1
    assert "--limit" in capsys.readouterr().err


@pytest.mark.parametrize("timeout", ["-5", "nan", "0", "soon"])
def test_main_reports_a_bad_timeout_by_its_name(timeout: str, tmp_path: Path,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    # Before: the client's error named retry_seconds (derived from --timeout), an option never given.
    p = tmp_path / "p.txt"
    p.write_text("a\n")
    with pytest.raises(SystemExit) as e:
        rollout.main(["--prompts", str(p), "--group-size", "1", "--max-tokens", "1", "--timeout", timeout,
                      "--no-progress", "--address", "127.0.0.1:1"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "--timeout: must be a positive number of seconds" in err, err
    assert "retry_seconds" not in err, err


def test_an_unreachable_address_is_given_up_on_within_the_timeout(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Before: the ready wait took 60 s whatever --timeout said."""
    with socket.socket() as s:  # a loopback port nobody listens on (closed right away)
        s.bind(("127.0.0.1", 0))
        address = f"127.0.0.1:{s.getsockname()[1]}"
    p = tmp_path / "p.txt"
    p.write_text("a\n")
    t0 = time.monotonic()
    code = rollout.main(["--prompts", str(p), "--group-size", "1", "--max-tokens", "1", "--timeout", "2",
                         "--no-progress", "--address", address])
    took = time.monotonic() - t0
    err = capsys.readouterr().err
    assert code == 1 and address in err and "not ready after 2.0s" in err, err
    assert took < 10, f"took {took:.1f}s with --timeout 2"


@pytest.mark.parametrize("flag", ["--group-size", "--max-tokens"])
def test_main_reports_a_bad_count_by_its_flag(flag: str, buffer: Buffer, tmp_path: Path,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    """Before: the batch was sent, and the buffer's refusal named groups[0].group_size (or
    max_tokens), not the flag."""
    p = tmp_path / "p.txt"
    p.write_text("a\n")
    counts = {"--group-size": "1", "--max-tokens": "1", flag: "0"}
    with pytest.raises(SystemExit) as e:
        rollout.main(["--prompts", str(p), *(x for kv in counts.items() for x in kv), "--no-progress",
                      "--address", buffer.address])
    err = capsys.readouterr().err
    assert e.value.code == 2 and f"{flag}: must be at least 1, got 0" in err, err


def test_a_batch_cancelled_elsewhere_is_reported_as_such(buffer: Buffer, tmp_path: Path,
                                                          monkeypatch: pytest.MonkeyPatch,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    """Another process cancels the batch after one of its four responses finished. Before: the
    client's BatchCancelled went through the CLI's own cancel, which printed "batch cli-else:
    cancelled it (0 unfinished responses)" as if this run had cancelled it. Now one line says it
    was cancelled elsewhere and how much finished, exit 1 (as a timeout), and the CLI cancels nothing."""
    cancels: list[str] = []
    real_cancel = BufferCore.cancel_batch

    def counted_cancel(core: BufferCore, bid: str, *a: Any, **kw: Any) -> Any:
        cancels.append(bid)
        return real_cancel(core, bid, *a, **kw)

    monkeypatch.setattr(BufferCore, "cancel_batch", counted_cancel)
    stop, gate = threading.Event(), threading.Semaphore(1)  # one request finishes, the rest wait
    sched = threading.Thread(target=play_scheduler, args=(buffer.address,), kwargs={"stop": stop, "gate": gate},
                             daemon=True)

    def cancel_elsewhere() -> None:
        deadline = time.monotonic() + 30
        with SeerClient(buffer.address, retry_seconds=1.0) as client:
            while time.monotonic() < deadline:
                try:
                    if client.get_batch("cli-else").num_finished >= 1:
                        client.cancel_batch("cli-else")
                        return
                except SeerError:  # not submitted yet
                    pass
                time.sleep(0.05)

    canceller = threading.Thread(target=cancel_elsewhere, daemon=True)
    sched.start()
    canceller.start()
    try:
        code = rollout.main(["--prompts", str(_one_prompt(tmp_path)), "--group-size", "4", "--max-tokens", "4",
                             "--address", buffer.address, "--no-progress", "--batch-id", "cli-else",
                             "--timeout", "60"])
    finally:
        stop.set()
        gate.release(100)
        canceller.join(30)
    captured = capsys.readouterr()
    err = captured.err
    assert code == 1, err
    assert ("seer rollout: batch cli-else was cancelled elsewhere before it completed: 1 of 4 responses "
            "finished (1 received here); this run cancelled nothing") in err, err
    assert "cancelled it" not in err and "nothing to cancel" not in err, err
    assert captured.out == ""  # no summary of part of a batch
    assert cancels == ["cli-else"], cancels  # the other process's cancel only
