"""The Node.js client (clients/node/rollout.js) as a usable client, against a real buffer (real gRPC,
RocksDB; the test commits results as the scheduler would, so no model runs): it can be required as
a library and hands every result field to the caller, writes results as JSON lines (--output), cancels
its batch when --timeout runs out or the result stream fails for good, keeps 64-bit values (seeds,
policy versions) exact, and names the results the buffer left out of the stream."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import time
from pathlib import Path

import grpc
import pytest
from client_helpers import Buffer, Node, _free_port, batch_submitted, finish_request
from seer.v1 import buffer_pb2, buffer_pb2_grpc, common_pb2
from seer_client import SeerClient

from services.buffer.core import derive_seed
from services.common import server as common_server

BIG = 2**53 + 1  # the first integer a double cannot hold: read as 2**53


def _commit(address: str, request_id: str, seq: int, tokens: list[int], last: bool, version: int = 0) -> None:
    with grpc.insecure_channel(address) as ch:
        buffer_pb2_grpc.BufferInternalServiceStub(ch).CommitChunk(buffer_pb2.CommitChunkRequest(
            request_id=request_id, seq=seq, token_ids=tokens, logprobs=[-0.5] * len(tokens),
            finish_reason=common_pb2.FINISH_REASON_STOP if last else common_pb2.FINISH_REASON_CHUNK,
            policy_version=version), timeout=5)


def _finish_all(address: str, batch_id: str, version: int = 0) -> None:
    for rid in (f"{batch_id}/0/0", f"{batch_id}/0/1", f"{batch_id}/1/0", f"{batch_id}/1/1"):
        finish_request(address, rid, policy_version=version)


def _python_results(address: str, batch_id: str) -> dict[str, dict[str, object]]:
    with SeerClient(address) as c:
        return {r.request_id: dataclasses.asdict(r) for r in c.collect(batch_id, timeout=10)}


LIBRARY_USER = """
const {{ rollout, resultLine }} = require({script});
rollout({{
  address: {address}, batchId: {batch_id}, timeout: {timeout}, retrySeconds: 5,
  groups: [{{ prompt_key: 'k', prompt_token_ids: [1, 2, 3], group_size: 2, max_tokens: 8,
             sampling: {{ temperature: 1.0, seed: {seed} }}, labels: {{ answer: '42' }} }}],
}}, (r) => console.log(`R ${{resultLine(r)}}`))
  .then((s) => console.log(`DONE ${{JSON.stringify(s)}}`))
  .catch((e) => console.log(`FAILED ${{JSON.stringify({{ code: e.code, field: e.field, message: e.details || e.message,
                                                        cancel: e.cancel }})}}`));
