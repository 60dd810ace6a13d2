"""A KV fetch stops when its chunk's RunChunk stream ends (cancelled, or past its deadline).

The worker fetches a chunk's cached prefix from the KV pool before admitting it, inside the
RunChunk handler. The fetch's Gets went on after the stream was cancelled: a kvstore slow to send
the pages kept the stream (and a handler and pool thread) for the whole rpc_timeout_s, for a chunk
nobody would read. Real gRPC on loopback: a worker served with a KVClient, and a kvstore that has
every page (Exists) but sends none (Get, until its call is cancelled or its deadline passes)."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

import grpc
import pytest
from seer.v1 import common_pb2, kvstore_pb2, kvstore_pb2_grpc, worker_pb2, worker_pb2_grpc

from services.common.grpcutil import channel
from services.common.server import ServiceConfig, start_server
from services.worker.core import Worker
from services.worker.engines.reference.engine import ReferenceEngine
from services.worker.kv_client import KVClient
from services.worker.server import add_servicer
from tests.common.grpc_server import loopback_server

# 5 pages no other test runs: none cached in the shared engine, so the chunk fetches them all.
PROMPT = tuple(range(1000, 1080))
RPC_TIMEOUT_S = 8.0  # the fetch's Get deadline: without the cancellation the Get lasts this long


class _SlowKv(kvstore_pb2_grpc.KvStoreServiceServicer):
    """Has every page; its Get sends nothing until the call ends. Records when each Get ended."""

    def __init__(self) -> None:
        self.get_started = threading.Event()
        self.get_ended: list[float] = []

    def Exists(self, request: Any, context: Any) -> kvstore_pb2.ExistsResponse:
        return kvstore_pb2.ExistsResponse(prefix_pages=len(request.page_hashes))

    def Get(self, request: Any, context: Any) -> Iterator[Any]:
        self.get_started.set()
        deadline = time.monotonic() + 30
        while context.is_active() and time.monotonic() < deadline:
            time.sleep(0.02)
        self.get_ended.append(time.monotonic())
        return iter(())

    def Release(self, request: Any, context: Any) -> kvstore_pb2.ReleaseResponse:
        return kvstore_pb2.ReleaseResponse()


@pytest.fixture
def slow_kv() -> Iterator[tuple[_SlowKv, str]]:
    kv = _SlowKv()
    with loopback_server(kvstore_pb2_grpc.add_KvStoreServiceServicer_to_server, kv, max_workers=8) as address:
        yield kv, address


def test_a_fetch_stops_when_its_run_chunk_stream_ends(
    slow_kv: tuple[_SlowKv, str], ref_engine: ReferenceEngine
) -> None:
    kv, address = slow_kv
    pool = KVClient([address], rpc_timeout_s=RPC_TIMEOUT_S, tune_malloc=False)
    worker = Worker(ref_engine, worker_id="w-fetch", kv_pool=pool, kv_offload=False, speculation=False).start()
    running = start_server("worker", ServiceConfig(port=0, grace_seconds=1.0), add_servicer(worker),
                           on_stop=worker.close)
    ch = channel(running.address)
    try:
        stub = worker_pb2_grpc.WorkerServiceStub(ch)
        req = worker_pb2.RunChunkRequest(
            request_id="r-fetch", batch_id="b", group_id="g", prompt_key="k", seq=0,
            prompt_token_ids=PROMPT, max_new_tokens=2, max_tokens=2, fetch_kv=True, group_size=1,
            sampling=common_pb2.SamplingParams(temperature=0.0), policy_version=0,
        )
        t0 = time.monotonic()
        with pytest.raises(grpc.RpcError) as err:
            list(stub.RunChunk(req, timeout=0.5))  # the scheduler gives up on the chunk
        assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        assert kv.get_started.is_set(), "the chunk never fetched"
        deadline = time.monotonic() + RPC_TIMEOUT_S + 2
        while not kv.get_ended and time.monotonic() < deadline:
            time.sleep(0.02)
        assert kv.get_ended, "the Get never ended"
        # Ended with the stream (its deadline + the cancellation poll), not at the fetch's own deadline.
        assert kv.get_ended[0] - t0 < 2.0, kv.get_ended[0] - t0
        # Counted once the handler's fetch returns, which may be after the Get ended: poll.
        deadline = time.monotonic() + 5
        while pool.stats().fetch_cancels < 1 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert pool.stats().fetch_cancels == 1
    finally:
        ch.close()
        running.stop(1.0)
        pool.close()


def test_a_fetch_cancelled_during_its_gets_returns_nothing(slow_kv: tuple[_SlowKv, str],
                                                            ref_engine: ReferenceEngine) -> None:
    """KVClient alone: the Gets end once `cancelled()` turns true; nothing is counted a replica fault."""
    kv, address = slow_kv
    pool = KVClient([address], rpc_timeout_s=RPC_TIMEOUT_S, tune_malloc=False, streams_per_replica=2)
    gone = threading.Event()
    try:
        threading.Timer(0.3, gone.set).start()
        t0 = time.monotonic()
        got = pool.fetch_prefix(PROMPT, ref_engine.model_version, ref_engine.kv_layout,
                                cancelled=gone.is_set)
        took = time.monotonic() - t0
        assert got is None and took < 2.0, took
        deadline = time.monotonic() + 2
        while len(kv.get_ended) < 2 and time.monotonic() < deadline:  # both streams of the replica's share
            time.sleep(0.02)
        assert len(kv.get_ended) == 2 and max(kv.get_ended) - t0 < 2.0
        stats = pool.stats()
        assert stats.fetch_cancels == 1 and stats.replica_errors == 0
    finally:
        pool.close()


def test_a_fetch_cancelled_before_its_gets_is_counted(slow_kv: tuple[_SlowKv, str],
                                                      ref_engine: ReferenceEngine) -> None:
    """The caller gone before the Gets start: nothing fetched, no Get opened, and counted in
    fetch_cancels like a fetch cancelled during its Gets (the early return did not count it)."""
    kv, address = slow_kv
    pool = KVClient([address], rpc_timeout_s=RPC_TIMEOUT_S, tune_malloc=False)
    try:
        got = pool.fetch_prefix(PROMPT, ref_engine.model_version, ref_engine.kv_layout, cancelled=lambda: True)
        assert got is None and not kv.get_started.is_set()
        stats = pool.stats()
        assert stats.fetch_cancels == 1 and stats.replica_errors == 0
    finally:
        pool.close()
