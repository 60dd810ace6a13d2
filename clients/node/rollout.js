#!/usr/bin/env node
// Seer from a second language: submits a batch of prompt groups to the RolloutService (served by the
// buffer), streams every result as it finishes, checks each one, and prints a summary.
//
//   npm install && node rollout.js --address localhost:50051 [--groups 2] [--group-size 2] [--max-tokens 16]
//                                  [--retry-seconds 60] [--timeout 600]
//                                  [--keepalive-seconds 30] [--keepalive-timeout-seconds 10]
//
// A buffer restart (or a dropped connection) is survived the way the Python client does it: calls
// that fail UNAVAILABLE are retried with backoff, and the result stream is reopened from the cursor
// of the last result received (the stream is resumable by cursor), for at most --retry-seconds of
// failures since the last progress (the time from each failure until a stream is accepted again;
// time in an accepted stream does not count). SubmitBatch is idempotent by batch id, so retrying it
// is safe. --timeout bounds the whole run (every call and every reopened stream share one deadline).
//
// The protos are loaded at run time from protos/seer/v1 (the same files the Python code is generated
// from), so this client needs no code generation step. Exit code 0 = every response was received and
// well formed; the last line is `RESULT {json}`.
//
// A connection that goes silent under a stream (a partition, a lost NAT entry: no FIN, no RST) is
// noticed by keepalive pings: one every --keepalive-seconds, the connection dropped when one is not
// acknowledged in --keepalive-timeout-seconds; the stream then fails UNAVAILABLE and is reopened from
// its cursor like any other dropped stream.
//
// Ctrl-C (SIGINT) or SIGTERM cancels the submitted batch, as `seer rollout` does: the calls in flight
// are cancelled, then CancelBatch names this run's submission (a random submission token the
// submission carried), so only a batch this run stored is cancelled, also when the signal came
// before SubmitBatch's reply. The exit status is then 128 + the signal (130, 143). A second signal
// during the cancel ends the wait, saying that the batch may still be running.
'use strict';

const crypto = require('crypto');
const os = require('os');
const path = require('path');
const grpc = require('@grpc/grpc-js');
const protoLoader = require('@grpc/proto-loader');

const PROTO_ROOT = process.env.SEER_PROTO_ROOT || path.resolve(__dirname, '..', '..', 'protos');

// A number of seconds from the command line: Number(), not parseFloat(), so "10s" or "" is refused
// instead of read as 10 or NaN (a NaN deadline or retry window would silently disable the bound).
function seconds(key, value, { allowZero }) {
  const n = value.trim() === '' ? NaN : Number(value);
  if (!Number.isFinite(n) || n < 0 || (n === 0 && !allowZero)) {
    const what = allowZero ? 'a number of seconds >= 0' : 'a positive number of seconds';
    throw new Error(`${key}: must be ${what}, got ${JSON.stringify(value)}`);
  }
  return n;
}

// A count from the command line (--groups, --group-size, --max-tokens): a whole number >= 1, refused
// otherwise. parseInt read "abc" as NaN (a NaN --groups submitted an empty batch and then failed on
// "expected NaN" results, far from the option) and "2x" or "1.5" as 2 or 1.
function count(key, value) {
  const n = /^\s*\d+\s*$/.test(value) ? Number(value) : NaN;
  // int32 in the protos: a larger value would be encoded modulo 2^32 (4294967298 as 2).
  if (!Number.isSafeInteger(n) || n < 1 || n > 2147483647) {
    throw new Error(`${key}: must be a positive integer below 2^31, got ${JSON.stringify(value)}`);
  }
  return n;
}

