"""rollout() of the Node.js client (clients/node/rollout.js) as a trainer uses it, against a real
buffer (real gRPC, RocksDB; the test commits results as the scheduler would, so no model runs): a
caller can cancel it (AbortSignal, its own submission token, returned), an async onResult is awaited
and its failure cancels the batch, the default has no timeout and a timeout leaves the batch to be
collected (as SeerClient.run_batch), camelCase group fields are refused naming them, a batch
cancelled by someone else rejects, and the small things a review found (batch ids, left-out
results, retry lines, stats)."""

from __future__ import annotations

import json
import re
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from client_helpers import Buffer, _free_port, batch_submitted, finish_request, play_scheduler
from seer_client import SeerClient
from test_node_client_api import _commit

from services.common import server as common_server

# A library user: `body` is an expression of a promise (rollout(...) with ADDR, B = batch id, G =
# one group of two samples); its outcome is the last line, DONE {summary} or FAILED {error fields}.
HARNESS = """
const {{ rollout, loadRolloutService, toResult }} = require({script});
const ADDR = {address};
const B = {batch_id};
const G = [{{ prompt_key: 'k', prompt_token_ids: [1, 2, 3], group_size: 2, max_tokens: 8,
             sampling: {{ temperature: 1.0, seed: 7 }} }}];
const sleep = (ms) => new Promise((r) => setTimeout(r, ms));
Promise.resolve().then(() => {body})
  .then((s) => console.log(`DONE ${{JSON.stringify({{ ...s, results: s.results && s.results.length }})}}`))
  .catch((e) => console.log(`FAILED ${{JSON.stringify({{
    code: e.code, message: e.details || e.message, field: e.field, cancel: e.cancel, batchId: e.batchId,
    submissionToken: e.submissionToken, leftOut: e.leftOut, timedOut: e.timedOut, incomplete: e.incomplete,
    aborted: e.aborted, responses: e.responses, fromCallback: e.fromCallback }})}}`));
"""