"""


def _library(node_client: Path, tmp_path: Path, address: str, batch_id: str, *, timeout: float = 30,
             seed: str = "7n") -> subprocess.Popen[str]:
    user = tmp_path / "user.js"
    user.write_text(LIBRARY_USER.format(script=json.dumps(str(node_client)), address=json.dumps(address),
                                        batch_id=json.dumps(batch_id), timeout=timeout, seed=seed))
    return subprocess.Popen(["node", str(user)], cwd=node_client.parent, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)


def _wait_submitted(address: str, batch_id: str, proc: subprocess.Popen[str]) -> None:
    deadline = time.monotonic() + 30
    while not batch_submitted(address, batch_id):
        assert time.monotonic() < deadline and proc.poll() is None, proc.communicate()[0] if proc.poll() else ""
        time.sleep(0.1)


def test_required_as_a_library_it_hands_every_result_field_to_the_caller(
        node_client: Path, tok_buffer: Buffer, tmp_path: Path) -> None:
    """Before: require('./rollout.js') ran the command-line program (main() on import) and exported
    nothing; the program printed only token counts, finish reason and version."""
    assert tok_buffer.core is not None
    tok_buffer.core.update_weights(BIG, "", lambda version, source: 1)  # a version above 2^53
    proc = _library(node_client, tmp_path, tok_buffer.address, "lib", seed="18446744073709551615n")
    _wait_submitted(tok_buffer.address, "lib", proc)
    finish_request(tok_buffer.address, "lib/0/0", policy_version=BIG)
    finish_request(tok_buffer.address, "lib/0/1", policy_version=BIG)
    out, _ = proc.communicate(timeout=30)
    lines = out.splitlines()
    assert proc.returncode == 0 and lines[-1].startswith("DONE "), out
    done = json.loads(lines[-1].removeprefix("DONE "))
    assert done["responses"] == 2 and done["num_requests"] == 2 and done["policy_version"] == str(BIG), done
    # Every field the Python client gives, with the same values (64-bit ones exact).
    got = {r["request_id"]: r for r in (json.loads(line.removeprefix("R ")) for line in lines if line.startswith("R "))}
    assert got == _python_results(tok_buffer.address, "lib")
    r = got["lib/0/0"]
    assert (r["token_ids"], r["logprobs"], r["finish_reason"], r["policy_version"]) == ([7, 8], [-0.5, -0.25],
                                                                                         "stop", BIG)
    assert r["labels"] == {"answer": "42"} and {r["cursor"] for r in got.values()} == {1, 2}


def test_the_cli_writes_every_result_as_a_json_line(node_client: Path, tok_buffer: Buffer, tmp_path: Path) -> None:
    """--output FILE: one JSON line per result with the Python client's RolloutResult fields; with
    `-` they go to stdout, which then holds nothing else. Before: unknown option."""
    for output in (str(tmp_path / "results.jsonl"), "-"):
        batch_id = "out-file" if output != "-" else "out-stdout"
        proc = subprocess.Popen(
            ["node", str(node_client), "--address", tok_buffer.address, "--batch-id", batch_id, "--timeout", "30",
             "--output", output], cwd=node_client.parent, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        _wait_submitted(tok_buffer.address, batch_id, proc)
        _finish_all(tok_buffer.address, batch_id)
        stdout, stderr = proc.communicate(timeout=30)
        assert proc.returncode == 0, (stdout, stderr)
        text = Path(output).read_text() if output != "-" else stdout
        records = [json.loads(line) for line in text.splitlines()]
        assert len(records) == 4 and {r["request_id"]: r for r in records} == _python_results(tok_buffer.address,
                                                                                              batch_id)
        if output == "-":
            assert "RESULT " in stderr and "result 1/4" in stderr, stderr  # the human lines moved to stderr


def test_a_timeout_cancels_the_cli_batch(node_client: Path, tok_buffer: Buffer) -> None:
    """Before: --timeout ended the run and left the batch generating (nobody to read it)."""
    n = Node(node_client, tok_buffer, "node-to", "--timeout", "3", "--retry-seconds", "5")
    finish_request(tok_buffer.address, "node-to/0/0")
    rc, out = n.finish(30)
    assert rc == 1 and any(line.startswith("error: 4 ") for line in out), out  # 4 = DEADLINE_EXCEEDED
    assert any("batch node-to: cancelled it (3 unfinished responses)" in line for line in out), out
    assert '"cancel":"cancelled it (3 unfinished responses)"' in out[-1], out
    with SeerClient(tok_buffer.address) as c:
        b = c.get_batch("node-to")
    assert (b.state, b.num_finished, b.num_cancelled) == ("cancelled", 1, 3)


def test_a_stream_failed_for_good_cancels_the_cli_batch(node_client: Path, tok_buffer: Buffer) -> None:
    """No retry window: a buffer restart fails the stream for good. The cancel that follows retries
    the restarting buffer for up to 5 s. Before: the batch went on running."""
    n = Node(node_client, tok_buffer, "node-gone", "--retry-seconds", "0", "--timeout", "30")
    finish_request(tok_buffer.address, "node-gone/0/0")
    n.wait_results(1)
    tok_buffer.stop()
    time.sleep(0.5)
    tok_buffer.start()
    rc, out = n.finish(30)
    assert rc == 1, out
    assert any("batch node-gone: cancelled it (3 unfinished responses)" in line for line in out), out
    with SeerClient(tok_buffer.address) as c:
        assert c.get_batch("node-gone").state == "cancelled"


def test_a_library_timeout_leaves_the_batch_running_as_run_batch(node_client: Path, tok_buffer: Buffer,
                                                                  tmp_path: Path) -> None:
    """Unlike the CLI's --timeout, the library's stops the wait, not the batch (as SeerClient.run_batch;
    cancelOnTimeout and the resume: test_node_client_library.py)."""
    proc = _library(node_client, tmp_path, tok_buffer.address, "lib-to", timeout=2)
    _wait_submitted(tok_buffer.address, "lib-to", proc)
    out, _ = proc.communicate(timeout=30)
    failed = json.loads(out.splitlines()[-1].removeprefix("FAILED "))
    assert failed["code"] == 4 and failed["cancel"].startswith("left running"), out
    with SeerClient(tok_buffer.address) as c:
        assert c.get_batch("lib-to").state == "running"


def _seeds(address: str, batch_id: str, n: int) -> dict[str, int]:
    """The seeds of the batch's requests as the buffer hands them to the scheduler (WatchWork)."""
    seeds: dict[str, int] = {}
    with grpc.insecure_channel(address) as ch:
        feed = buffer_pb2_grpc.BufferInternalServiceStub(ch).WatchWork(
            buffer_pb2.WatchWorkRequest(watcher_id="seed-reader"), timeout=10)
        for ev in feed:
            if ev.HasField("added"):
                seeds.update({it.request_id: it.sampling.seed for it in ev.added.items
                              if it.request_id.startswith(f"{batch_id}/")})
            if len(seeds) == n:
                feed.cancel()
                return seeds
    raise AssertionError(seeds)