function parseArgs(argv) {
  const opts = {
    address: 'localhost:50051', groups: 2, groupSize: 2, maxTokens: 16, timeout: 600, batchId: '', retrySeconds: 60,
    keepaliveSeconds: 30, keepaliveTimeoutSeconds: 10,
  };
  for (let i = 0; i < argv.length; i += 2) {
    const key = argv[i];
    const value = argv[i + 1];
    if (value === undefined) throw new Error(`${key}: missing value`);
    switch (key) {
      case '--address': opts.address = value; break;
      case '--groups': opts.groups = count(key, value); break;
      case '--group-size': opts.groupSize = count(key, value); break;
      case '--max-tokens': opts.maxTokens = count(key, value); break;
      case '--timeout': opts.timeout = seconds(key, value, { allowZero: false }); break;
      case '--batch-id': opts.batchId = value; break;
      // 0 is meaningful: no retries (the first transient failure is the answer).
      case '--retry-seconds': opts.retrySeconds = seconds(key, value, { allowZero: true }); break;
      case '--keepalive-seconds': opts.keepaliveSeconds = seconds(key, value, { allowZero: false }); break;
      case '--keepalive-timeout-seconds':
        opts.keepaliveTimeoutSeconds = seconds(key, value, { allowZero: false });
        break;
      default: throw new Error(`unknown option ${key}`);
    }
  }
  return opts;
}

function loadRolloutService() {
  const def = protoLoader.loadSync(path.join(PROTO_ROOT, 'seer', 'v1', 'rollout.proto'), {
    includeDirs: [PROTO_ROOT],
    keepCase: true, // field names exactly as in the .proto (snake_case)
    longs: Number, // uint64 cursors and int64 versions fit easily in a double here
    enums: String,
    defaults: true,
    oneofs: true,
  });
  return grpc.loadPackageDefinition(def).seer.v1.RolloutService;
}

const sleep = (ms) => new Promise((resolve) => { setTimeout(resolve, ms); });

// The calls in flight (unary calls and result streams), cancelled when a signal stops the run; and
// that signal's name. Without it, SIGINT or SIGTERM ended the process at once and the batch went on
// generating on the workers (nobody to read it) until it completed.
const inFlight = new Set();
let interrupted = null;

// A call is not started (a retry not waited out) once the run is interrupted.
function checkInterrupted() {
  if (interrupted !== null) {
    throw Object.assign(new Error(`interrupted (${interrupted})`), {
      code: grpc.status.CANCELLED, details: `interrupted (${interrupted})`,
    });
  }
}

const MAX_MESSAGE_BYTES = 64 * 1024 * 1024;
// Milliseconds for a timer option: at least 1, at most what setTimeout takes (a longer delay
// overflows and fires at once, which for keepalive would be a ping storm, not no pings).
const ms = (secs) => Math.min(2 ** 31 - 1, Math.max(1, Math.round(secs * 1000)));
// The channel options of the Python client (clients/python/seer_client/client.py _OPTIONS). A
// restarted buffer is back within a second or two; grpc-js' default reconnect backoff (1 s growing
// by 1.6x to 120 s) keeps failing calls fast with UNAVAILABLE long after it is back, so a longer
// outage used up --retry-seconds after the buffer had returned. grpc-js has no
// grpc.min_reconnect_backoff_ms (it ignores it): initial and max bound its backoff.
function channelOptions(keepaliveSeconds, keepaliveTimeoutSeconds) {
  return {
    'grpc.max_send_message_length': MAX_MESSAGE_BYTES,
    'grpc.max_receive_message_length': MAX_MESSAGE_BYTES,
    // A result stream sends nothing after its request: only a ping that goes unacknowledged tells
    // a cut connection (no FIN or RST) from a quiet generation. grpc-js pings every keepalive_time_ms
    // for as long as the connection lives (it has no max_pings_without_data limit, unlike gRPC core,
    // see the Python client) and drops the connection, failing its calls UNAVAILABLE, when a ping is
    // not acknowledged in keepalive_timeout_ms. The buffer accepts pings this often
    // (services/common/server.py). tests/client/test_node_client_keepalive.py partitions a stream.
    'grpc.keepalive_time_ms': ms(keepaliveSeconds),
    'grpc.keepalive_timeout_ms': ms(keepaliveTimeoutSeconds),
    'grpc.keepalive_permit_without_calls': 1,
    'grpc.initial_reconnect_backoff_ms': 100,
    'grpc.max_reconnect_backoff_ms': 1000,
  };
}

