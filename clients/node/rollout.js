#!/usr/bin/env node
// Seer from a second language: submits a batch of prompt groups to the RolloutService (served by the
// buffer), streams every result as it finishes, checks each one, and prints a summary.
//
//   npm install && node rollout.js --address localhost:50051 [--groups 2] [--group-size 2] [--max-tokens 16]
//                                  [--retry-seconds 60]
//
// A buffer restart (or a dropped connection) is survived the way the Python client does it: calls
// that fail UNAVAILABLE are retried with backoff, and the result stream is reopened from the cursor
// of the last result received (the stream is resumable by cursor), for at most --retry-seconds of
// failures since the last progress. SubmitBatch is idempotent by batch id, so retrying it is safe.
//
// The protos are loaded at run time from protos/seer/v1 (the same files the Python code is generated
// from), so this client needs no code generation step. Exit code 0 = every response was received and
// well formed; the last line is `RESULT {json}`.
'use strict';

const path = require('path');
const grpc = require('@grpc/grpc-js');
const protoLoader = require('@grpc/proto-loader');

const PROTO_ROOT = process.env.SEER_PROTO_ROOT || path.resolve(__dirname, '..', '..', 'protos');

function parseArgs(argv) {
  const opts = {
    address: 'localhost:50051', groups: 2, groupSize: 2, maxTokens: 16, timeout: 600, batchId: '', retrySeconds: 60,
  };
  for (let i = 0; i < argv.length; i += 2) {
    const key = argv[i];
    const value = argv[i + 1];
    if (value === undefined) throw new Error(`${key}: missing value`);
    switch (key) {
      case '--address': opts.address = value; break;
      case '--groups': opts.groups = parseInt(value, 10); break;
      case '--group-size': opts.groupSize = parseInt(value, 10); break;
      case '--max-tokens': opts.maxTokens = parseInt(value, 10); break;
      case '--timeout': opts.timeout = parseFloat(value); break;
      case '--batch-id': opts.batchId = value; break;
      case '--retry-seconds': opts.retrySeconds = parseFloat(value); break;
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

// A transport break, not an answer: UNAVAILABLE (the service is away, e.g. restarting), or the
// INTERNAL that grpc-js reports when the server's HTTP/2 session ends under a stream ("Received
// RST_STREAM with code 2 triggered by internal client error: Session closed with error code 2", seen
// when the buffer stops; grpc/grpc-node#2672). An INTERNAL of the service itself names an exception
// ("ExceptionType: message") and is the answer.
function transient(err) {
  return err.code === grpc.status.UNAVAILABLE
    || (err.code === grpc.status.INTERNAL && /RST_STREAM|Session closed/.test(err.details || ''));
}

// Retries while the transient failures add up to less than retrySeconds; any other status is the
// answer. backoff: 50 ms doubling to 2 s.
class Retry {
  constructor(retrySeconds) {
    this.windowMs = retrySeconds * 1000;
    this.reset();
  }

  reset() {
    this.failingSince = null;
    this.delayMs = 50;
  }

  async wait(err) {
    if (!transient(err)) throw err;
    const now = Date.now();
    if (this.failingSince === null) this.failingSince = now;
    if (now - this.failingSince + this.delayMs > this.windowMs) throw err;
    console.error(`retrying after ${err.code} ${err.details} (${this.delayMs} ms)`);
    await sleep(this.delayMs);
    this.delayMs = Math.min(this.delayMs * 2, 2000);
  }
}

async function unary(client, method, request, deadline, retrySeconds) {
  const retry = new Retry(retrySeconds);
  for (;;) {
    try {
      return await new Promise((resolve, reject) => {
        client[method](request, { deadline: deadline() }, (err, reply) => (err ? reject(err) : resolve(reply)));
      });
    } catch (err) {
      await retry.wait(err);
    }
  }
}

// Every result of the batch from `cursor` on, in completion order; onResult(msg) for each. A stream
// that fails UNAVAILABLE is reopened from the cursor of the last result received.
async function streamResults(client, batchId, deadline, retrySeconds, onResult) {
  const retry = new Retry(retrySeconds);
  let cursor = 0;
  for (;;) {
    try {
      await new Promise((resolve, reject) => {
        const stream = client.StreamResults({ batch_id: batchId, cursor }, { deadline: deadline() });
        stream.on('data', (msg) => {
          cursor = msg.cursor;
          retry.reset(); // progress: the retry window starts again
          onResult(msg);
        });
        stream.on('error', reject);
        stream.on('end', resolve);
      });
      return;
    } catch (err) {
      await retry.wait(err);
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

async function main() {
  const opts = parseArgs(process.argv.slice(2));
  const RolloutService = loadRolloutService();
  const client = new RolloutService(opts.address, grpc.credentials.createInsecure());
  const deadline = () => new Date(Date.now() + opts.timeout * 1000);
  const call = (method, request) => unary(client, method, request, deadline, opts.retrySeconds);
  const batchId = opts.batchId || `node-${Date.now()}`;
  const groups = makeGroups(opts.groups, opts.groupSize, opts.maxTokens);
  const start = Date.now();

  const submitted = await call('SubmitBatch', { batch_id: batchId, groups });
  const expected = opts.groups * opts.groupSize;
  if (submitted.num_requests !== expected) {
    throw new Error(`SubmitBatch: num_requests ${submitted.num_requests}, expected ${expected}`);
  }
  // Idempotent by batch id: the same batch again creates nothing.
  const again = await call('SubmitBatch', { batch_id: batchId, groups });
  if (!again.already_submitted) throw new Error('SubmitBatch: resubmission was not recognized');

  const seen = new Set();
  const problems = [];
  let tokens = 0;
  let firstResultSeconds = null;
  await streamResults(client, batchId, deadline, opts.retrySeconds, (msg) => {
    const r = msg.result;
    if (firstResultSeconds === null) firstResultSeconds = (Date.now() - start) / 1000;
    problems.push(...checkResult(r, groups, seen));
    seen.add(r.request_id);
    tokens += r.token_ids.length;
    const text = (r.text || '').replace(/\s+/g, ' ').slice(0, 60);
    console.log(`result ${msg.cursor}/${expected} group ${r.group_index} sample ${r.sample_index}: `
      + `${r.token_ids.length} tokens, ${r.finish_reason}, v${r.policy_version} ${JSON.stringify(text)}`);
  });
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
  console.error(`error: ${err.code !== undefined ? `${err.code} ` : ''}${err.details || err.message}`);
  console.log(`RESULT ${JSON.stringify({ client: 'node', ok: false, error: String(err.details || err.message) })}`);
  process.exitCode = 1;
});
