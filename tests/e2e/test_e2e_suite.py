"""The whole suite end to end: five services as subprocesses over real gRPC on loopback, the real
reference engine on the embedded model, real RocksDB in temp dirs (issue 3).

One suite (2 workers) serves the tests of this module in order; the crash tests restart what they
kill so the next test starts from a full suite.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from e2e_helpers import stopping_cleanly
from seer.v1 import common_pb2, rollout_pb2, rollout_pb2_grpc
from seer_client import PromptGroup, Sampling, SeerClient

from services.cli.up import Suite

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def suite(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Suite]:
    s = Suite(workers=2, data_dir=tmp_path_factory.mktemp("suite"), model_dir=model_dir, policy="seer",
              chunk_size=8, heartbeat_interval=0.5)
    s.start(timeout=300)
    with stopping_cleanly(s):
        yield s


@pytest.fixture
def client(suite: Suite) -> Iterator[SeerClient]:
    with SeerClient(suite.address, retry_seconds=90) as c:
        yield c


def prompts(n: int) -> list[str]:
    return [f"Question: What is {7 + i} plus {5 * i + 3}?\nAnswer:" for i in range(n)]


def groups(n: int, size: int, max_tokens: int | list[int], *, temperature: float = 0.8,
           ignore_eos: bool = False) -> list[PromptGroup]:
    return [
        PromptGroup(prompt=p, group_size=size, prompt_key=f"e2e-{i}",
                    max_tokens=max_tokens if isinstance(max_tokens, int) else max_tokens[i],
                    sampling=Sampling(temperature=temperature, seed=7 + i, ignore_eos=ignore_eos),
                    labels={"answer": str(12 + 6 * i)})
        for i, p in enumerate(prompts(n))
    ]


def wait_for_progress(client: SeerClient, batch_id: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while client.get_batch(batch_id).generated_tokens == 0:
        assert time.monotonic() < deadline, "no chunk was committed"
        time.sleep(0.1)


def test_rollout_returns_every_response(suite: Suite, client: SeerClient) -> None:
    batch_id = f"e2e-{uuid.uuid4().hex[:8]}"
    sub = client.submit_batch(batch_id, groups(3, 2, 16))
    assert sub.num_requests == 6
    results = client.collect(batch_id)
    assert [r.cursor for r in results] == list(range(1, 7))
    assert len({r.request_id for r in results}) == 6
    assert sorted((r.group_index, r.sample_index) for r in results) == [(g, s) for g in range(3) for s in range(2)]
    for r in results:
        assert 1 <= len(r.token_ids) <= 16
        assert len(r.logprobs) == len(r.token_ids) and all(lp <= 0.0 for lp in r.logprobs)
        assert r.finish_reason in ("stop", "length")
        assert r.finish_reason == "stop" or len(r.token_ids) == 16
        assert r.policy_version == sub.policy_version
        assert r.labels["answer"] and r.text is not None
        assert r.num_chunks == max(1, -(-len(r.token_ids) // 8))  # chunks of 8 tokens (divided rollout)
    status = client.get_batch(batch_id, include_requests=True)
    assert status.state == "completed" and status.num_finished == 6
    assert status.generated_tokens == sum(len(r.token_ids) for r in results)
    # Resubmitting the same batch is a no-op.
    assert client.submit_batch(batch_id, groups(3, 2, 16)).already_submitted


def test_worker_killed_mid_chunk_is_redispatched(suite: Suite, client: SeerClient) -> None:
    batch_id = f"e2e-kill-worker-{uuid.uuid4().hex[:8]}"
    # Greedy and ignore_eos: every response runs 4 chunks, and siblings must come out identical.
    client.submit_batch(batch_id, groups(2, 3, 32, temperature=0.0, ignore_eos=True))
    wait_for_progress(client, batch_id)
    before = suite.scheduler_stats()
    busy = [w.worker_id for w in before.workers if w.in_flight_chunks > 0]
    assert busy, "no chunk in flight"
    victim = busy[0]
    suite.services[victim].signal(signal.SIGKILL)
    suite.services[victim].wait(10)
    results = client.collect(batch_id)
    assert len(results) == 6 and len({r.request_id for r in results}) == 6
    for r in results:
        assert len(r.token_ids) == 32 and r.finish_reason == "length", "tokens lost or duplicated"
        assert len(r.logprobs) == 32
    by_group: dict[int, list[list[int]]] = {}
    for r in results:
        by_group.setdefault(r.group_index, []).append(r.token_ids)
    for g, outs in by_group.items():
        assert all(o == outs[0] for o in outs), f"group {g}: greedy siblings differ after re-dispatch"
    after = suite.scheduler_stats()
    assert after.redispatched_chunks > before.redispatched_chunks
    assert victim not in [w.worker_id for w in after.workers if w.healthy]
    suite.restart(victim, timeout=180)
    suite.wait_workers(2, timeout=60)


def test_buffer_kill9_mid_batch_completes(suite: Suite, client: SeerClient) -> None:
    batch_id = f"e2e-kill-buffer-{uuid.uuid4().hex[:8]}"
    sub = client.submit_batch(batch_id, groups(2, 2, [4, 40], temperature=0.0, ignore_eos=True))
    it = client.iter_results(batch_id)
    first = next(it)  # a short response of group 0; the long ones are mid-way
    assert first.group_index == 0
    suite.services["buffer"].signal(signal.SIGKILL)
    suite.services["buffer"].wait(10)
    suite.restart("buffer", timeout=120)
    rest = list(it)  # the client reconnects and resumes from its cursor
    results = [first, *rest]
    assert [r.cursor for r in results] == list(range(1, 5))
    assert len({r.request_id for r in results}) == 4
    for r in results:
        assert len(r.token_ids) == (4 if r.group_index == 0 else 40), "tokens lost or duplicated"
        assert r.policy_version == sub.policy_version
    long = [r.token_ids for r in results if r.group_index == 1]
    assert long[0] == long[1]
    assert client.get_batch(batch_id).state == "completed"


def test_bad_input_is_refused_and_the_suite_keeps_serving(suite: Suite) -> None:
    good = rollout_pb2.PromptGroup(prompt_key="k", prompt_token_ids=[1, 2, 3], group_size=2, max_tokens=8,
                                   sampling=common_pb2.SamplingParams(temperature=0.0))

    def variant(**changes: object) -> rollout_pb2.PromptGroup:
        g = rollout_pb2.PromptGroup()
        g.CopyFrom(good)
        for k, v in changes.items():
            if k == "sampling":
                g.sampling.CopyFrom(v)  # type: ignore[arg-type]
            elif k == "prompt_token_ids":
                del g.prompt_token_ids[:]
                g.prompt_token_ids.extend(v)  # type: ignore[arg-type]
            else:
                setattr(g, k, v)
        return g

    cases: list[tuple[rollout_pb2.SubmitBatchRequest, grpc.StatusCode, str]] = [
        (rollout_pb2.SubmitBatchRequest(batch_id="bad-1"), grpc.StatusCode.INVALID_ARGUMENT, "groups"),
        (rollout_pb2.SubmitBatchRequest(batch_id="bad 2", groups=[good]), grpc.StatusCode.INVALID_ARGUMENT,
         "batch_id"),
        (rollout_pb2.SubmitBatchRequest(batch_id="bad-3", groups=[good, variant(group_size=0)]),
         grpc.StatusCode.INVALID_ARGUMENT, "groups[1].group_size"),
        (rollout_pb2.SubmitBatchRequest(batch_id="bad-4", groups=[variant(group_size=1025)]),
         grpc.StatusCode.INVALID_ARGUMENT, "groups[0].group_size"),
        (rollout_pb2.SubmitBatchRequest(batch_id="bad-5", groups=[variant(prompt_token_ids=[5] * 9000)]),
         grpc.StatusCode.INVALID_ARGUMENT, "groups[0]"),
        (rollout_pb2.SubmitBatchRequest(batch_id="bad-6", groups=[variant(prompt_token_ids=[1, 49152])]),
         grpc.StatusCode.INVALID_ARGUMENT, "groups[0].prompt_token_ids[1]"),
        (rollout_pb2.SubmitBatchRequest(batch_id="bad-7", groups=[variant(
            sampling=common_pb2.SamplingParams(temperature=1.0, top_p=1.5))]),
         grpc.StatusCode.INVALID_ARGUMENT, "groups[0].sampling.top_p"),
        (rollout_pb2.SubmitBatchRequest(batch_id="bad-8", groups=[variant(
            sampling=common_pb2.SamplingParams(temperature=-1.0))]),
         grpc.StatusCode.INVALID_ARGUMENT, "groups[0].sampling.temperature"),
        (rollout_pb2.SubmitBatchRequest(batch_id="bad-9", groups=[variant(prompt_text="x" * (65 << 20))]),
         grpc.StatusCode.RESOURCE_EXHAUSTED, ""),
    ]
    with grpc.insecure_channel(suite.address) as ch:
        stub = rollout_pb2_grpc.RolloutServiceStub(ch)
        valid = rollout_pb2.SubmitBatchRequest(batch_id=f"ok-{uuid.uuid4().hex[:8]}", groups=[good])
        stub.SubmitBatch(valid, timeout=30)
        for req, code, fld in cases:
            with pytest.raises(grpc.RpcError) as e:
                stub.SubmitBatch(req, timeout=60)
            assert e.value.code() == code, (req.batch_id, e.value.code(), e.value.details())
            assert fld in (e.value.details() or ""), (req.batch_id, e.value.details())
        with pytest.raises(grpc.RpcError) as e:
            stub.GetBatch(rollout_pb2.GetBatchRequest(batch_id="no-such-batch"), timeout=10)
        assert e.value.code() == grpc.StatusCode.NOT_FOUND
        with pytest.raises(grpc.RpcError) as e:
            list(stub.StreamResults(rollout_pb2.StreamResultsRequest(batch_id="no-such-batch"), timeout=10))
        assert e.value.code() == grpc.StatusCode.NOT_FOUND
        # Same id, same content: a no-op; same id, different content: ALREADY_EXISTS.
        assert stub.SubmitBatch(valid, timeout=30).already_submitted
        changed = rollout_pb2.SubmitBatchRequest(batch_id=valid.batch_id, groups=[variant(max_tokens=9)])
        with pytest.raises(grpc.RpcError) as e:
            stub.SubmitBatch(changed, timeout=30)
        assert e.value.code() == grpc.StatusCode.ALREADY_EXISTS
        # Nothing accepted before was disturbed.
        results = list(stub.StreamResults(rollout_pb2.StreamResultsRequest(batch_id=valid.batch_id), timeout=120))
        assert len(results) == 2 and all(len(r.result.token_ids) >= 1 for r in results)


def test_metrics_endpoints_respond(suite: Suite) -> None:
    for name, s in suite.services.items():
        assert s.metrics_port, name
        with urllib.request.urlopen(f"http://127.0.0.1:{s.metrics_port}/metrics", timeout=10) as resp:
            body = resp.read().decode()
        assert resp.status == 200
        assert "seer_" in body, f"{name}: no seer_ metrics"
    with urllib.request.urlopen(f"http://127.0.0.1:{suite.services['scheduler'].metrics_port}/metrics") as resp:
        body = resp.read().decode()
    for metric in ("seer_scheduler_pending_requests", "seer_scheduler_in_flight_chunks",
                   "seer_scheduler_dispatched_chunks_total", "seer_scheduler_redispatched_chunks_total",
                   "seer_scheduler_worker_tokens_per_second"):
        assert metric in body, metric
    dispatched = [line for line in body.splitlines() if line.startswith("seer_scheduler_dispatched_chunks_total")]
    assert float(dispatched[0].split()[-1]) > 0


def test_grpo_example_runs_two_iterations(suite: Suite) -> None:
    """examples/grpo_loop.py as a user runs it: the policy version flows through UpdateWeights."""
    out = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "grpo_loop.py"), "--address", suite.address, "--iterations", "2",
         "--limit", "2", "--group-size", "2", "--max-tokens", "12"],
        capture_output=True, text=True, timeout=300, env=suite._env,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert out.stdout.strip().endswith("ok")
    its = [json.loads(ln) for ln in out.stdout.splitlines() if ln.startswith('{"iteration"')]
    assert len(its) == 2
    assert its[1]["policy_version"] == its[0]["policy_version"] + 1
    assert all(it["responses"] == 4 for it in its)
