"""Helpers shared by the buffer tests: drive the buffer the way the scheduler does."""

from __future__ import annotations

import hashlib
import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import pytest
from seer.v1 import buffer_pb2, buffer_pb2_grpc, common_pb2, rollout_pb2, rollout_pb2_grpc

from services.buffer import codec
from services.buffer.app import start
from services.buffer.config import BufferConfig
from services.buffer.core import BufferCore
from services.buffer.store import Store
from services.common.server import RunningServer

REPO = Path(__file__).resolve().parents[2]


class Watcher:
    """A WatchWork stream drained by a thread into a queue; `end` is "ok" or (code, details) once
    the stream ended."""

    def __init__(self, stub: buffer_pb2_grpc.BufferInternalServiceStub, name: str, timeout: float | None = None
                 ) -> None:
        self.events: queue.Queue[Any] = queue.Queue()
        self.end: Any = None
        self.stream = stub.WatchWork(buffer_pb2.WatchWorkRequest(watcher_id=name), timeout=timeout)
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        try:
            for ev in self.stream:
                self.events.put(ev)
            self.end = "ok"
        except grpc.RpcError as e:
            self.end = (e.code(), e.details())

    def next(self, timeout: float = 5.0) -> Any:
        return self.events.get(timeout=timeout)

    def close(self) -> None:
        self.stream.cancel()
        self.thread.join(5)


def wait_for(cond: Callable[[], bool], timeout: float = 5.0, poll: float = 0.02) -> bool:
    """Polls cond until it holds or timeout passes; whether it held."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(poll)
    return cond()
WORDS = ["[UNK]", "<eos>", "question", ":", "what", "is", "two", "plus", "three", "answer", "five", "?", "the",
         "cat", "sat", "on", "mat", "."]
TINY_VOCAB = 64  # config.json vocab_size (larger than the tokenizer's word list, as with real models)
TINY_CONTEXT = 48


def write_tiny_model(d: Path) -> Path:
    """A model directory with a real (word-level) tokenizer.json and a config.json."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(d / "tokenizer.json"))
    (d / "config.json").write_text(json.dumps({"vocab_size": TINY_VOCAB, "max_position_embeddings": TINY_CONTEXT}))
    return d
STOP, LENGTH, CHUNK = common_pb2.FINISH_REASON_STOP, common_pb2.FINISH_REASON_LENGTH, common_pb2.FINISH_REASON_CHUNK


@dataclass
class BufferHandle:
    running: RunningServer
    core: BufferCore
    channel: grpc.Channel
    rollout: rollout_pb2_grpc.RolloutServiceStub
    internal: buffer_pb2_grpc.BufferInternalServiceStub
    cfg: BufferConfig

    @property
    def address(self) -> str:
        return self.running.address

    def stop(self) -> None:
        self.channel.close()
        self.running.stop(0)


def start_buffer(cfg: BufferConfig) -> BufferHandle:
    running, core = start(cfg)
    ch = grpc.insecure_channel(running.address)
    return BufferHandle(running, core, ch, rollout_pb2_grpc.RolloutServiceStub(ch),
                        buffer_pb2_grpc.BufferInternalServiceStub(ch), cfg)


def group(**kw: Any) -> rollout_pb2.PromptGroup:
    kw.setdefault("group_size", 2)
    kw.setdefault("max_tokens", 8)
    if "prompt_text" not in kw:
        kw.setdefault("prompt_token_ids", [1, 2, 3])
    return rollout_pb2.PromptGroup(**kw)


def submit(stub: rollout_pb2_grpc.RolloutServiceStub, batch_id: str,
           groups: Iterable[rollout_pb2.PromptGroup], seed_scope: str = "") -> rollout_pb2.SubmitBatchResponse:
    return stub.SubmitBatch(rollout_pb2.SubmitBatchRequest(batch_id=batch_id, groups=list(groups),
                                                           seed_scope=seed_scope), timeout=10)


def snapshot(internal: buffer_pb2_grpc.BufferInternalServiceStub) -> list[buffer_pb2.WorkItem]:
    """The WatchWork snapshot (items before snapshot_done)."""
    stream = internal.WatchWork(buffer_pb2.WatchWorkRequest(watcher_id="test"), timeout=10)
    items = []
    try:
        for ev in stream:
            if ev.HasField("snapshot_done"):
                break
            if ev.HasField("added"):
                items.extend(ev.added.items)
    finally:
        stream.cancel()
    return items


def token_for(request_id: str, position: int) -> int:
    """Deterministic fake generation: the token a request has at an output position."""
    h = hashlib.blake2b(f"{request_id}:{position}".encode(), digest_size=2).digest()
    return 4 + int.from_bytes(h, "little") % 40


