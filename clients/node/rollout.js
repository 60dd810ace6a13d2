#!/usr/bin/env node
// Seer from a second language: submits a batch of prompt groups to the RolloutService (served by the
// buffer), streams every result as it finishes, checks each one, and prints a summary.
//
//   npm install && node rollout.js --address localhost:50051 [--groups 2] [--group-size 2] [--max-tokens 16]
//                                  [--seed 1234] [--output FILE|-] [--retry-seconds 60] [--timeout 600]
//                                  [--keepalive-seconds 30] [--keepalive-timeout-seconds 10]
//
// --output writes every result as one JSON line (the Python client's RolloutResult fields; `-` =
// stdout, the human-readable lines then go to stderr). Required as a library (require('./rollout')),
// it runs nothing: rollout({address, groups, batchId, ...}, onResult) submits a batch and streams
// its results (see rollout() below). The library differs from the CLI where a trainer needs it to:
// no timeout by default and a timeout that leaves the batch running (as SeerClient.run_batch), an
// AbortSignal instead of SIGINT, retry lines to an optional log callback instead of stderr.
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
// A --timeout that runs out, or a result stream that fails for good, cancels the submitted batch the
// same way (nobody will read the rest): a line on stderr says what happened to it.
//
// 64-bit fields (seeds, cursors, submission ids, policy versions) are decimal strings here, never
// Numbers: a double holds integers exactly only up to 2^53, so a larger seed was sent as another one.
//
// Ctrl-C (SIGINT) or SIGTERM cancels the submitted batch, as `seer rollout` does: the calls in flight
// are cancelled, then CancelBatch names this run's submission (a random submission token the
// submission carried), so only a batch this run stored is cancelled, also when the signal came
// before SubmitBatch's reply. The exit status is then 128 + the signal (130, 143). A second signal
// during the cancel ends the wait, saying that the batch may still be running.
'use strict';

const crypto = require('crypto');
const fs = require('fs');
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

const UINT64_MAX = 2n ** 64n - 1n;

// A uint64 (a seed) as its decimal string, refused (naming `field`) outside [0, max]: a BigInt, a
// string of digits, or a Number that is a safe integer. A Number above 2^53 has lost its value
// already (9007199254740993 reads as ...992), so it is refused rather than sent as another seed.
function uint64(field, value, max = UINT64_MAX) {
  let n = null;
  if (typeof value === 'bigint') n = value;
  else if (typeof value === 'string' && /^\s*\d+\s*$/.test(value)) n = BigInt(value.trim());
  else if (typeof value === 'number' && Number.isSafeInteger(value)) n = BigInt(value);
  if (n === null || n < 0n || n > max) {
    const more = typeof value === 'number' && Number.isInteger(value) && !Number.isSafeInteger(value)
      ? ' (a Number above 2^53 is not exact: pass a string or a BigInt)' : '';
    const shown = typeof value === 'bigint' ? `${value}n` : JSON.stringify(value);
    throw Object.assign(new Error(`${field}: must be an integer in [0, ${max}]${more}, got ${shown}`),
      { field });
  }
  return n.toString();
}

function parseArgs(argv) {
  const opts = {
    address: 'localhost:50051', groups: 2, groupSize: 2, maxTokens: 16, timeout: 600, batchId: '', retrySeconds: 60,
    keepaliveSeconds: 30, keepaliveTimeoutSeconds: 10, seed: '1234', output: null,
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
      // Checked below, once --groups is known (group g uses seed + g).
      case '--seed': opts.seed = value; break;
      case '--output': opts.output = value; break;
      // 0 is meaningful: no retries (the first transient failure is the answer).
      case '--retry-seconds': opts.retrySeconds = seconds(key, value, { allowZero: true }); break;
      case '--keepalive-seconds': opts.keepaliveSeconds = seconds(key, value, { allowZero: false }); break;
      case '--keepalive-timeout-seconds':
        opts.keepaliveTimeoutSeconds = seconds(key, value, { allowZero: false });
        break;
      default: throw new Error(`unknown option ${key}`);
    }
  }
  // Every group's seed (seed + g) must be a uint64: checked here, before any call.
  opts.seed = uint64('--seed', opts.seed, UINT64_MAX - BigInt(opts.groups - 1));
  return opts;
}

// The proto definitions, parsed once per process (loadSync reads and parses every .proto: a trainer
// calling rollout() per step re-parsed them every time).
let protoDefinition = null;
function protoDef() {
  if (protoDefinition === null) {
    protoDefinition = protoLoader.loadSync(path.join(PROTO_ROOT, 'seer', 'v1', 'rollout.proto'), {
      includeDirs: [PROTO_ROOT],
      keepCase: true, // field names exactly as in the .proto (snake_case)
      // Decimal strings: a Number is exact only up to 2^53, and seeds, submission ids and policy
      // versions may be anything up to 2^64 (a string also encodes exactly, through protobufjs' Long).
      longs: String,
      enums: String,
      defaults: true,
      oneofs: true,
    });
  }
  return protoDefinition;
}

let rolloutService = null;
function loadRolloutService() {
  if (rolloutService === null) rolloutService = grpc.loadPackageDefinition(protoDef()).seer.v1.RolloutService;
  return rolloutService;
}

// The field names of a message of seer.v1 (as in the .proto: keepCase).
function fieldNames(message) {
  return protoDef()[`seer.v1.${message}`].type.field.map((f) => f.name);
}