@pytest.mark.parametrize("seed", [BIG, 2**64 - 2])
def test_a_large_seed_is_sent_exactly(node_client: Path, tok_buffer: Buffer, seed: int) -> None:
    """Before: int64/uint64 fields were JS Numbers (exact only to 2^53), and there was no --seed: a
    large seed was sent as another one. Group g uses seed + g (as `seer rollout --seed`)."""
    batch_id = f"node-seed-{seed % 1000}"
    n = Node(node_client, tok_buffer, batch_id, "--seed", str(seed), "--timeout", "30")
    seeds = _seeds(tok_buffer.address, batch_id, 4)
    _finish_all(tok_buffer.address, batch_id)
    rc, out = n.finish(30)
    assert rc == 0, out
    for rid, got in seeds.items():
        g, s = (int(x) for x in rid.split("/")[1:])
        assert got == derive_seed(seed + g, batch_id, s), rid


@pytest.mark.parametrize("args, message", [
    (("--seed", "18446744073709551615"), "--seed: must be an integer in [0, 18446744073709551614]"),  # 2 groups
    (("--seed", "-1"), "--seed: must be an integer in [0, "),
    (("--seed", "1e3"), "--seed: must be an integer in [0, "),
    (("--output", "/nonexistent-dir/x.jsonl"), "ENOENT"),
])
def test_node_refuses_a_bad_seed_or_output_before_any_call(node_client: Path, args: tuple[str, str],
                                                           message: str) -> None:
    proc = subprocess.run(["node", str(node_client), "--address", f"127.0.0.1:{_free_port()}", *args],
                          cwd=node_client.parent, capture_output=True, text=True, timeout=30)
    assert proc.returncode == 1 and message in proc.stderr, (proc.stdout, proc.stderr)


def test_the_library_refuses_an_inexact_seed_naming_the_field(node_client: Path, tmp_path: Path) -> None:
    # A Number above 2^53 has already lost its value: refused, not sent as its neighbour.
    proc = _library(node_client, tmp_path, f"127.0.0.1:{_free_port()}", "lib-bad", seed=str(BIG))
    out, _ = proc.communicate(timeout=30)
    failed = json.loads(out.splitlines()[-1].removeprefix("FAILED "))
    assert failed["field"] == "groups[0].sampling.seed" and "pass a string or a BigInt" in failed["message"], out


SEND_LIMIT = 4096  # the buffer's message limit in this test (64 MiB in production)


def test_results_left_out_by_the_buffer_are_named_after_a_resume(
        node_client: Path, tok_buffer: Buffer, monkeypatch: pytest.MonkeyPatch) -> None:
    """A result over the buffer's message limit is left out of the stream; the stream is then cut
    (a restart) and resumed past it, and the resumed stream ends OK. Before: the run said only
    "stream ended after 3 of 4 results"; now it names the left-out cursor, as the Python client."""
    tok_buffer.stop()
    monkeypatch.setattr(common_server, "MAX_MESSAGE_BYTES", SEND_LIMIT)  # read when the server starts
    tok_buffer.start()
    n = Node(node_client, tok_buffer, "node-lo", "--max-tokens", "2000", "--retry-seconds", "10", "--timeout", "30")
    finish_request(tok_buffer.address, "node-lo/0/0")  # cursor 0
    for seq in range(8):  # cursor 1: 2000 tokens, over the limit (committed in chunks under it)
        _commit(tok_buffer.address, "node-lo/0/1", seq, [4 + (i % 14) for i in range(250)], last=seq == 7)
    finish_request(tok_buffer.address, "node-lo/1/0")  # cursor 2
    n.wait_results(2)  # cursors 1 and 3 came: the stream stepped past the left-out one
    tok_buffer.stop()
    time.sleep(0.3)
    tok_buffer.start()
    finish_request(tok_buffer.address, "node-lo/1/1")
    rc, out = n.finish(30)
    assert rc == 1, out
    assert any(line.startswith("error: 8 ") and "1 result(s) were left out" in line and "cursor(s) 1" in line
               for line in out), out