// A transport break, not an answer: UNAVAILABLE (the service is away, e.g. restarting), or the
// INTERNAL that grpc-js reports when the server's HTTP/2 session ends under a stream ("Received
// RST_STREAM with code 2 triggered by internal client error: Session closed with error code 2", seen
// when the buffer stops; grpc/grpc-node#2672). An INTERNAL of the service itself names an exception
// ("ExceptionType: message") and is the answer.
function transient(err) {
  return err.code === grpc.status.UNAVAILABLE
    || (err.code === grpc.status.INTERNAL && /RST_STREAM|Session closed/.test(err.details || ''));
}

// The buffer refuses SubmitBatch during a weight switch with UNAVAILABLE and this trailing metadata.
// A switch may take the buffer's switch timeout (600 s), so such a refusal is waited out up to the
// Python client's UPDATE_WEIGHTS_TIMEOUT (and the run's --timeout), not given up after --retry-seconds
// (unless that is 0: no retries).
const SWITCH_WINDOW_MS = 660 * 1000;
function switching(err) {
  const reason = err.metadata && typeof err.metadata.get === 'function' ? err.metadata.get('seer-retry-reason') : [];
  return err.code === grpc.status.UNAVAILABLE && reason.length > 0 && String(reason[0]) === 'weight-switch';
}

// Retries while the transient failures add up to less than retrySeconds; any other status is the
// answer. backoff: 50 ms doubling to 2 s. The window (as in the Python client's iter_results) is the
// time spent failing since the last progress: the closed spells (`downMs`, each from its first
// failure until a stream was accepted again) plus the spell in progress. Time in an accepted stream
// does not count, so a quiet generation between two restarts does not use the window up; only
// progress (a result) resets it, so a buffer that accepts every stream and then fails it still ends
// the run instead of being retried forever.
class Retry {
  constructor(retrySeconds, endMs) {
    this.windowMs = retrySeconds * 1000;
    this.endMs = endMs;
    this.reset();
  }

  reset() {
    this.downMs = 0;
    this.failingSince = null;
    this.delayMs = 50;
  }

  // A stream was accepted: the failing spell (if any) ends here. The backoff is not reset (no
  // progress yet), as in the Python client.
  accepted() {
    if (this.failingSince !== null) {
      this.downMs += Date.now() - this.failingSince;
      this.failingSince = null;
    }
  }

  // refused: RESOURCE_EXHAUSTED before the stream was accepted is the buffer's stream limit (a
  // transient state, retried like UNAVAILABLE); after, it is a message over the size limit, which a
  // retry would only repeat.
  async wait(err, refused = false) {
    checkInterrupted();
    if (!transient(err) && !(refused && err.code === grpc.status.RESOURCE_EXHAUSTED)) throw err;
    const now = Date.now();
    if (this.failingSince === null) this.failingSince = now;
    // --retry-seconds 0 is no retries at all: a weight switch's refusal is final too (it used to be
    // waited out for up to 660 s, the one retry that 0 did not turn off).
    const windowMs = switching(err) && this.windowMs > 0 ? Math.max(this.windowMs, SWITCH_WINDOW_MS) : this.windowMs;
    if (this.downMs + (now - this.failingSince) + this.delayMs > windowMs) throw err;
    console.error(`retrying after ${err.code} ${err.details} (${this.delayMs} ms)`);
    // Not past the run's deadline: the next call then fails DEADLINE_EXCEEDED at once.
    await sleep(Math.max(0, Math.min(this.delayMs, this.endMs - now)));
    checkInterrupted();
    this.delayMs = Math.min(this.delayMs * 2, 2000);
  }
}