// Milliseconds, woken early by an abort (a retry's backoff is not waited out once the run stops).
function sleep(ms, run = null) {
  return new Promise((resolve) => {
    const done = () => {
      clearTimeout(timer);
      if (run) run.wakers.delete(done);
      resolve();
    };
    const timer = setTimeout(done, ms);
    if (run) run.wakers.add(done);
  });
}

// One run's state: its calls in flight (unary calls and result streams), cancelled when the run is
// aborted (a signal in the CLI, the caller's AbortSignal in a library call), why it was aborted,
// and where its retry lines go. One per rollout() call: two concurrent calls in one process no
// longer share (and cancel) each other's calls. Without it, SIGINT or SIGTERM ended the process at
// once and the batch went on generating on the workers (nobody to read it) until it completed.
class Run {
  constructor(log = () => {}) {
    this.inFlight = new Set();
    this.wakers = new Set();
    this.reason = null; // a signal's name, or the AbortSignal's reason; null = not aborted
    this.aborted = false;
    this.log = log;
  }

  abort(reason) {
    if (this.aborted) return;
    this.aborted = true;
    this.reason = reason;
    for (const c of this.inFlight) c.cancel(); // each fails CANCELLED, which ends the run
    for (const wake of this.wakers) wake();
  }

  describe() {
    const r = this.reason;
    if (r instanceof Error) return r.message || r.name;
    return typeof r === 'string' ? r : String(r);
  }

  // A call is not started (a retry not waited out) once the run is aborted.
  check() {
    if (this.aborted) {
      throw Object.assign(new Error(`interrupted (${this.describe()})`), {
        code: grpc.status.CANCELLED, details: `interrupted (${this.describe()})`, aborted: true,
      });
    }
  }
}

// The command line's run: its signal handler aborts it, its retry lines go to stderr.
const cliRun = new Run((line) => console.error(line));

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
  constructor(retrySeconds, endMs, run) {
    this.windowMs = retrySeconds * 1000;
    this.endMs = endMs;
    this.run = run;
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
    this.run.check();
    if (!transient(err) && !(refused && err.code === grpc.status.RESOURCE_EXHAUSTED)) throw err;
    const now = Date.now();
    if (this.failingSince === null) this.failingSince = now;
    // --retry-seconds 0 is no retries at all: a weight switch's refusal is final too (it used to be
    // waited out for up to 660 s, the one retry that 0 did not turn off).
    const windowMs = switching(err) && this.windowMs > 0 ? Math.max(this.windowMs, SWITCH_WINDOW_MS) : this.windowMs;
    if (this.downMs + (now - this.failingSince) + this.delayMs > windowMs) throw err;
    this.run.log(`retrying after ${err.code} ${err.details} (${this.delayMs} ms)`);
    // Not past the run's deadline: the next call then fails DEADLINE_EXCEEDED at once.
    await sleep(Math.max(0, Math.min(this.delayMs, this.endMs - now)), this.run);
    this.run.check();
    this.delayMs = Math.min(this.delayMs * 2, 2000);
  }
}

