"""The Node.js client (clients/node/rollout.js) against a real buffer (real gRPC, RocksDB) that is
restarted while the client streams results: the client retries UNAVAILABLE and reopens the result
stream from the cursor of the last result, so it gets every result once. Negative control: with no
retry window the same restart ends the client with an error. A thread plays the scheduler
(CommitChunk), so no model runs; the buffer tokenizes the client's prompt_text groups with the
embedded model's tokenizer.

Skipped where node/npm are not installed; `npm ci` fetches @grpc/grpc-js from the npm registry once
(the node_client and tok_buffer fixtures are in conftest.py)."""

from __future__ import annotations

import contextlib
import json
import queue
import signal
import subprocess
import threading
import time
from pathlib import Path

import pytest
from client_helpers import Buffer, Node, batch_submitted, finish_request
from seer_client import SeerClient


def _run(script: Path, buffer: Buffer, batch_id: str, retry_seconds: float) -> tuple[int, list[str]]:
    proc = subprocess.Popen(
        ["node", str(script), "--address", buffer.address, "--groups", "2", "--group-size", "2",
         "--max-tokens", "16", "--batch-id", batch_id, "--timeout", "60", "--retry-seconds", str(retry_seconds)],
        cwd=script.parent, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines: queue.Queue[str] = queue.Queue()
    out: list[str] = []
    stdout = proc.stdout
    assert stdout is not None

    def read() -> None:
        for line in stdout:
            lines.put(line)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()

    def wait_results(n: int) -> None:
        deadline = time.monotonic() + 30
        while sum(line.startswith("result ") for line in out) < n:
            assert time.monotonic() < deadline, out
            with contextlib.suppress(queue.Empty):
                out.append(lines.get(timeout=0.1))

    deadline = time.monotonic() + 30
    while not batch_submitted(buffer.address, batch_id):
        assert time.monotonic() < deadline and proc.poll() is None, "the node client did not submit"
        time.sleep(0.1)
    finish_request(buffer.address, f"{batch_id}/0/0")
    finish_request(buffer.address, f"{batch_id}/0/1")
    wait_results(2)
    buffer.stop()  # the client is streaming: its stream fails UNAVAILABLE
    time.sleep(1.0)
    buffer.start()
    finish_request(buffer.address, f"{batch_id}/1/0")
    finish_request(buffer.address, f"{batch_id}/1/1")
    rc = proc.wait(timeout=60)
    reader.join(5)
    while not lines.empty():
        out.append(lines.get())
    return rc, out


def test_the_node_client_resumes_its_stream_across_a_buffer_restart(node_client: Path, tok_buffer: Buffer) -> None:
    rc, out = _run(node_client, tok_buffer, "node-resume", retry_seconds=30)
    summary = json.loads(out[-1].removeprefix("RESULT "))
    assert rc == 0 and summary["ok"] and summary["responses"] == 4, out
    assert sum(line.startswith("result ") for line in out) == 4  # each result once
    # It did see the restart: UNAVAILABLE (14), or grpc-js' INTERNAL (13) for a session the
    # stopping server closed under the stream.
    assert any(line.startswith(("retrying after 14", "retrying after 13")) for line in out), out


def test_without_a_retry_window_the_restart_ends_the_node_client(node_client: Path, tok_buffer: Buffer) -> None:
    rc, out = _run(node_client, tok_buffer, "node-no-retry", retry_seconds=0)
    summary = json.loads(out[-1].removeprefix("RESULT "))
    assert rc == 1 and not summary["ok"], out


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_a_signal_cancels_the_node_clients_batch(node_client: Path, tok_buffer: Buffer, sig: signal.Signals) -> None:
    """Before: Ctrl-C (or a supervisor's SIGTERM) killed the client at once and its batch went on
    generating on the workers with nobody to read it. Now the calls in flight are cancelled, the
    batch is cancelled by this run's submission token, and the exit status is 128 + the signal, as
    `seer rollout` does."""
    batch_id = f"node-{sig.name}"
    n = Node(node_client, tok_buffer, batch_id, "--retry-seconds", "5")
    finish_request(tok_buffer.address, f"{batch_id}/0/0")
    n.wait_results(1)  # it is streaming results
    n.proc.send_signal(sig)
    rc, out = n.finish(30)
    assert rc == 128 + sig, out
    assert any(f"batch {batch_id}: cancelled it (3 unfinished responses)" in line for line in out), out
    with SeerClient(tok_buffer.address) as c:
        b = c.get_batch(batch_id)
    assert (b.state, b.num_finished, b.num_cancelled) == ("cancelled", 1, 3)