// endMs: the run's one deadline (Date.now() ms), shared by every call and every reopened stream.
async function unary(client, method, request, endMs, retrySeconds) {
  const retry = new Retry(retrySeconds, endMs);
  for (;;) {
    checkInterrupted();
    try {
      return await new Promise((resolve, reject) => {
        const c = client[method](request, { deadline: new Date(endMs) }, (err, reply) => {
          inFlight.delete(c);
          if (err) reject(err); else resolve(reply);
        });
        inFlight.add(c);
      });
    } catch (err) {
      await retry.wait(err);
    }
  }
}

// Every result of the batch from `cursor` on, in completion order; onResult(msg) for each. A stream
// that fails UNAVAILABLE is reopened from the cursor of the last result received. Its deadline is the
// run's (endMs), not a fresh one per stream: with a per-stream deadline every reopened stream got a
// new --timeout, so a run that kept reconnecting was never bounded by it. submissionId: the one
// SubmitBatch answered (0 = the first result's), passed with every cursor: a batch id deleted by
// retention and submitted again in between is FAILED_PRECONDITION naming submission_id, not a resume
// into the other submission's results.
async function streamResults(client, batchId, endMs, retrySeconds, onResult, submissionId = 0) {
  const retry = new Retry(retrySeconds, endMs);
  let cursor = 0;
  let submission = submissionId;
  for (;;) {
    // The buffer sends headers as soon as it accepts a stream; a refused or failed call ends
    // without them (grpc-js emits 'metadata' only for real headers, not for a trailers-only answer).
    let accepted = false;
    checkInterrupted();
    try {
      await new Promise((resolve, reject) => {
        const stream = client.StreamResults({ batch_id: batchId, cursor, submission_id: submission },
          { deadline: new Date(endMs) });
        inFlight.add(stream);
        stream.on('metadata', () => {
          accepted = true;
          retry.accepted();
        });
        stream.on('data', (msg) => {
          cursor = msg.cursor;
          if (!submission) submission = msg.submission_id; // 0 from a buffer without submission ids
          retry.reset(); // progress: the retry window starts again
          onResult(msg);
        });
        stream.on('error', (err) => { inFlight.delete(stream); reject(err); });
        stream.on('end', () => { inFlight.delete(stream); resolve(); });
      });
      return;
    } catch (err) {
      await retry.wait(err, !accepted);
    }
  }
}

// A mix of the two prompt forms the API accepts: text (tokenized by the buffer) and token ids.
function makeGroups(n, groupSize, maxTokens) {
  const texts = ['The capital of France is', 'Write a haiku about the sea.', 'def fibonacci(n):', '1, 2, 3, 5, 8,'];
  const groups = [];
  for (let g = 0; g < n; g++) {
    const group = {
      prompt_key: `node-example-${g}`,
      group_size: groupSize,
      max_tokens: maxTokens,
      sampling: { temperature: g % 2 === 0 ? 0.8 : 0.0, top_p: 0.95, top_k: 0, seed: 1234 + g },
      labels: { source: 'node', group: String(g) },
    };
    if (g % 2 === 0) group.prompt_text = texts[g % texts.length];
    else group.prompt_token_ids = [504, 3575, 282, 4649, 314]; // SmolLM2 vocabulary ids
    groups.push(group);
  }
  return groups;
}

function checkResult(result, groupsById, seen) {
  const problems = [];
  const group = groupsById[result.group_index];
  if (!group) problems.push(`group_index ${result.group_index} out of range`);
  if (seen.has(result.request_id)) problems.push(`duplicate request_id ${result.request_id}`);
  if (result.token_ids.length === 0) problems.push('no tokens');
  if (result.logprobs.length !== result.token_ids.length) {
    problems.push(`${result.logprobs.length} logprobs for ${result.token_ids.length} tokens`);
  }
  if (result.logprobs.some((lp) => !(lp <= 1e-4) || Number.isNaN(lp))) problems.push('a logprob > 0 or NaN');
  if (group && result.token_ids.length > group.max_tokens) problems.push('more tokens than max_tokens');
  if (!['FINISH_REASON_STOP', 'FINISH_REASON_LENGTH'].includes(result.finish_reason)) {
    problems.push(`finish_reason ${result.finish_reason}`);
  }
  if (result.finish_reason === 'FINISH_REASON_LENGTH' && group && result.token_ids.length !== group.max_tokens) {
    problems.push('LENGTH before max_tokens');
  }
  if (group && result.labels.group !== group.labels.group) problems.push('labels not echoed');
  return problems.map((p) => `${result.request_id}: ${p}`);
}