// endMs: the run's one deadline (Date.now() ms; Infinity = none), shared by every call and every
// reopened stream (grpc-js takes a number of ms, Infinity included, as a deadline).
async function unary(client, method, request, endMs, retrySeconds, run = new Run()) {
  const retry = new Retry(retrySeconds, endMs, run);
  for (;;) {
    run.check();
    try {
      return await new Promise((resolve, reject) => {
        const c = client[method](request, { deadline: endMs }, (err, reply) => {
          run.inFlight.delete(c);
          if (err) reject(err); else resolve(reply);
        });
        run.inFlight.add(c);
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
// SubmitBatch answered ('0' = the first result's), passed with every cursor: a batch id deleted by
// retention and submitted again in between is FAILED_PRECONDITION naming submission_id, not a resume
// into the other submission's results. Cursors and submission ids are decimal strings (uint64).
//
// A result the buffer leaves out (stored over its message size limit: the next message's cursor
// steps past it) is noted from the cursors' gap and from the cursors the buffer's marked end names
// (trailing metadata: the batch's last result has no later gap), and once every other result was
// delivered the call fails RESOURCE_EXHAUSTED (DATA_LOSS when the buffer's end said so: stored
// results it cannot decode) naming the left-out cursors and the buffer's words, as the Python client
// does. The buffer's own status names them too, but only on the stream that skipped them: a stream
// resumed past one (a reconnect) ends OK, and the run said only "stream ended after N of M results".
//
// onResult may return a promise: it is awaited before the next result is handed over (the stream is
// paused meanwhile, so a slow consumer holds the buffer back instead of queueing results in memory),
// and a throw or a rejection ends the call with that error (err.fromCallback). Before, a rejected
// promise was an unhandled rejection (the process crashed) and the stream went on.
async function streamResults(client, batchId, endMs, retrySeconds, onResult, submissionId = '0', run = new Run()) {
  const retry = new Retry(retrySeconds, endMs, run);
  let cursor = 0n;
  let submission = String(submissionId);
  const leftOut = []; // BigInt cursors, ascending, each once
  const addLeftOut = (c) => {
    if (!leftOut.includes(c)) leftOut.push(c);
  };
  // How many were left out in all, when the buffer's mark counts more than it names (its cursor
  // list is bounded): the gaps before the marked stream's first cursor plus the mark's count.
  let leftOutTotal = 0;
  // The buffer's left-out ends seen ({code, details}): one read while results were still unread
  // ends nothing (a stream from `cursor` delivers them), but its code and text are the batch's
  // answer; the reopened stream, started past the left-out cursors, ends OK without them. Before,
  // that end was thrown away and a corrupted result (DATA_LOSS) came out as RESOURCE_EXHAUSTED
  // without the buffer's words.
  const leftOutEnds = [];
  const leftOutError = (err) => {
    leftOut.sort((a, b) => (a < b ? -1 : a > b ? 1 : 0));
    // DATA_LOSS (stored results it cannot decode) is the worse of the two kinds.
    const codes = leftOutEnds.map((e) => e.code);
    const code = codes.includes(grpc.status.DATA_LOSS) ? grpc.status.DATA_LOSS
      : (codes[0] ?? grpc.status.RESOURCE_EXHAUSTED);
    const said = [...new Set(leftOutEnds.map((e) => e.details).filter(Boolean))].join('; ');
    const listed = leftOut.length > 0 || leftOutTotal > 0
      ? leftOutMessage(batchId, leftOut, leftOutTotal) : '';
    const details = [listed, said && (listed ? `the buffer: ${said}` : said)].filter(Boolean).join('; ');
    if (!err) err = new Error(details);
    return Object.assign(err, { code, details, leftOut: leftOut.map(String), batchComplete: true });
  };
  for (;;) {
    // The buffer sends headers as soon as it accepts a stream; a refused or failed call ends
    // without them (grpc-js emits 'metadata' only for real headers, not for a trailers-only answer).
    let accepted = false;
    const streamFrom = cursor; // the gaps below it were seen on earlier streams
    run.check();
    try {
      await new Promise((resolve, reject) => {
        const stream = client.StreamResults(
          { batch_id: batchId, cursor: cursor.toString(), submission_id: submission },
          { deadline: endMs });
        run.inFlight.add(stream);
        // The results handed to onResult one at a time, in order: the end of the stream (or its
        // failure, which reopens it from `cursor`) waits for the callback in progress, so a
        // reopened stream never overlaps it.
        let chain = Promise.resolve();
        let failed = false;
        const fail = (err) => {
          failed = true;
          run.inFlight.delete(stream);
          reject(err);
        };
        stream.on('metadata', () => {
          accepted = true;
          retry.accepted();
        });
        stream.on('data', (msg) => {
          const next = BigInt(msg.cursor);
          for (let c = cursor; c < next - 1n; c++) addLeftOut(c);
          cursor = next;
          // '0' from a buffer without submission ids: pinned at the first result that names one.
          if (submission === '0') submission = msg.submission_id;
          retry.reset(); // progress: the retry window starts again
          stream.pause();
          chain = chain.then(() => (failed ? undefined : onResult(msg))).then(() => {
            if (!failed) stream.resume();
          }, (err) => {
            // A callback that throws or rejects ends the run (the caller's error, not a stream
            // failure, so not retried).
            const e = err instanceof Error ? err : Object.assign(new Error(String(err)), { cause: err });
            fail(Object.assign(e, { fromCallback: true }));
            stream.cancel();
          });
        });
        // An abort does not wait for the callback in progress (it may be what hangs).
        stream.on('error', (err) => {
          // grpc-js emits a failure at once, also while results it received wait unread in the
          // paused stream: they are asked for again from `cursor` (see the catch below).
          err.unread = stream.readableLength;
          if (run.aborted) fail(err);
          else chain = chain.then(() => fail(err));
        });
        stream.on('end', () => {
          chain = chain.then(() => {
            run.inFlight.delete(stream);
            if (!failed) resolve();
          });
        });
      });
    } catch (err) {
      if (err.fromCallback) throw err;
      // The buffer's end-of-batch status for left-out results: marked by its trailing metadata
      // (RESOURCE_EXHAUSTED or DATA_LOSS); from a buffer before the mark, an accepted stream's
      // RESOURCE_EXHAUSTED (DATA_LOSS was then taken for a failed stream, and the complete batch
      // cancelled).
      const mark = leftOutMark(err);
      const marked = mark !== null;
      const leftOutEnd = marked || leftOutWords(err) || (err.code === grpc.status.RESOURCE_EXHAUSTED && accepted
        && (err.unread > 0 || leftOut.length > 0));
      if (leftOutEnd) {
        // Its cursors (the batch's last result, left out, has no later message whose cursor gap
        // names it) merged with the gaps seen; its code and text kept for the final end.
        if (marked) {
          for (const c of mark.cursors) addLeftOut(c);
          const earlier = leftOut.filter((c) => c < streamFrom).length;
          leftOutTotal = Math.max(leftOutTotal, earlier + mark.count);
        }
        leftOutEnds.push({ code: err.code, details: err.details });
        if (err.unread > 0) {
          // Read before the last results (still unread in the paused stream): a stream from
          // `cursor` delivers them, and the batch's left-out error follows.
          continue;
        }
        // The buffer's status names this stream's left-out results (cursors, request ids); the
        // gaps name those of earlier streams too. Every other result was delivered: the batch is
        // complete.
        throw leftOutError(err);
      }
      await retry.wait(err, !accepted);
      continue;
    }
    if (leftOut.length > 0 || leftOutEnds.length > 0) throw leftOutError(null);
    return;
  }
}

// Trailing metadata on the buffer's StreamResults end when it left results out (rollout.proto
// StreamResults): that end is the batch's, not a failed stream's. Its value: how many the stream
// left out; beside it, the first of their cursors (comma-separated).
const RESULTS_LEFT_OUT_KEY = 'seer-results-left-out';
const RESULTS_LEFT_OUT_CURSORS_KEY = 'seer-results-left-out-cursors';
// A buffer before the mark ends the same way without it, and its words say so (every version that
// leaves results out: "N result(s) of batch ... were left out of the stream (every other result was
// sent): request 'b/0/1' (cursor 1) ..."; its stream limit's refusal says "refused: N streams are
// open"). Without this, such an end with no cursor gap before it (the batch's last result left out)
// was taken for a failed stream: the complete batch was "cancelled", DATA_LOSS lost the left-out
// mark, and one that came before the stream's headers (a buffer before those too, or a stream
// resumed at the last cursor) was taken for the stream limit and retried until --retry-seconds ran
// out.
function leftOutWords(err) {
  return (err.code === grpc.status.RESOURCE_EXHAUSTED || err.code === grpc.status.DATA_LOSS)
    && /were left out of the stream/.test(err.details || '');
}

// {count, cursors: BigInt[]} for the buffer's left-out end, else null (also an error grpc-js made
// itself, without trailers). A malformed value counts as the mark without numbers.
function leftOutMark(err) {
  const md = err && err.metadata;
  if (!md || typeof md.get !== 'function') return null;
  const counts = md.get(RESULTS_LEFT_OUT_KEY);
  if (counts.length === 0) return null;
  const text = String(md.get(RESULTS_LEFT_OUT_CURSORS_KEY)[0] ?? '');
  const cursors = text.split(',').filter((c) => /^[0-9]+$/.test(c)).map((c) => BigInt(c));
  const count = /^[0-9]+$/.test(String(counts[0])) ? Number(counts[0]) : 0;
  return { count: Math.max(count, cursors.length), cursors };
}

// As the Python client's _left_out_message (clients/python/seer_client/client.py).
// total: how many in all when `cursors` does not name every one (the buffer's list is bounded).
function leftOutMessage(batchId, cursors, total = 0) {
  const all = Math.max(total, cursors.length);
  const shown = cursors.slice(0, 20);
  // None named: a buffer that marks its end with the count alone (before it named the cursors);
  // its own words, beside this, name them. Before: "cursor(s)  and 1 more".
  const named = shown.length === 0 ? 'not named by this buffer (an older one: its words name them)'
    : shown.join(', ') + (all > shown.length ? ` and ${all - shown.length} more` : '');
  return `batch ${JSON.stringify(batchId)}: ${all} result(s) were left out of the stream by the buffer `
    + `(over its message size limit, or stored results it cannot decode: its log names each; every other result was delivered): cursor(s) ${named}`;
}

// A mix of the two prompt forms the API accepts: text (tokenized by the buffer) and token ids. seed:
// the base seed as a decimal string (group g uses seed + g, as `seer rollout --seed`), added as a
// BigInt so that a seed near 2^64 stays exact.
function makeGroups(n, groupSize, maxTokens, seed = '1234') {
  const texts = ['The capital of France is', 'Write a haiku about the sea.', 'def fibonacci(n):', '1, 2, 3, 5, 8,'];
  const groups = [];
  for (let g = 0; g < n; g++) {
    const group = {
      prompt_key: `node-example-${g}`,
      group_size: groupSize,
      max_tokens: maxTokens,
      sampling: {
        temperature: g % 2 === 0 ? 0.8 : 0.0, top_p: 0.95, top_k: 0, seed: (BigInt(seed) + BigInt(g)).toString(),
      },
      labels: { source: 'node', group: String(g) },
    };
    if (g % 2 === 0) group.prompt_text = texts[g % texts.length];
    else group.prompt_token_ids = [504, 3575, 282, 4649, 314]; // SmolLM2 vocabulary ids
    groups.push(group);
  }
  return groups;
}

// `obj`'s keys that are not fields of `message`, refused naming the first (`where`.key). protobufjs
// (keepCase) silently drops a key it does not know: a camelCase topP or ignoreEos was sent as
// nothing, and the group sampled with the defaults.
function checkKeys(obj, message, where) {
  const known = fieldNames(message);
  for (const key of Object.keys(obj)) {
    if (known.includes(key)) continue;
    const snake = key.replace(/[A-Z]/g, (c) => `_${c.toLowerCase()}`);
    const hint = snake !== key && known.includes(snake) ? ` (did you mean ${snake}?)` : '';
    throw Object.assign(new Error(`${where}.${key}: unknown field${hint}; ${message} has ${known.join(', ')}`),
      { field: `${where}.${key}` });
  }
}

// The groups as they are sent: every key a field of PromptGroup (and of SamplingParams in
// sampling), each sampling.seed checked and made a decimal string (naming the field, before any
// call). Copies: the caller's objects are left as they were.
function checkGroups(groups) {
  if (!Array.isArray(groups) || groups.length === 0) {
    throw Object.assign(new Error('groups: must be a non-empty array of prompt groups'), { field: 'groups' });
  }
  return groups.map((g, i) => {
    if (g === null || typeof g !== 'object' || Array.isArray(g)) {
      throw Object.assign(new Error(`groups[${i}]: must be an object`), { field: `groups[${i}]` });
    }
    checkKeys(g, 'PromptGroup', `groups[${i}]`);
    if (g.sampling === undefined || g.sampling === null) return g;
    if (typeof g.sampling !== 'object' || Array.isArray(g.sampling)) {
      throw Object.assign(new Error(`groups[${i}].sampling: must be an object`), { field: `groups[${i}].sampling` });
    }
    checkKeys(g.sampling, 'SamplingParams', `groups[${i}].sampling`);
    const { sampling } = g;
    if (sampling.seed === undefined || sampling.seed === null) return g;
    return { ...g, sampling: { ...sampling, seed: uint64(`groups[${i}].sampling.seed`, sampling.seed) } };
  });
}

// The finish reasons as the Python client names them (seer_client _FINISH).
const FINISH = {
  FINISH_REASON_UNSPECIFIED: 'unspecified', FINISH_REASON_STOP: 'stop', FINISH_REASON_LENGTH: 'length',
  FINISH_REASON_ABORTED: 'aborted', FINISH_REASON_CHUNK: 'chunk',
};

// One StreamResultsResponse as a result object with the Python client's RolloutResult fields
// (clients/python/seer_client/types.py). The 64-bit fields (policy_version, cursor, submission_id)
// are decimal strings: BigInt(result.cursor) for arithmetic.
function toResult(msg) {
  const r = msg.result;
  return {
    request_id: r.request_id,
    batch_id: r.batch_id,
    group_index: r.group_index,
    sample_index: r.sample_index,
    prompt_key: r.prompt_key,
    token_ids: r.token_ids,
    logprobs: r.logprobs,
    finish_reason: FINISH[r.finish_reason] || String(r.finish_reason),
    policy_version: r.policy_version,
    num_chunks: r.num_chunks,
    latency_seconds: r.latency_seconds,
    labels: r.labels,
    text: r.text,
    stats: stats(r.stats),
    cursor: msg.cursor,
    submission_id: msg.submission_id,
  };
}

// Every ChunkStats field, 0 where the result has none (as the Python client's stats dict; it was
// {} here when the buffer sent no stats).
function stats(s) {
  const out = {};
  for (const k of fieldNames('ChunkStats')) out[k] = s && s[k] !== undefined && s[k] !== null ? s[k] : 0;
  return out;
}

const LONG_FIELDS = ['policy_version', 'cursor', 'submission_id'];

// A result as one JSON line: its 64-bit fields written as JSON numbers with every digit (a JSON
// number may be any size; Python's json reads them exactly, JSON.parse rounds above 2^53), the rest
// by JSON.stringify.
function resultLine(result) {
  const rest = { ...result };
  const head = [];
  for (const k of LONG_FIELDS) {
    const v = String(rest[k]);
    if (!/^-?\d+$/.test(v)) throw new Error(`${k}: not an integer: ${JSON.stringify(rest[k])}`);
    head.push(`${JSON.stringify(k)}:${v}`);
    delete rest[k];
  }
  const body = JSON.stringify(rest);
  return `{${head.join(',')}${body === '{}' ? '' : `,${body.slice(1, -1)}`}}`;
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
  if (!['stop', 'length'].includes(result.finish_reason)) problems.push(`finish_reason ${result.finish_reason}`);
  if (result.finish_reason === 'length' && group && result.token_ids.length !== group.max_tokens) {
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
// so. A transient failure (the buffer restarting: the stream that failed for good may have been cut
// by it) is retried within the same 5 s, as `seer rollout`'s cancel retries for 5 s. The buffer's
// answer naming submission_token is final: NOT_FOUND = this submission was not stored (and is
// refused from then on), FAILED_PRECONDITION = the id names another run's batch.
async function cancelSubmission(RolloutService, opts, batchId, token) {
  const client = new RolloutService(opts.address, grpc.credentials.createInsecure(),
    channelOptions(opts.keepaliveSeconds || 30, opts.keepaliveTimeoutSeconds || 10));
  const endMs = Date.now() + CANCEL_DEADLINE_MS;
  try {
    let delayMs = 100;
    for (;;) {
      try {
        const reply = await new Promise((resolve, reject) => {
          client.CancelBatch({ batch_id: batchId, submission_token: token },
            { deadline: endMs }, (err, r) => (err ? reject(err) : resolve(r)));
        });
        // A completed batch is answered (COMPLETED, 0) and left as it was: not "cancelled".
        if (reply.state === 'BATCH_STATE_COMPLETED') return 'nothing to cancel: the batch had completed';
        return `cancelled it (${reply.num_cancelled} unfinished responses)`;
      } catch (err) {
        if (!transient(err) || Date.now() + delayMs >= endMs) throw err;
        await sleep(delayMs);
        delayMs = Math.min(delayMs * 2, 1000);
      }
    }
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

// Status codes of a submission the buffer refused for certain: nothing was stored, and the batch id
// may name another run's batch, so nothing is cancelled (services/cli/rollout.py REFUSED). Any other
// failure of SubmitBatch (UNAVAILABLE, DEADLINE_EXCEEDED, ...) leaves the outcome unknown: cancelled.
const REFUSED = new Set([
  grpc.status.INVALID_ARGUMENT, grpc.status.ALREADY_EXISTS, grpc.status.FAILED_PRECONDITION,
  grpc.status.RESOURCE_EXHAUSTED, grpc.status.NOT_FOUND, grpc.status.OUT_OF_RANGE, grpc.status.PERMISSION_DENIED,
  grpc.status.UNAUTHENTICATED, grpc.status.UNIMPLEMENTED,
]);

// Whether a run that failed with `err` in `phase` leaves a batch running that nobody will read:
// 'submitting' (unless refused for certain) or 'streaming'. After the last result ('done') there is
// nothing left to cancel, nor after results left out by the buffer (named once every other result
// was delivered: the batch is complete; the cancel that followed only said "0 unfinished").
function needsCancel(phase, err) {
  if (err.batchComplete) return false;
  if (phase === 'streaming') return true;
  return phase === 'submitting' && !REFUSED.has(err.code);
}

// node-<ms>-<random hex>: the time alone named two processes' batches alike when they started in
// the same millisecond (the second one's SubmitBatch answered already_submitted with the other's).
function defaultBatchId() {
  return `node-${Date.now()}-${crypto.randomBytes(6).toString('hex')}`;
}

function createClient(RolloutService, opts) {
  return new RolloutService(opts.address, grpc.credentials.createInsecure(),
    channelOptions(opts.keepaliveSeconds, opts.keepaliveTimeoutSeconds));
}

const OPTIONS = [
  'address', 'groups', 'batchId', 'timeout', 'cancelOnTimeout', 'retrySeconds', 'keepaliveSeconds',
  'keepaliveTimeoutSeconds', 'seedScope', 'submissionToken', 'signal', 'log',
];
const TOKEN_RE = /^[A-Za-z0-9._:-]{1,128}$/; // the buffer's (services/buffer/validation.py)

const badOption = (field, what, value) => Object.assign(
  new Error(`${field}: ${what}, got ${typeof value === 'function' ? 'a function' : String(value)}`), { field });

// The library's options, checked before any call (each error's `field` names the option).
function libraryOptions(options) {
  if (options === null || typeof options !== 'object') throw badOption('options', 'must be an object', options);
  for (const key of Object.keys(options)) {
    if (OPTIONS.includes(key)) continue;
    // batch_id for batchId would be dropped silently: the call then ran under a generated id.
    const camel = key.replace(/_([a-z])/g, (_, c) => c.toUpperCase());
    const hint = camel !== key && OPTIONS.includes(camel) ? ` (did you mean ${camel}?)` : '';
    throw Object.assign(new Error(`${key}: unknown option${hint}; rollout() takes ${OPTIONS.join(', ')}`),
      { field: key });
  }
  const o = {
    address: 'localhost:50051', batchId: '', timeout: Infinity, cancelOnTimeout: false, retrySeconds: 60,
    keepaliveSeconds: 30, keepaliveTimeoutSeconds: 10, seedScope: '', submissionToken: null, signal: null,
    log: null, ...options,
  };
  if (o.timeout === null || o.timeout === undefined) o.timeout = Infinity; // no deadline, as run_batch's None
  if (typeof o.timeout !== 'number' || !(o.timeout > 0)) {
    throw badOption('timeout', 'must be a positive number of seconds, Infinity or null (none)', o.timeout);
  }
  for (const k of ['keepaliveSeconds', 'keepaliveTimeoutSeconds']) {
    if (typeof o[k] !== 'number' || !(o[k] > 0) || !Number.isFinite(o[k])) {
      throw badOption(k, 'must be a positive number of seconds', o[k]);
    }
  }
  if (typeof o.retrySeconds !== 'number' || !(o.retrySeconds >= 0) || !Number.isFinite(o.retrySeconds)) {
    throw badOption('retrySeconds', 'must be a number of seconds >= 0', o.retrySeconds);
  }
  if (typeof o.cancelOnTimeout !== 'boolean') throw badOption('cancelOnTimeout', 'must be a boolean', o.cancelOnTimeout);
  // '' too means "a fresh one", as run_batch's submission_token="" (an empty token would make
  // the cancel name no submission: whatever batch the id names).
  if (o.submissionToken !== null && o.submissionToken !== undefined && o.submissionToken !== ''
      && (typeof o.submissionToken !== 'string' || !TOKEN_RE.test(o.submissionToken))) {
    throw badOption('submissionToken', 'must match [A-Za-z0-9._:-]{1,128}', JSON.stringify(o.submissionToken));
  }
  if (o.signal !== null && o.signal !== undefined && !(o.signal instanceof AbortSignal)) {
    throw badOption('signal', 'must be an AbortSignal', o.signal);
  }
  if (o.log !== null && o.log !== undefined && typeof o.log !== 'function') {
    throw badOption('log', 'must be a function (line) => void', o.log);
  }
  return o;
}

// The library entry point: submits `groups` (PromptGroup objects as in rollout.proto, snake_case;
// any other key is refused naming it; a sampling.seed may be a BigInt, a decimal string or a
// safe-integer Number) as batch `batchId`, streams every result, calls onResult(result) for each
// (toResult's fields; a returned promise is awaited before the next), and resolves to
// { batch_id, submission_id, submission_token, num_requests, policy_version, already_submitted,
// responses, results } (results: every result, only when no onResult was given). Options: address,
// batchId (default: node-<time>-<random hex>), timeout (seconds, one deadline for the whole call;
// default Infinity = none, as SeerClient.run_batch), cancelOnTimeout (false), retrySeconds,
// keepaliveSeconds, keepaliveTimeoutSeconds, seedScope, submissionToken (default: a random one),
// signal (an AbortSignal), log ((line) => void for the retry lines; default: none).
//
// It rejects with the error that ended it, err.batchId and err.submissionToken naming the
// submission. A batch left running by a failure after the submission (the signal aborted, a stream
// that failed for good, onResult throwing or rejecting) is cancelled first, by this call's
// submission token, and err.cancel says what happened to it. A timeout leaves the batch running,
// as run_batch's (err.timedOut; calling again with the same batchId and submissionToken collects
// it), unless cancelOnTimeout; its details say how many of the batch's results came (err.responses
// of err.numRequests; err.results holds them without onResult) and for how long none came. A stream that ended with fewer results than requests (the batch was
// cancelled by someone else) rejects ABORTED, err.incomplete. A bad argument rejects before any
// call, err.field naming it.
async function rollout(options, onResult) {
  const o = libraryOptions(options);
  if (onResult !== undefined && onResult !== null && typeof onResult !== 'function') {
    throw badOption('onResult', 'must be a function', onResult);
  }
  const groups = checkGroups(o.groups);
  const batchId = o.batchId || defaultBatchId();
  // Names this call's submission to CancelBatch; returned, so the caller can cancel it or collect it.
  const token = o.submissionToken || crypto.randomBytes(16).toString('hex');
  const run = new Run(o.log || (() => {}));
  const { signal } = o;
  const aborted = () => Object.assign(new Error(`rollout of batch ${batchId} aborted: ${run.describe()}`), {
    code: grpc.status.CANCELLED, details: `aborted: ${run.describe()}`, aborted: true, cause: run.reason,
  });
  if (signal && signal.aborted) {
    run.abort(signal.reason);
    throw Object.assign(aborted(), { batchId, submissionToken: token }); // nothing was sent
  }
  const RolloutService = loadRolloutService();
  const client = createClient(RolloutService, o);
  const endMs = Date.now() + o.timeout * 1000; // Infinity: no deadline
  const results = onResult ? null : [];
  let responses = 0;
  let numRequests = null; // SubmitBatch's answer: the batch's size, for a timeout's counts
  let progressMs = null; // when the stream began, then when the last result came
  let phase = 'submitting';
  const onAbort = () => run.abort(signal.reason);
  if (signal) signal.addEventListener('abort', onAbort, { once: true });
  try {
    const submitted = await unary(client, 'SubmitBatch',
      { batch_id: batchId, groups, submission_token: token, seed_scope: o.seedScope }, endMs, o.retrySeconds, run);
    phase = 'streaming';
    numRequests = submitted.num_requests;
    progressMs = Date.now();
    await streamResults(client, batchId, endMs, o.retrySeconds, (msg) => {
      responses += 1;
      progressMs = Date.now();
      const r = toResult(msg);
      if (!results) return onResult(r); // a promise is awaited before the next result
      results.push(r);
      return undefined;
    }, submitted.submission_id, run);
    phase = 'done';
    if (responses < submitted.num_requests) {
      // The stream ended OK short of the batch: its other requests were cancelled (CancelBatch
      // by someone else, e.g. an operator or another process). Before, this resolved as a success
      // and a trainer went on with part of its groups.
      const details = `batch ${JSON.stringify(batchId)} ended after ${responses} of ${submitted.num_requests} `
        + 'results: it was cancelled by someone else (the rest will not come)';
      throw Object.assign(new Error(details), { code: grpc.status.ABORTED, details, incomplete: true });
    }
    return {
      batch_id: batchId, submission_id: submitted.submission_id, submission_token: token,
      num_requests: submitted.num_requests, policy_version: submitted.policy_version,
      already_submitted: submitted.already_submitted, responses, results,
    };
  } catch (caught) {
    let err = caught;
    if (run.aborted && !err.fromCallback) err = aborted(); // the calls' CANCELLED, said as the abort it was
    // (grpc-js' deadline timer may fire a few ms before endMs by Date.now().)
    if (err.code === grpc.status.DEADLINE_EXCEEDED && Date.now() >= endMs - 100) {
      err.timedOut = true;
      err.details = `timeout (${o.timeout} s) ran out (one deadline for the whole call): `
        + `${progressLine(responses, numRequests, progressMs)}: ${err.details || err.message}`;
    }
    Object.assign(err, { batchId, submissionToken: token, responses });
    if (numRequests !== null) err.numRequests = numRequests;
    if (results) err.results = results;
    if (!needsCancel(phase, err)) throw err;
    if (err.timedOut && !o.cancelOnTimeout) {
      err.cancel = 'left running (timeout; cancelOnTimeout not set): call rollout() again with the same batchId '
        + 'and submissionToken to collect it';
      throw err;
    }
    client.close(); // a submission still in flight is cancelled with it (the buffer does not store it)
    err.cancel = await cancelSubmission(RolloutService, o, batchId, token);
    throw err;
  } finally {
    if (signal) signal.removeEventListener('abort', onAbort);
    client.close();
  }
}

// What a timeout knows of the batch's progress (as the Python client's SeerTimeout says it): the
// results received of the batch's size, and for how long none came. Before, a timeout said only
// "Deadline exceeded": a batch no worker serves and one still progressing looked alike.
// numRequests null: the submission was not answered yet.
function progressLine(responses, numRequests, progressMs) {
  if (numRequests === null || progressMs === null) return 'before SubmitBatch answered';
  const missing = Math.max(0, numRequests - responses);
  const quiet = ((Date.now() - progressMs) / 1000).toFixed(1);
  return `${responses} of ${numRequests} results received, ${missing} missing; no new result for ${quiet} s`;
}

async function main() {
  const opts = parseArgs(process.argv.slice(2));
  const RolloutService = loadRolloutService();
  const client = createClient(RolloutService, opts);
  const batchId = opts.batchId || defaultBatchId();
  // Names this run's submission to CancelBatch (SubmitBatchRequest.submission_token).
  const token = crypto.randomBytes(16).toString('hex');
  // Opened before anything is sent: a path that cannot be written ends the run with no batch.
  const out = openOutput(opts.output);
  const state = { phase: 'before' }; // 'submitting' once a SubmitBatch was sent: the batch may be stored
  let cancelling = false;
  const onSignal = (sig) => {
    if (cancelling) {
      console.error(`cancelling batch ${batchId} was interrupted: it may still be running`);
      process.exit(128 + os.constants.signals[sig]);
    }
    cliRun.abort(sig); // the calls in flight fail CANCELLED, which ends the run below
  };
  process.on('SIGINT', onSignal);
  process.on('SIGTERM', onSignal);
  try {
    await run(opts, client, batchId, token, state, out);
  } catch (err) {
    client.close();
    if (!cliRun.aborted) {
      // A timeout or a stream that failed for good: nobody will read the rest of the batch, so it
      // is cancelled as `seer rollout` does (before: it went on generating). A left-out result
      // ends a complete batch: nothing to cancel (needsCancel).
      if (needsCancel(state.phase, err)) {
        cancelling = true;
        err.cancel = await cancelSubmission(RolloutService, opts, batchId, token);
        console.error(`batch ${batchId}: ${err.cancel}`);
      }
      throw err;
    }
    // Not before the submission (nothing of ours stored) and not once the stream ended (the batch
    // is complete: a cancel would only say "0 unfinished responses").
    if (state.phase !== 'before' && state.phase !== 'done') {
      cancelling = true;
      console.error(`batch ${batchId}: ${await cancelSubmission(RolloutService, opts, batchId, token)}`);
    }
    const sig = cliRun.reason;
    console.error(`interrupted (${sig})`);
    out.say(`RESULT ${JSON.stringify({ client: 'node', ok: false, error: `interrupted (${sig})` })}`);
    process.exitCode = 128 + os.constants.signals[sig];
  } finally {
    process.removeListener('SIGINT', onSignal);
    process.removeListener('SIGTERM', onSignal);
    await out.close();
  }
}

// Where the run writes: `say` the human-readable lines (stdout, or stderr when the results go to
// stdout), `write` a result's JSON line (--output FILE, `-` = stdout, none = nowhere).
function openOutput(output) {
  if (output === null || output === undefined) {
    return { say: (line) => console.log(line), write: () => {}, close: async () => {} };
  }
  if (output === '-') {
    return {
      say: (line) => console.error(line), write: (line) => process.stdout.write(`${line}\n`), close: async () => {},
    };
  }
  const fd = fs.openSync(output, 'w');
  return {
    say: (line) => console.log(line),
    write: (line) => fs.writeSync(fd, `${line}\n`),
    close: async () => fs.closeSync(fd),
  };
}

async function run(opts, client, batchId, token, state, out) {
  // One deadline for the whole run, computed once (like the Python client's iter_results timeout).
  const endMs = Date.now() + opts.timeout * 1000;
  runEndMs = endMs;
  const call = (method, request) => unary(client, method, request, endMs, opts.retrySeconds, cliRun);
  const groups = makeGroups(opts.groups, opts.groupSize, opts.maxTokens, opts.seed);
  const start = Date.now();

  state.phase = 'submitting';
  const submitted = await call('SubmitBatch', { batch_id: batchId, groups, submission_token: token });
  state.phase = 'streaming';
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
  let progressMs = Date.now();
  try {
    await streamResults(client, batchId, endMs, opts.retrySeconds, (msg) => {
      progressMs = Date.now();
      const r = toResult(msg);
      if (firstResultSeconds === null) firstResultSeconds = (Date.now() - start) / 1000;
      problems.push(...checkResult(r, groups, seen));
      seen.add(r.request_id);
      tokens += r.token_ids.length;
      out.write(resultLine(r));
      const text = (r.text || '').replace(/\s+/g, ' ').slice(0, 60);
      out.say(`result ${r.cursor}/${expected} group ${r.group_index} sample ${r.sample_index}: `
        + `${r.token_ids.length} tokens, ${r.finish_reason}, v${r.policy_version} ${JSON.stringify(text)}`);
    }, submitted.submission_id, cliRun);
  } catch (err) {
    err.progress = progressLine(seen.size, expected, progressMs); // for --timeout's line
    throw err;
  }
  state.phase = 'done';
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
  out.say(`RESULT ${JSON.stringify(summary)}`);
  process.exitCode = problems.length === 0 ? 0 : 1;
}

function cliMain() {
  main().catch((err) => {
    if (err.code === grpc.status.DEADLINE_EXCEEDED && runEndMs !== null && Date.now() >= runEndMs) {
      const progress = err.progress ? `${err.progress}: ` : '';
      err.details = `--timeout ran out (one deadline for the whole run): ${progress}${err.details || err.message}`;
    }
    console.error(`error: ${err.code !== undefined ? `${err.code} ` : ''}${err.details || err.message}`);
    const summary = { client: 'node', ok: false, error: String(err.details || err.message) };
    if (err.cancel) summary.cancel = err.cancel;
    // Where the run's other human-readable lines went: stdout, or stderr under --output -.
    (outputIsStdout(process.argv.slice(2)) ? console.error : console.log)(
      `RESULT ${JSON.stringify(summary)}`);
    process.exitCode = 1;
  });
}

function outputIsStdout(argv) {
  const i = argv.indexOf('--output');
  return i >= 0 && argv[i + 1] === '-';
}

// Run as a program only: required as a library it starts nothing (before, main() ran on require).
if (require.main === module) cliMain();

module.exports = {
  rollout,
  streamResults,
  cancelSubmission,
  loadRolloutService,
  createClient,
  channelOptions,
  checkGroups,
  makeGroups,
  toResult,
  resultLine,
  parseArgs,
  uint64,
  leftOutMessage,
  main,
};
