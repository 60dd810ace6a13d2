"""SeerClient against a real buffer: typed calls, errors, retries and exactly-once resumed streams."""

from __future__ import annotations

import importlib.util
import threading
import time
from pathlib import Path
from types import ModuleType

import pytest
from client_helpers import Buffer, answer_tokens, play_scheduler
from seer_client import BatchCancelled, PromptGroup, Sampling, SeerClient, SeerError, by_group, group_advantages, score

REPO = Path(__file__).resolve().parents[2]


def _load(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, REPO / "examples" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _scheduler(address: str, **kw: object) -> threading.Thread:
    t = threading.Thread(target=play_scheduler, args=(address,), kwargs=kw, daemon=True)
    t.start()
    return t


def test_run_batch_returns_typed_results(buffer: Buffer) -> None:
    reward_mod = _load("reward")
    with SeerClient(buffer.address) as client:
        client.wait_ready(10)
        groups = [PromptGroup(prompt=[1, 2, 3], group_size=3, max_tokens=8, prompt_key="q0",
                              sampling=Sampling(temperature=1.0, seed=7), labels={"answer": "11"}),
                  PromptGroup(prompt=[4, 5], group_size=2, max_tokens=8, labels={"answer": "10"})]
        _scheduler(buffer.address)
        seen: list[str] = []
        results = client.run_batch("rb", groups, on_result=lambda r: seen.append(r.request_id))
        assert sorted(seen) == sorted(r.request_id for r in results) and len(results) == 5
        assert [r.cursor for r in results] == [1, 2, 3, 4, 5]
        r0 = next(r for r in results if r.request_id == "rb/0/1")
        assert (r0.token_ids, r0.finish_reason, r0.num_chunks, r0.prompt_key) == (answer_tokens("rb/0/1", 4), "stop",
                                                                                  2, "q0")
        assert r0.logprobs == [-0.25] * 4 and r0.labels == {"answer": "11"} and r0.stats["steps"] == 0
        # Trainer-side grouping and a reward of the caller's choice (the client knows no rewards).
        grouped = by_group(results)
        assert [[r.sample_index for r in rs] for rs in grouped.values()] == [[0, 1, 2], [0, 1]]
        scored = score(results, lambda r: reward_mod.reward(str(r.token_ids[0]), r.labels["answer"]))
        assert [rw for _r, rw, _a in scored[0]] == [0.0, 1.0, 0.0]
        assert [rw for _r, rw, _a in scored[1]] == [1.0, 0.0]
        assert abs(sum(a for _r, _rw, a in scored[0])) < 1e-9 and scored[0][1][2] > 0
        status = client.get_batch("rb", include_requests=True)
        assert (status.state, status.done, status.num_finished, status.generated_tokens) == ("completed", True, 5, 20)
        assert {r.state for r in status.requests} == {"finished"}


def test_idempotent_submit_and_errors_name_the_field(buffer: Buffer) -> None:
    with SeerClient(buffer.address) as client:
        g = [PromptGroup(prompt=[1, 2], group_size=2, max_tokens=4)]
        first, again = client.submit_batch("idem", g), client.submit_batch("idem", g)
        assert (first.already_submitted, again.already_submitted, again.num_requests) == (False, True, 2)
        with pytest.raises(SeerError) as e:
            client.submit_batch("bad", [PromptGroup(prompt=[1], group_size=0, max_tokens=4)])
        assert e.value.code == "INVALID_ARGUMENT" and "groups[0].group_size" in e.value.message
        with pytest.raises(SeerError) as e:
            client.submit_batch("idem", [PromptGroup(prompt=[1, 2], group_size=3, max_tokens=4)])
        assert e.value.code == "ALREADY_EXISTS"
        with pytest.raises(SeerError) as e:
            client.submit_batch("text", [PromptGroup(prompt="hello", group_size=1, max_tokens=4)])
        # The client's field (the buffer names the proto's prompt_text: test_client_field_names.py).
        assert e.value.code == "FAILED_PRECONDITION" and e.value.message.startswith("groups[0].prompt: ")
        with pytest.raises(SeerError) as e:
            list(client.iter_results("missing"))
        assert e.value.code == "NOT_FOUND"
        # The seed scope is part of the submission the client sends.
        seeded = [PromptGroup(prompt=[1, 2], group_size=2, max_tokens=4, sampling=Sampling(seed=3))]
        assert not client.submit_batch("scoped", seeded, seed_scope="rep-0").already_submitted
        assert client.submit_batch("scoped", seeded, seed_scope="rep-0").already_submitted
        with pytest.raises(SeerError) as e:
            client.submit_batch("scoped", seeded, seed_scope="rep-1")
        assert e.value.code == "ALREADY_EXISTS"
        with pytest.raises(SeerError) as e:
            client.submit_batch("scoped-bad", seeded, seed_scope="a b")
        assert e.value.code == "INVALID_ARGUMENT" and "seed_scope" in e.value.message


def test_iter_results_resumes_across_a_buffer_restart(buffer: Buffer) -> None:
    gate, stop = threading.Semaphore(3), threading.Event()
    with SeerClient(buffer.address, retry_seconds=30) as client:
        client.submit_batch("resume", [PromptGroup(prompt=[1, 2, 3], group_size=6, max_tokens=8)])
        first = _scheduler(buffer.address, gate=gate, stop=stop)
        it = client.iter_results("resume")
        got = [next(it) for _ in range(3)]

        def restart() -> None:
            time.sleep(0.3)
            stop.set()
            gate.release()
            buffer.stop()  # the open stream breaks with UNAVAILABLE
            time.sleep(0.5)
            buffer.start()
            _scheduler(buffer.address)

        threading.Thread(target=restart, daemon=True).start()
        got += list(it)
        first.join(5)
    assert [r.cursor for r in got] == [1, 2, 3, 4, 5, 6]
    assert sorted(r.request_id for r in got) == [f"resume/0/{s}" for s in range(6)]  # each exactly once


def test_calls_retry_until_the_buffer_is_up(buffer: Buffer) -> None:
    buffer.stop()
    threading.Timer(0.5, buffer.start).start()
    with SeerClient(buffer.address, retry_seconds=20) as client:
        assert client.submit_batch("late", [PromptGroup(prompt=[1], group_size=1, max_tokens=2)]).num_requests == 1
        client.wait_ready(5)


def test_wait_ready_times_out_on_a_dead_address(buffer: Buffer) -> None:
    buffer.stop()
    with SeerClient(buffer.address, retry_seconds=0.3) as client:
        with pytest.raises(SeerError) as e:
            client.wait_ready(0.5)
        # A SeerTimeout, a TimeoutError too (before: a plain SeerError).
        assert e.value.code == "DEADLINE_EXCEEDED" and isinstance(e.value, TimeoutError)
        with pytest.raises(SeerError) as e:
            client.get_batch("x")
        assert e.value.code == "UNAVAILABLE"


def test_cancel_and_update_weights(buffer: Buffer) -> None:
    with SeerClient(buffer.address) as client:
        client.submit_batch("c", [PromptGroup(prompt=[1], group_size=4, max_tokens=4)])
        with pytest.raises(SeerError) as e:
            client.update_weights(1)
        assert e.value.code == "FAILED_PRECONDITION"
        assert client.cancel_batch("c") == 4
        assert client.cancel_batch("c") == 4  # a retry after a lost reply learns the same count
        # Cancelled before any response finished: not an empty batch (test_client_batch_cancelled.py).
        with pytest.raises(BatchCancelled) as cancelled:
            client.collect("c")
        assert cancelled.value.results == [] and client.get_batch("c").state == "cancelled"
        up = client.update_weights(1, source="")
        assert (up.version, up.num_workers) == (1, 0)
        assert client.submit_batch("after", [PromptGroup(prompt=[1], group_size=1, max_tokens=2)]).policy_version == 1


def test_group_advantages() -> None:
    assert group_advantages([1.0, 0.0]) == [1.0, -1.0]
    assert group_advantages([1.0, 1.0, 1.0]) == [0.0, 0.0, 0.0]
    assert group_advantages([2.0, 0.0], normalize_std=False) == [1.0, -1.0]