let runEndMs = null; // for the error message: whether a DEADLINE_EXCEEDED is --timeout running out

const CANCEL_DEADLINE_MS = 5000;

// Best-effort CancelBatch of this run's submission (the one that carried `token`), on a fresh client
// with a short deadline (the run's client may be the broken part, and a user who pressed Ctrl-C
// should not wait minutes for a buffer that is down); returns what happened, for the line that says
// so. The buffer's answer naming submission_token is final: NOT_FOUND = this submission was not
// stored (and is refused from then on), FAILED_PRECONDITION = the id names another run's batch.
async function cancelSubmission(RolloutService, opts, batchId, token) {
  const client = new RolloutService(opts.address, grpc.credentials.createInsecure(),
    channelOptions(opts.keepaliveSeconds, opts.keepaliveTimeoutSeconds));
  try {
    const reply = await new Promise((resolve, reject) => {
      client.CancelBatch({ batch_id: batchId, submission_token: token },
        { deadline: new Date(Date.now() + CANCEL_DEADLINE_MS) }, (err, r) => (err ? reject(err) : resolve(r)));
    });
    return `cancelled it (${reply.num_cancelled} unfinished responses)`;
  } catch (err) {
    const aboutToken = /^submission_token:/.test(err.details || '');
    if (aboutToken && err.code === grpc.status.NOT_FOUND) {
      return 'nothing to cancel: this run\'s submission was not stored, and the buffer refuses it from now on';
    }
    if (aboutToken && err.code === grpc.status.FAILED_PRECONDITION) {
      return 'not cancelled: the batch id names another submission than this run\'s (another run\'s batch, left running)';
    }
    return `cancelling it failed: ${err.code} ${err.details || err.message}`;
  } finally {
    client.close();
  }
}

async function main() {
  const opts = parseArgs(process.argv.slice(2));
  const RolloutService = loadRolloutService();
  const client = new RolloutService(opts.address, grpc.credentials.createInsecure(),
    channelOptions(opts.keepaliveSeconds, opts.keepaliveTimeoutSeconds));
  const batchId = opts.batchId || `node-${Date.now()}`;
  // Names this run's submission to CancelBatch (SubmitBatchRequest.submission_token).
  const token = crypto.randomBytes(16).toString('hex');
  let submitting = false; // a SubmitBatch was sent: the batch may be stored
  let cancelling = false;
  const onSignal = (sig) => {
    if (cancelling) {
      console.error(`cancelling batch ${batchId} was interrupted: it may still be running`);
      process.exit(128 + os.constants.signals[sig]);
    }
    if (interrupted === null) interrupted = sig;
    for (const c of inFlight) c.cancel(); // each fails CANCELLED, which ends the run below
  };
  process.on('SIGINT', onSignal);
  process.on('SIGTERM', onSignal);
  try {
    await run(opts, client, batchId, token, () => { submitting = true; });
  } catch (err) {
    if (interrupted === null) throw err;
    client.close();
    if (submitting) {
      cancelling = true;
      console.error(`batch ${batchId}: ${await cancelSubmission(RolloutService, opts, batchId, token)}`);
    }
    console.error(`interrupted (${interrupted})`);
    console.log(`RESULT ${JSON.stringify({ client: 'node', ok: false, error: `interrupted (${interrupted})` })}`);
    process.exitCode = 128 + os.constants.signals[interrupted];
  } finally {
    process.removeListener('SIGINT', onSignal);
    process.removeListener('SIGTERM', onSignal);
  }
}