def _start(node_client: Path, tmp_path: Path, address: str, batch_id: str, body: str) -> subprocess.Popen[str]:
    user = tmp_path / f"user-{batch_id}.js"
    user.write_text(HARNESS.format(script=json.dumps(str(node_client)), address=json.dumps(address),
                                   batch_id=json.dumps(batch_id), body=body))
    return subprocess.Popen(["node", str(user)], cwd=node_client.parent, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def _outcome(proc: subprocess.Popen[str], timeout: float = 30) -> tuple[str, dict[str, Any], str, str]:
    """(DONE|FAILED, its fields, stdout, stderr); the process must exit 0 (no unhandled rejection)."""
    out, err = proc.communicate(timeout=timeout)
    lines = out.splitlines()
    assert proc.returncode == 0 and lines and lines[-1].startswith(("DONE ", "FAILED ")), (out, err)
    kind, _, fields = lines[-1].partition(" ")
    return kind, json.loads(fields), out, err


def _wait_submitted(address: str, batch_id: str, proc: subprocess.Popen[str]) -> None:
    deadline = time.monotonic() + 30
    while not batch_submitted(address, batch_id):
        assert time.monotonic() < deadline and proc.poll() is None, proc.communicate() if proc.poll() else ""
        time.sleep(0.1)


def _batch(address: str, batch_id: str) -> tuple[str, int, int]:
    with SeerClient(address) as c:
        b = c.get_batch(batch_id)
    return b.state, b.num_finished, b.num_cancelled


def test_an_abort_signal_cancels_the_calls_own_submission(node_client: Path, tok_buffer: Buffer,
                                                          tmp_path: Path) -> None:
    """Before: no way to stop a library rollout (no signal, the token neither taken nor returned):
    the option was ignored and the call waited for the whole batch."""
    body = """(() => { const ac = new AbortController();
      return rollout({ address: ADDR, batchId: B, groups: G, signal: ac.signal, submissionToken: 'tok-1' },
                     () => { setTimeout(() => ac.abort(new Error('trainer stopping')), 50); }); })()"""
    proc = _start(node_client, tmp_path, tok_buffer.address, "lib-abort", body)
    _wait_submitted(tok_buffer.address, "lib-abort", proc)
    finish_request(tok_buffer.address, "lib-abort/0/0")
    kind, f, _, _ = _outcome(proc)
    assert kind == "FAILED" and f["code"] == 1 and f["aborted"] and "trainer stopping" in f["message"], f
    assert f["cancel"] == "cancelled it (1 unfinished responses)" and f["submissionToken"] == "tok-1", f
    assert _batch(tok_buffer.address, "lib-abort") == ("cancelled", 1, 1)


def test_the_summary_returns_the_submission_token_and_a_collision_free_batch_id(
        node_client: Path, tok_buffer: Buffer, tmp_path: Path) -> None:
    """Before: the token was made inside and never returned; the default id was node-<ms> alone (two
    processes starting in the same millisecond shared a batch); timeout null was refused."""
    stop = threading.Event()
    scheduler = threading.Thread(target=play_scheduler, args=(tok_buffer.address,), kwargs={"stop": stop},
                                 daemon=True)
    scheduler.start()
    try:
        kind, f, _, _ = _outcome(_start(node_client, tmp_path, tok_buffer.address, "unused",
                                        "rollout({ address: ADDR, groups: G, timeout: null })"))
    finally:
        stop.set()
        scheduler.join(10)
    assert kind == "DONE" and f["responses"] == 2 and re.fullmatch(r"node-\d+-[0-9a-f]{12}", f["batch_id"]), f
    assert re.fullmatch(r"[0-9a-f]{32}", f["submission_token"]), f
    # An already aborted signal rejects before any call, naming the submission it did not make.
    kind, f, _, _ = _outcome(_start(node_client, tmp_path, tok_buffer.address, "tok",
                                    "rollout({ address: ADDR, batchId: B, groups: G, signal: AbortSignal.abort() })"))
    assert kind == "FAILED" and f["code"] == 1 and f["batchId"] == "tok" and len(f["submissionToken"]) == 32, f
    assert not batch_submitted(tok_buffer.address, "tok")
    # An empty token is a fresh one, as run_batch's submission_token="" (it was refused).
    kind, f, _, _ = _outcome(_start(node_client, tmp_path, tok_buffer.address, "tok2",
                                    "rollout({ address: ADDR, batchId: B, groups: G, submissionToken: '',"
                                    " signal: AbortSignal.abort() })"))
    assert kind == "FAILED" and f["code"] == 1 and len(f["submissionToken"]) == 32, f


def test_an_async_on_result_is_awaited_and_its_rejection_cancels_the_batch(
        node_client: Path, tok_buffer: Buffer, tmp_path: Path) -> None:
    """Before: a rejected promise from onResult was an unhandled rejection (the process crashed,
    exit 1) and the batch went on running; results were handed over while the previous callback
    was still awaiting."""
    body = """(async () => { let active = 0; let overlap = false; const seen = [];
      try {
        await rollout({ address: ADDR, batchId: B, groups: G }, async (r) => {
          active += 1; overlap = overlap || active > 1; await sleep(300); seen.push(r.cursor); active -= 1;
          if (seen.length === 2) throw new Error('trainer queue full');
        });
      } catch (e) { e.details = `${e.message} seen=${seen} overlap=${overlap}`; throw e; }
    })()"""
    groups = "[{ prompt_key: 'k', prompt_token_ids: [1, 2, 3], group_size: 3, max_tokens: 8 }]"
    proc = _start(node_client, tmp_path, tok_buffer.address, "lib-async",
                  body.replace("groups: G", f"groups: {groups}"))
    _wait_submitted(tok_buffer.address, "lib-async", proc)
    finish_request(tok_buffer.address, "lib-async/0/0")
    finish_request(tok_buffer.address, "lib-async/0/1")
    kind, f, _, err = _outcome(proc)
    assert kind == "FAILED" and f["fromCallback"], (f, err)
    assert f["message"] == "trainer queue full seen=1,2 overlap=false", f
    assert f["cancel"] == "cancelled it (1 unfinished responses)", f
    assert _batch(tok_buffer.address, "lib-async") == ("cancelled", 2, 1)


def test_on_result_throwing_on_the_last_result_says_the_batch_completed(
        node_client: Path, tok_buffer: Buffer, tmp_path: Path) -> None:
    """The batch is complete when onResult throws on its last result: the buffer answers the cancel
    (COMPLETED, 0) and changes nothing. Before, e.cancel said "cancelled it (0 unfinished
    responses)" of a completed batch."""
    body = """(async () => { let n = 0;
      await rollout({ address: ADDR, batchId: B, groups: G }, () => { n += 1; if (n === 2) throw new Error('last'); });
    })()"""
    proc = _start(node_client, tmp_path, tok_buffer.address, "lib-last", body)
    _wait_submitted(tok_buffer.address, "lib-last", proc)
    finish_request(tok_buffer.address, "lib-last/0/0")
    finish_request(tok_buffer.address, "lib-last/0/1")
    kind, f, _, err = _outcome(proc)
    assert kind == "FAILED" and f["fromCallback"], (f, err)
    assert f["cancel"] == "nothing to cancel: the batch had completed", f
    assert _batch(tok_buffer.address, "lib-last")[0] == "completed"


def test_a_library_timeout_leaves_the_batch_to_be_collected_unless_cancel_on_timeout(
        node_client: Path, tok_buffer: Buffer, tmp_path: Path) -> None:
    """As SeerClient.run_batch: a timeout stops the wait, not the batch; calling again with the same
    batch id and submission token collects every result. Before: the batch was cancelled (also after
    the library's default 600 s), and Infinity (no timeout) was refused."""
    body = """rollout({ address: ADDR, batchId: B, groups: G, timeout: 1.5, submissionToken: 'tok-to' })"""
    proc = _start(node_client, tmp_path, tok_buffer.address, "lib-to", body)
    kind, f, _, _ = _outcome(proc)
    assert kind == "FAILED" and f["code"] == 4 and f["timedOut"] and f["cancel"].startswith("left running"), f
    assert _batch(tok_buffer.address, "lib-to") == ("running", 0, 0)
    again = _start(node_client, tmp_path, tok_buffer.address, "lib-to",
                   "rollout({ address: ADDR, batchId: B, groups: G, timeout: Infinity, submissionToken: 'tok-to' })")
    finish_request(tok_buffer.address, "lib-to/0/0")
    finish_request(tok_buffer.address, "lib-to/0/1")
    kind, f, _, _ = _outcome(again)
    assert kind == "DONE" and f["responses"] == 2 and f["already_submitted"] and f["submission_token"] == "tok-to", f

    body = "rollout({ address: ADDR, batchId: B, groups: G, timeout: 1.5, cancelOnTimeout: true })"
    kind, f, _, _ = _outcome(_start(node_client, tmp_path, tok_buffer.address, "lib-to-cancel", body))
    assert kind == "FAILED" and f["code"] == 4 and f["cancel"] == "cancelled it (2 unfinished responses)", f
    assert _batch(tok_buffer.address, "lib-to-cancel")[0] == "cancelled"


def test_a_library_timeout_says_what_it_knows_and_keeps_the_results(
        node_client: Path, tok_buffer: Buffer, tmp_path: Path) -> None:
    """No worker serves the batch (none registered; one of its two requests finished by hand): the
    timeout said only "Deadline exceeded". Now it names the counts and how long no result came (as
    SeerClient.run_batch's SeerTimeout), err.numRequests the batch's size, err.results the one
    result received (the batch is left running)."""
    body = """rollout({ address: ADDR, batchId: B, groups: G, timeout: 2.5 }).then(
      () => ({ resolved: true }),
      (e) => ({ code: e.code, timedOut: e.timedOut, message: e.details, numRequests: e.numRequests,
                responses: e.responses, ids: e.results.map((r) => r.request_id), cancel: e.cancel }))"""
    proc = _start(node_client, tmp_path, tok_buffer.address, "lib-dead", body)
    _wait_submitted(tok_buffer.address, "lib-dead", proc)
    finish_request(tok_buffer.address, "lib-dead/0/0")
    kind, f, _, _ = _outcome(proc)
    assert kind == "DONE" and f["code"] == 4 and f["timedOut"], f
    assert f["ids"] == ["lib-dead/0/0"] and f["numRequests"] == 2 and f["responses"] == 1, f
    assert "1 of 2 results received, 1 missing; no new result for" in f["message"], f
    quiet = float(re.search(r"no new result for ([0-9.]+) s", f["message"]).group(1))  # type: ignore[union-attr]
    assert 0.5 <= quiet <= 2.6, f
    assert f["cancel"].startswith("left running"), f
    assert _batch(tok_buffer.address, "lib-dead") == ("running", 1, 0)


def test_the_cli_timeout_says_what_it_knows(node_client: Path, tok_buffer: Buffer) -> None:
    """The CLI's --timeout line: before, "--timeout ran out (...): Deadline exceeded ..." only."""
    proc = subprocess.Popen(["node", str(node_client), "--address", tok_buffer.address, "--batch-id", "cli-dead",
                             "--timeout", "3"], cwd=node_client.parent, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    _wait_submitted(tok_buffer.address, "cli-dead", proc)
    finish_request(tok_buffer.address, "cli-dead/0/0")
    out, err = proc.communicate(timeout=30)
    assert proc.returncode == 1, (out, err)
    assert "--timeout ran out" in err and "1 of 4 results received, 3 missing; no new result for" in err, err


@pytest.mark.parametrize("group, field, hint", [
    ("{ ...G[0], sampling: { temperature: 1.0, topP: 0.5 } }", "groups[0].sampling.topP", "did you mean top_p?"),
    ("{ ...G[0], sampling: { ignoreEos: true } }", "groups[0].sampling.ignoreEos", "did you mean ignore_eos?"),
    ("{ ...G[0], maxTokens: 4 }", "groups[0].maxTokens", "did you mean max_tokens?"),
    ("{ ...G[0], prompt: 'x' }", "groups[0].prompt", "PromptGroup has prompt_key"),
])
def test_unknown_group_fields_are_refused_naming_them(node_client: Path, tmp_path: Path, group: str, field: str,
                                                      hint: str) -> None:
    """Before: protobufjs (keepCase) dropped camelCase keys silently: topP was sent as nothing and
    the group sampled with top_p 1. Refused before any call (nothing listens on the address)."""
    proc = _start(node_client, tmp_path, f"127.0.0.1:{_free_port()}", "bad",
                  f"rollout({{ address: ADDR, batchId: B, groups: [{group}], retrySeconds: 0 }})")
    kind, f, _, _ = _outcome(proc)
    assert kind == "FAILED" and f["field"] == field and f"{field}: unknown field" in f["message"], f
    assert hint in f["message"], f


def test_a_batch_cancelled_by_someone_else_rejects(node_client: Path, tok_buffer: Buffer, tmp_path: Path) -> None:
    """Before: the stream ended OK and rollout() resolved as a success with 1 of 2 responses."""
    proc = _start(node_client, tmp_path, tok_buffer.address, "lib-other",
                  "rollout({ address: ADDR, batchId: B, groups: G })")
    _wait_submitted(tok_buffer.address, "lib-other", proc)
    finish_request(tok_buffer.address, "lib-other/0/0")
    time.sleep(0.3)
    with SeerClient(tok_buffer.address) as c:
        c.cancel_batch("lib-other")
    kind, f, _, _ = _outcome(proc)
    assert kind == "FAILED" and f["code"] == 10 and f["incomplete"] and f["responses"] == 1, f
    assert "ended after 1 of 2 results" in f["message"] and f.get("cancel") is None, f


def test_a_left_out_result_is_named_with_left_out_and_not_cancelled(
        node_client: Path, tok_buffer: Buffer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The stream that skipped the result ends RESOURCE_EXHAUSTED (the buffer's status). Before:
    err.leftOut was set only when a resumed stream ended OK, and the complete batch was "cancelled"
    (0 unfinished responses) after it."""
    tok_buffer.stop()
    monkeypatch.setattr(common_server, "MAX_MESSAGE_BYTES", 4096)  # read when the server starts
    tok_buffer.start()
    groups = "[{ prompt_key: 'k', prompt_token_ids: [1, 2, 3], group_size: 2, max_tokens: 2000 }]"
    proc = _start(node_client, tmp_path, tok_buffer.address, "lib-lo",
                  f"rollout({{ address: ADDR, batchId: B, groups: {groups} }})")
    _wait_submitted(tok_buffer.address, "lib-lo", proc)
    for seq in range(8):  # the first result (named by cursor 0): 2000 tokens, over the limit
        _commit(tok_buffer.address, "lib-lo/0/0", seq, [4 + (i % 14) for i in range(250)], last=seq == 7)
    finish_request(tok_buffer.address, "lib-lo/0/1")
    kind, f, _, _ = _outcome(proc)
    assert kind == "FAILED" and f["code"] == 8 and f["leftOut"] == ["0"], f
    assert f.get("cancel") is None, f


def test_retry_lines_go_to_the_log_callback_not_stderr(node_client: Path, tok_buffer: Buffer, tmp_path: Path) -> None:
    """Before: the library printed `retrying after ...` on stderr (a trainer's own output)."""
    tok_buffer.stop()
    body = """(async () => { const lines = [];
      const s = await rollout({ address: ADDR, batchId: B, groups: G, log: (l) => lines.push(l) });
      return { ...s, logged: lines.length > 0 && lines.every((l) => l.startsWith('retrying after 14')) }; })()"""
    silent = _start(node_client, tmp_path, tok_buffer.address, "lib-log-silent",
                    "rollout({ address: ADDR, batchId: B, groups: G })")
    logged = _start(node_client, tmp_path, tok_buffer.address, "lib-log", body)
    time.sleep(1.0)  # both retry SubmitBatch meanwhile
    tok_buffer.start()
    for b in ("lib-log-silent", "lib-log"):
        _wait_submitted(tok_buffer.address, b, silent if b == "lib-log-silent" else logged)
        finish_request(tok_buffer.address, f"{b}/0/0")
        finish_request(tok_buffer.address, f"{b}/0/1")
    kind, f, _, err = _outcome(silent)
    assert kind == "DONE" and err == "", err
    kind, f, _, err = _outcome(logged)
    assert kind == "DONE" and f["logged"] and err == "", (f, err)


def test_protos_are_parsed_once_and_stats_have_every_field(node_client: Path, tmp_path: Path) -> None:
    """Before: every call re-read and re-parsed the .proto files; a result without stats had {}
    where the Python client has every ChunkStats field at 0."""
    body = """(async () => {
      const same = loadRolloutService() === loadRolloutService();
      const r = toResult({ cursor: '1', submission_id: '1', result: { token_ids: [], logprobs: [], stats: null } });
      const s = toResult({ cursor: '1', submission_id: '1', result: { stats: { steps: 3 } } });
      return { same, stats: r.stats, steps: s.stats.steps, wall: s.stats.wall_seconds }; })()"""
    kind, f, _, _ = _outcome(_start(node_client, tmp_path, "unused", "unused", body))
    assert kind == "DONE" and f["same"] and f["steps"] == 3 and f["wall"] == 0, f
    assert f["stats"] == dict.fromkeys(["prefill_tokens", "cached_tokens", "kv_loaded_tokens", "draft_tokens",
                                        "accepted_tokens", "steps", "wall_seconds", "kv_recomputed_pages"], 0), f
