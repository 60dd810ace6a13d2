"""The Node.js client (clients/node/rollout.js) in the retry scenarios the Python client survives
(tests/client/test_client_stream_retry.py), against a real buffer on a loopback port that is
restarted or limited under it: a restart after a quiet spell longer than the retry window, a stream
refused at the buffer's stream limit, a long outage (the channel's reconnect backoff), --timeout as
one deadline for the whole run, and command-line numbers it must refuse. The test plays the
scheduler by committing results itself (CommitChunk), so no model runs."""

from __future__ import annotations

import dataclasses
import subprocess
import threading
import time
from pathlib import Path

import grpc
import pytest
from client_helpers import Buffer, Node, _free_port, _ok, batch_submitted, finish_request
from seer.v1 import rollout_pb2, rollout_pb2_grpc
from seer_client import PromptGroup, SeerClient


def test_node_retries_a_restart_after_a_quiet_spell(node_client: Path, tok_buffer: Buffer) -> None:
    # Two restarts separated by quiet spells longer than --retry-seconds (the streams are accepted,
    # no result arrives), each outage short. The window leaves room for both outages as the client
    # sees them (stop, 0.2 s, a buffer start, a reconnect, with the backoff not reset by an
    # accepted stream) on a loaded machine; 3 s was too tight, and 5 s failed once at load average
    # 8-9 (the backoff alone is ~3.2 s over the two outages).
    # Before: the window ran from the last result, so the second restart ended the client.
    n = Node(node_client, tok_buffer, "node-quiet", "--retry-seconds", "8")
    finish_request(tok_buffer.address, "node-quiet/0/0")
    finish_request(tok_buffer.address, "node-quiet/0/1")
    n.wait_results(2)
    for _ in range(2):
        time.sleep(8.5)
        tok_buffer.stop()
        time.sleep(0.2)
        tok_buffer.start()
    time.sleep(0.3)
    finish_request(tok_buffer.address, "node-quiet/1/0")
    finish_request(tok_buffer.address, "node-quiet/1/1")
    rc, out = n.finish()
    assert _ok(rc, out), "\n".join(out)
    assert sum(line.startswith("result ") for line in out) == 4  # each result once


def test_node_retries_a_stream_refused_at_the_limit(node_client: Path, tok_buffer: Buffer) -> None:
    tok_buffer.stop()
    # max_streams 2 with 1 kept for WatchWork: one StreamResults at a time.
    tok_buffer.cfg = dataclasses.replace(tok_buffer.cfg, max_workers=4, max_streams=2)
    tok_buffer.start()
    with SeerClient(tok_buffer.address) as c:
        c.submit_batch("hold", [PromptGroup(prompt=[1], group_size=1, max_tokens=4)])
    ch = grpc.insecure_channel(tok_buffer.address)
    holder = rollout_pb2_grpc.RolloutServiceStub(ch).StreamResults(
        rollout_pb2.StreamResultsRequest(batch_id="hold"), timeout=30)
    holder.initial_metadata()  # it holds the one slot
    try:
        # Before: RESOURCE_EXHAUSTED (the buffer's stream limit) ended the client at once.
        n = Node(node_client, tok_buffer, "node-limit", "--retry-seconds", "20")
        time.sleep(0.5)
        holder.cancel()
        for rid in ("node-limit/0/0", "node-limit/0/1", "node-limit/1/0", "node-limit/1/1"):
            finish_request(tok_buffer.address, rid)
        rc, out = n.finish()
    finally:
        ch.close()
    assert _ok(rc, out), "\n".join(out)
    assert any(line.startswith("retrying after 8 ") for line in out), out  # 8 = RESOURCE_EXHAUSTED


def test_node_timeout_is_one_deadline_for_the_whole_run(node_client: Path, tok_buffer: Buffer) -> None:
    # The buffer restarts every 1.5 s and the batch never completes. Before: every reopened stream
    # got a fresh --timeout deadline, so the run went on until the restarts stopped and one stream
    # had been open for --timeout (or the retry window ran out): ~14 s here. Now --timeout ends the
    # run, DEADLINE_EXCEEDED, whatever the reconnects.
    n = Node(node_client, tok_buffer, "node-deadline", "--timeout", "4", "--retry-seconds", "30")
    finish_request(tok_buffer.address, "node-deadline/0/0")
    n.wait_results(1)
    until = n.started + 10
    while time.monotonic() < until and n.proc.poll() is None:
        time.sleep(1.3)
        tok_buffer.stop()
        time.sleep(0.2)
        tok_buffer.start()
    rc, out = n.finish()
    elapsed = time.monotonic() - n.started
    assert rc == 1 and elapsed < 8, (elapsed, out)
    assert any(line.startswith("error: 4 ") for line in out), out  # 4 = DEADLINE_EXCEEDED
    assert any("--timeout ran out" in line for line in out), out


