"""Helpers of the client tests: a real buffer (in process, real gRPC and RocksDB) that can be
restarted on the same port, and a thread that plays the scheduler (WatchWork + CommitChunk)."""

from __future__ import annotations

import contextlib
import json
import queue
import socket
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

import grpc
from seer.v1 import buffer_pb2, buffer_pb2_grpc, common_pb2, rollout_pb2, rollout_pb2_grpc

from services.buffer.app import start
from services.buffer.config import BufferConfig
from services.buffer.core import BufferCore
from services.common.server import RunningServer


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Buffer:
    """A restartable buffer on a fixed port."""

    def __init__(self, data_dir: Path) -> None:
        self.cfg = BufferConfig(port=_free_port(), data_dir=str(data_dir), model_dir="", grace_seconds=0.0)
        self.running: RunningServer | None = None
        self.core: BufferCore | None = None

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.cfg.port}"

    def start(self) -> None:
        self.running, self.core = start(self.cfg)

    def stop(self) -> None:
        if self.running is not None:
            self.running.stop(0)
            self.running = None


def answer_tokens(request_id: str, n: int) -> list[int]:
    """Deterministic fake responses: the response of sample s is `n` copies of token 10 + s."""
    sample = int(request_id.rsplit("/", 1)[1])
    return [10 + sample] * n


def play_scheduler(address: str, length: int = 4, chunk: int = 2, stop: threading.Event | None = None,
                   gate: threading.Semaphore | None = None) -> None:
    """Runs every request of the feed to `length` tokens in chunks; `gate` (if given) paces requests."""
    ch = grpc.insecure_channel(address)
    stub = buffer_pb2_grpc.BufferInternalServiceStub(ch)
    try:
        for ev in stub.WatchWork(buffer_pb2.WatchWorkRequest(watcher_id="fake-scheduler")):
            if stop is not None and stop.is_set():
                return
            if not ev.HasField("added"):
                continue
            it: Any
            for it in ev.added.items:
                if gate is not None:
                    gate.acquire()
                    if stop is not None and stop.is_set():
                        return
                pos, seq = len(it.output_token_ids), it.next_seq
                while pos < length:
                    n = min(chunk, length - pos)
                    reason = common_pb2.FINISH_REASON_STOP if pos + n == length else common_pb2.FINISH_REASON_CHUNK
                    stub.CommitChunk(buffer_pb2.CommitChunkRequest(
                        request_id=it.request_id, seq=seq, token_ids=answer_tokens(it.request_id, n),
                        logprobs=[-0.25] * n, finish_reason=reason, policy_version=it.policy_version))
                    pos, seq = pos + n, seq + 1
    except grpc.RpcError:
        return
    finally:
        ch.close()


def finish_request(address: str, request_id: str, policy_version: int = 0) -> None:
    """Commits a request's whole response (two tokens, STOP) as a scheduler would."""
    with grpc.insecure_channel(address) as ch:
        buffer_pb2_grpc.BufferInternalServiceStub(ch).CommitChunk(buffer_pb2.CommitChunkRequest(
            request_id=request_id, seq=0, token_ids=[7, 8], logprobs=[-0.5, -0.25],
            finish_reason=common_pb2.FINISH_REASON_STOP, policy_version=policy_version), timeout=5)


def batch_submitted(address: str, batch_id: str) -> bool:
    with grpc.insecure_channel(address) as ch:
        try:
            rollout_pb2_grpc.RolloutServiceStub(ch).GetBatch(rollout_pb2.GetBatchRequest(batch_id=batch_id), timeout=2)
            return True
        except grpc.RpcError:
            return False


class Node:
    """rollout.js on batch `batch_id` (2 groups x 2 samples: request ids {batch_id}/{g}/{s}); the
    constructor returns once the batch is submitted. `address`: where the client connects (a proxy
    in front of the buffer), the buffer's own address by default."""

    def __init__(self, script: Path, buffer: Buffer, batch_id: str, *extra: str, address: str = "") -> None:
        self.started = time.monotonic()
        self.proc = subprocess.Popen(
            ["node", str(script), "--address", address or buffer.address, "--groups", "2", "--group-size", "2",
             "--max-tokens", "16", "--batch-id", batch_id, *extra],
            cwd=script.parent, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self.lines: queue.Queue[str] = queue.Queue()
        self.out: list[str] = []
        stdout = self.proc.stdout
        assert stdout is not None

        def read() -> None:
            for line in stdout:
                self.lines.put(line.rstrip("\n"))

        self.reader = threading.Thread(target=read, daemon=True)
        self.reader.start()
        deadline = time.monotonic() + 30
        while not batch_submitted(buffer.address, batch_id):
            assert time.monotonic() < deadline and self.proc.poll() is None, self.drain()
            time.sleep(0.1)

    def drain(self) -> list[str]:
        while True:
            try:
                self.out.append(self.lines.get(timeout=0.05))
            except queue.Empty:
                return self.out

    def wait_results(self, n: int) -> None:
        deadline = time.monotonic() + 30
        while sum(line.startswith("result ") for line in self.out) < n:
            assert time.monotonic() < deadline, self.out
            with contextlib.suppress(queue.Empty):
                self.out.append(self.lines.get(timeout=0.1))

    def finish(self, timeout: float = 60) -> tuple[int, list[str]]:
        try:
            rc = self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            # A hung client (what a test is often for) must not outlive the test.
            self.proc.kill()
            self.proc.wait(5)
            raise AssertionError(f"the node client did not end in {timeout}s: {self.drain()}") from None
        self.reader.join(5)
        return rc, self.drain()


def _ok(rc: int, out: list[str]) -> bool:
    """The run ended 0 with all 4 responses (its last line is `RESULT {json}`)."""
    return rc == 0 and bool(out) and json.loads(out[-1].removeprefix("RESULT ")).get("responses") == 4