async function run(opts, client, batchId, token, onSubmitting) {
  // One deadline for the whole run, computed once (like the Python client's iter_results timeout).
  const endMs = Date.now() + opts.timeout * 1000;
  runEndMs = endMs;
  const call = (method, request) => unary(client, method, request, endMs, opts.retrySeconds);
  const groups = makeGroups(opts.groups, opts.groupSize, opts.maxTokens);
  const start = Date.now();

  onSubmitting();
  const submitted = await call('SubmitBatch', { batch_id: batchId, groups, submission_token: token });
  const expected = opts.groups * opts.groupSize;
  if (submitted.num_requests !== expected) {
    throw new Error(`SubmitBatch: num_requests ${submitted.num_requests}, expected ${expected}`);
  }
  // Idempotent by batch id: the same batch again creates nothing.
  const again = await call('SubmitBatch', { batch_id: batchId, groups, submission_token: token });
  if (!again.already_submitted) throw new Error('SubmitBatch: resubmission was not recognized');
  if (again.submission_id !== submitted.submission_id) {
    throw new Error(`SubmitBatch: resubmission named submission ${again.submission_id}, not ${submitted.submission_id}`);
  }

  const seen = new Set();
  const problems = [];
  let tokens = 0;
  let firstResultSeconds = null;
  await streamResults(client, batchId, endMs, opts.retrySeconds, (msg) => {
    const r = msg.result;
    if (firstResultSeconds === null) firstResultSeconds = (Date.now() - start) / 1000;
    problems.push(...checkResult(r, groups, seen));
    seen.add(r.request_id);
    tokens += r.token_ids.length;
    const text = (r.text || '').replace(/\s+/g, ' ').slice(0, 60);
    console.log(`result ${msg.cursor}/${expected} group ${r.group_index} sample ${r.sample_index}: `
      + `${r.token_ids.length} tokens, ${r.finish_reason}, v${r.policy_version} ${JSON.stringify(text)}`);
  }, submitted.submission_id);
  if (seen.size !== expected) problems.push(`stream ended after ${seen.size} of ${expected} results`);

  const batch = await call('GetBatch', { batch_id: batchId, include_requests: false });
  if (batch.state !== 'BATCH_STATE_COMPLETED') problems.push(`GetBatch: state ${batch.state}`);
  if (batch.num_finished !== expected) problems.push(`GetBatch: num_finished ${batch.num_finished}`);

  // Bad input gets INVALID_ARGUMENT naming the field; the service keeps serving.
  try {
    await call('SubmitBatch', { batch_id: `${batchId}-bad`, groups: [{ ...groups[0], group_size: 0 }] });
    problems.push('SubmitBatch with group_size 0 was accepted');
  } catch (err) {
    if (err.code !== grpc.status.INVALID_ARGUMENT || !/group_size/.test(err.details)) {
      problems.push(`bad input: ${err.code} ${err.details}`);
    }
  }
  client.close();

  const summary = {
    client: 'node', batch_id: batchId, responses: seen.size, tokens,
    first_result_s: firstResultSeconds, seconds: (Date.now() - start) / 1000, ok: problems.length === 0,
  };
  for (const p of problems) console.error(`PROBLEM ${p}`);
  console.log(`RESULT ${JSON.stringify(summary)}`);
  process.exitCode = problems.length === 0 ? 0 : 1;
}

main().catch((err) => {
  if (err.code === grpc.status.DEADLINE_EXCEEDED && runEndMs !== null && Date.now() >= runEndMs) {
    err.details = `--timeout ran out (one deadline for the whole run): ${err.details || err.message}`;
  }
  console.error(`error: ${err.code !== undefined ? `${err.code} ` : ''}${err.details || err.message}`);
  console.log(`RESULT ${JSON.stringify({ client: 'node', ok: false, error: String(err.details || err.message) })}`);
  process.exitCode = 1;
});