@pytest.mark.parametrize("args, message", [
    (("--timeout", "abc"), "--timeout: must be a positive number of seconds"),
    (("--timeout", "0"), "--timeout: must be a positive number of seconds"),
    (("--timeout", "-5"), "--timeout: must be a positive number of seconds"),
    (("--timeout", "10s"), "--timeout: must be a positive number of seconds"),
    (("--retry-seconds", "nan"), "--retry-seconds: must be a number of seconds >= 0"),
    (("--retry-seconds", "-1"), "--retry-seconds: must be a number of seconds >= 0"),
    # Before: parseInt read "abc" as NaN (an empty batch was submitted, then "expected NaN"), "2x"
    # as 2 and "1.5" as 1; 0 groups submitted an empty batch.
    (("--groups", "abc"), "--groups: must be a positive integer"),
    (("--groups", "0"), "--groups: must be a positive integer"),
    (("--group-size", "2x"), "--group-size: must be a positive integer"),
    (("--max-tokens", "1.5"), "--max-tokens: must be a positive integer"),
    (("--max-tokens", ""), "--max-tokens: must be a positive integer"),
    # int32 fields: 4294967298 was encoded as 2.
    (("--group-size", "4294967298"), "--group-size: must be a positive integer below 2^31"),
])
def test_node_refuses_a_bad_number(node_client: Path, args: tuple[str, str], message: str) -> None:
    # Nothing listens on the address: the run must end on the argument, before any call. Before:
    # parseFloat made NaN (or 10 of "10s") and the run went on with no bound or a wrong one.
    proc = subprocess.run(["node", str(node_client), "--address", f"127.0.0.1:{_free_port()}", *args],
                          cwd=node_client.parent, capture_output=True, text=True, timeout=30)
    assert proc.returncode == 1 and message in proc.stderr, (proc.stdout, proc.stderr)


OUTAGE, WINDOW = 17.0, 23.0


@pytest.mark.slow  # ~22 s, and a timing margin of ~1.4 s: make test-slow, not the default run
def test_node_reconnects_promptly_after_a_long_outage(node_client: Path, tok_buffer: Buffer) -> None:
    # Before: grpc-js' default reconnect backoff (1 s growing by 1.6x, jittered, to 120 s) waited
    # seconds into a 17 s outage's aftermath for its next connection attempt, so the client kept
    # failing UNAVAILABLE after the buffer was back, resumed late or used up the window. With the
    # Python client's backoff (100 ms to 1 s) it reconnects within about a second. ~22 s.
    n = Node(node_client, tok_buffer, "node-outage", "--retry-seconds", str(WINDOW))
    finish_request(tok_buffer.address, "node-outage/0/0")
    finish_request(tok_buffer.address, "node-outage/0/1")
    n.wait_results(2)
    tok_buffer.stop()
    time.sleep(OUTAGE)
    tok_buffer.start()
    back = time.monotonic()
    finish_request(tok_buffer.address, "node-outage/1/0")
    finish_request(tok_buffer.address, "node-outage/1/1")
    rc, out = n.finish()
    resumed = time.monotonic() - back
    print(f"the node client finished {resumed:.1f}s after the buffer was back")
    assert _ok(rc, out), "\n".join(out[-6:])
    # The client retries every 2 s by then and the channel reconnects within 1 s (+20% jitter) of the
    # buffer's return, so the next retry gets through: ~2 s to the end of the run here. With the
    # default backoff the next connection attempt came 4 s or more after the buffer was back (or
    # after the window ran out).
    assert resumed < 3.5, (resumed, out[-6:])


def test_node_waits_out_a_weight_switch_at_submit(node_client: Path, tok_buffer: Buffer) -> None:
    # Another caller's update_weights is switching (2 s); the buffer refuses the submission with
    # UNAVAILABLE and the retry reason "weight-switch". Before: given up after --retry-seconds.
    assert tok_buffer.core is not None
    entered = threading.Event()

    def slow_switch(version: int, source: str) -> int:
        entered.set()
        time.sleep(2.0)
        return 1

    t = threading.Thread(target=tok_buffer.core.update_weights, args=(1, "", slow_switch))
    t.start()
    assert entered.wait(5)
    n = Node(node_client, tok_buffer, "node-switch", "--retry-seconds", "0.3")
    t.join(10)
    for rid in ("node-switch/0/0", "node-switch/0/1", "node-switch/1/0", "node-switch/1/1"):
        finish_request(tok_buffer.address, rid, policy_version=1)  # the batch runs at the new version
    rc, out = n.finish()
    assert _ok(rc, out), "\n".join(out)
    assert any(line.startswith("retrying after 14 ") for line in out), out  # 14 = UNAVAILABLE


def test_node_retry_seconds_0_does_not_wait_out_a_weight_switch(node_client: Path, tok_buffer: Buffer) -> None:
    # --retry-seconds 0 is "no retries": the first transient failure is final, a weight switch's
    # UNAVAILABLE too. Before: that one refusal was retried for up to 660 s (here: until the 2 s
    # switch ended, then the run waited for results until --timeout).
    assert tok_buffer.core is not None
    entered = threading.Event()

    def slow_switch(version: int, source: str) -> int:
        entered.set()
        time.sleep(2.0)
        return 1

    t = threading.Thread(target=tok_buffer.core.update_weights, args=(1, "", slow_switch))
    t.start()
    assert entered.wait(5)
    try:
        proc = subprocess.run(["node", str(node_client), "--address", tok_buffer.address, "--batch-id", "node-0",
                               "--retry-seconds", "0", "--timeout", "8"],
                              cwd=node_client.parent, capture_output=True, text=True, timeout=30)
    finally:
        t.join(10)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1 and "retrying" not in out, out
    assert "error: 14 " in proc.stderr and "weight update to version 1" in proc.stderr, out
    assert not batch_submitted(tok_buffer.address, "node-0")
