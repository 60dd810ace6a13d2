"""Load test of a real buffer process: submit, WatchWork snapshot, CommitChunk, StreamResults.

    python -m bench.buffer_load [--quick] [--requests N] [--prompt-tokens P]

Starts `python -m services.buffer` on a temporary data dir, drives it over gRPC from this process
the way the scheduler and a trainer do, prints one line per phase and `RESULT {json}` last.
(A benchmark: it prints; the service modules never do.)
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import grpc
from seer.v1 import buffer_pb2, buffer_pb2_grpc, common_pb2, rollout_pb2, rollout_pb2_grpc


def _start(data: Path) -> tuple[subprocess.Popen[bytes], str]:
    port_file = data / "port"
    proc = subprocess.Popen(
        [sys.executable, "-m", "services.buffer", "--port", "0", "--port-file", str(port_file),
         "--data-dir", str(data / "db"), "--model-dir", "", "--grace-seconds", "0"],
        env={**os.environ, "SEER_LOG_LEVEL": "warning"})
    deadline = time.monotonic() + 60
    while not port_file.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError("buffer did not start")
        time.sleep(0.05)
    return proc, f"127.0.0.1:{port_file.read_text()}"


def run(requests: int, prompt_tokens: int, group_size: int, chunk_tokens: int, threads: int) -> dict[str, Any]:
    out: dict[str, Any] = {"requests": requests, "prompt_tokens": prompt_tokens, "group_size": group_size,
                           "chunk_tokens": chunk_tokens, "commit_threads": threads}
    with tempfile.TemporaryDirectory(prefix="seer-buffer-load-") as tmp:
        proc, address = _start(Path(tmp))
        ch = grpc.insecure_channel(address, options=[("grpc.max_send_message_length", 64 << 20),
                                                     ("grpc.max_receive_message_length", 64 << 20)])
        try:
            rollout = rollout_pb2_grpc.RolloutServiceStub(ch)
            internal = buffer_pb2_grpc.BufferInternalServiceStub(ch)
            groups = [rollout_pb2.PromptGroup(prompt_token_ids=list(range(100, 100 + prompt_tokens)),
                                              group_size=group_size, max_tokens=2 * chunk_tokens, prompt_key=f"k{g}")
                      for g in range(requests // group_size)]
            t = time.perf_counter()
            rollout.SubmitBatch(rollout_pb2.SubmitBatchRequest(batch_id="load", groups=groups), timeout=600)
            out["submit_seconds"] = round(time.perf_counter() - t, 3)
            print(f"submit      {requests} requests in {out['submit_seconds']} s", flush=True)

            t = time.perf_counter()
            items: list[str] = []
            stream = internal.WatchWork(buffer_pb2.WatchWorkRequest(watcher_id="load"), timeout=600)
            for ev in stream:
                if ev.HasField("snapshot_done"):
                    break
                if ev.HasField("added"):  # the snapshot opens with the policy event
                    items.extend(it.request_id for it in ev.added.items)
            stream.cancel()
            dt = time.perf_counter() - t
            out["snapshot_items_per_second"] = round(len(items) / dt, 1)
            print(f"snapshot    {len(items)} work items, {out['snapshot_items_per_second']} items/s", flush=True)

            toks, lps = list(range(chunk_tokens)), [-0.5] * chunk_tokens

            def commit_all(rids: list[str]) -> None:
                for seq, reason in ((0, common_pb2.FINISH_REASON_CHUNK), (1, common_pb2.FINISH_REASON_STOP)):
                    for rid in rids:
                        internal.CommitChunk(buffer_pb2.CommitChunkRequest(
                            request_id=rid, seq=seq, token_ids=toks, logprobs=lps, finish_reason=reason),
                            timeout=60)

            t = time.perf_counter()
            workers = [threading.Thread(target=commit_all, args=(items[i::threads],)) for i in range(threads)]
            for w in workers:
                w.start()
            for w in workers:
                w.join()
            dt = time.perf_counter() - t
            out["commits_per_second"] = round(2 * len(items) / dt, 1)
            out["committed_tokens_per_second"] = round(2 * len(items) * chunk_tokens / dt, 1)
            print(f"commit      {2 * len(items)} chunks, {out['commits_per_second']} commits/s "
                  f"({out['committed_tokens_per_second']} tokens/s)", flush=True)

            t = time.perf_counter()
            n = sum(1 for _ in rollout.StreamResults(rollout_pb2.StreamResultsRequest(batch_id="load"), timeout=600))
            dt = time.perf_counter() - t
            out["stream_results_per_second"] = round(n / dt, 1)
            print(f"stream      {n} results, {out['stream_results_per_second']} results/s", flush=True)
            assert n == len(items) == requests, (n, len(items), requests)
        finally:
            ch.close()
            proc.terminate()
            proc.wait(30)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.buffer_load", description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="small run (well under 60 s)")
    p.add_argument("--requests", type=int, default=16384)
    p.add_argument("--prompt-tokens", type=int, default=512)
    p.add_argument("--group-size", type=int, default=16)
    p.add_argument("--chunk-tokens", type=int, default=256)
    p.add_argument("--threads", type=int, default=4)
    a = p.parse_args(argv)
    requests = 2048 if a.quick else a.requests
    result = run(requests, a.prompt_tokens, a.group_size, a.chunk_tokens, a.threads)
    print("RESULT " + json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