def commit(internal: buffer_pb2_grpc.BufferInternalServiceStub, request_id: str, seq: int, tokens: list[int],
           reason: int = CHUNK, version: int = 0, logprobs: list[float] | None = None,
           **kw: Any) -> buffer_pb2.CommitChunkResponse:
    lp = logprobs if logprobs is not None else [-0.5 - 0.01 * t for t in tokens]
    return internal.CommitChunk(buffer_pb2.CommitChunkRequest(
        request_id=request_id, seq=seq, token_ids=tokens, logprobs=lp, finish_reason=reason,
        policy_version=version, worker_id="w0", **kw), timeout=10)


def run_chunk(internal: buffer_pb2_grpc.BufferInternalServiceStub, item: buffer_pb2.WorkItem, seq: int,
              start_pos: int, n: int, total: int, version: int = 0) -> buffer_pb2.CommitChunkResponse:
    """Commits positions [start_pos, start_pos+n) of a response of length `total` (STOP at the end)."""
    tokens = [token_for(item.request_id, p) for p in range(start_pos, start_pos + n)]
    reason = STOP if start_pos + n >= total else CHUNK
    return commit(internal, item.request_id, seq, tokens, reason, version)


def finish_all(internal: buffer_pb2_grpc.BufferInternalServiceStub, items: Iterable[buffer_pb2.WorkItem],
               length: int | Callable[[buffer_pb2.WorkItem], int] = 5, chunk: int = 2) -> None:
    """Runs every item to completion from its resume point (output_token_ids, next_seq)."""
    for it in items:
        pos, seq = len(it.output_token_ids), it.next_seq
        total = length(it) if callable(length) else length
        while pos < total:
            n = min(chunk, total - pos)
            run_chunk(internal, it, seq, pos, n, total, it.policy_version)
            pos, seq = pos + n, seq + 1


def expect_error(fn: Callable[[], Any], code: grpc.StatusCode, field: str | None = None) -> str:
    with pytest.raises(grpc.RpcError) as info:
        fn()
    err: Any = info.value
    assert err.code() == code, (err.code(), err.details())
    if field is not None:
        assert field in err.details(), err.details()
    return str(err.details())


# ---- a real buffer process (for kill -9) ---------------------------------------------------------

class BufferProcess:
    def __init__(self, data_dir: Path, port: int, log_path: Path) -> None:
        self.data_dir, self.port, self.log_path = data_dir, port, log_path
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self, timeout: float = 30.0) -> None:
        port_file = self.data_dir.parent / f"port-{time.monotonic_ns()}"
        env = {**os.environ, "SEER_LOG_LEVEL": "warning"}
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "services.buffer", "--port", str(self.port), "--data-dir", str(self.data_dir),
                 "--model-dir", "", "--grace-seconds", "0", "--port-file", str(port_file)],
                cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout
        while not port_file.exists():
            if self.proc.poll() is not None:
                raise RuntimeError(f"buffer exited {self.proc.returncode}: {self.log_path.read_text()[-2000:]}")
            if time.monotonic() > deadline:
                raise TimeoutError("buffer did not start")
            time.sleep(0.05)

    def kill9(self) -> None:
        assert self.proc is not None
        os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.wait(10)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)


def policy_event(internal: buffer_pb2_grpc.BufferInternalServiceStub) -> buffer_pb2.PolicyState:
    """The PolicyState event that opens every WatchWork snapshot."""
    stream = internal.WatchWork(buffer_pb2.WatchWorkRequest(watcher_id="test"), timeout=10)
    try:
        first = next(iter(stream))
    finally:
        stream.cancel()
    assert first.HasField("policy"), first
    return first.policy


def edit_record(data_dir: Path, key: bytes, change: Callable[[dict[str, Any]], object]) -> None:
    """Rewrites a codec record of a stopped buffer's store with change() applied to its JSON fields."""
    store = Store(data_dir)
    try:
        raw = store.get(key)
        assert raw is not None, key
        meta, arrays = codec.decode(raw)
        change(meta)
        wb = store.new_batch()
        wb.put(key, codec.encode(meta, arrays))
        store.write(wb)
    finally:
        store.close()


def put_raw(data_dir: Path, key: bytes, value: bytes | None) -> None:
    """Writes (None: deletes) one raw value in a stopped buffer's store."""
    store = Store(data_dir)
    try:
        wb = store.new_batch()
        if value is None:
            wb.delete(key)
        else:
            wb.put(key, value)
        store.write(wb)
    finally:
        store.close()
