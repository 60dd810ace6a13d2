"""SeerHiCacheStorage (SGLang's L3 tier over the Seer KV store) against real gRPC on loopback, with
SGLang's HiCacheStorage base stubbed (SGLang cannot be imported here)."""

from __future__ import annotations

import contextlib
import sys
import threading
import time
import types
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from tests.common.grpc_server import loopback_server


@pytest.fixture
def storage_cls(monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    hs = types.ModuleType("sglang.srt.mem_cache.hicache_storage")
    for name in ("HiCacheStorage", "HiCacheStorageConfig", "HiCacheStorageExtraInfo"):
        setattr(hs, name, type(name, (), {}))
    for name in ("sglang", "sglang.srt", "sglang.srt.mem_cache"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    monkeypatch.setitem(sys.modules, "sglang.srt.mem_cache.hicache_storage", hs)
    # Imported over the stand-in for this test only (removed again at teardown).
    monkeypatch.setitem(sys.modules, "services.worker.engines.sglang.storage", types.ModuleType("stand-in"))
    del sys.modules["services.worker.engines.sglang.storage"]
    from services.worker.engines.sglang.storage import SeerHiCacheStorage

    yield SeerHiCacheStorage


def _kv_node(servicer: Any) -> contextlib.AbstractContextManager[str]:
    """Serves `servicer` as a KV store node on a loopback port (the context yields its address)."""
    from seer.v1 import kvstore_pb2_grpc

    return loopback_server(kvstore_pb2_grpc.add_KvStoreServiceServicer_to_server, servicer)


@pytest.fixture
def silent_node() -> Iterator[str]:
    """A KV store node that takes RPCs and never answers (hung: a GC pause, a stuck disk)."""

    import grpc
    from seer.v1 import kvstore_pb2_grpc

    release = threading.Event()

    class Hung(kvstore_pb2_grpc.KvStoreServiceServicer):  # type: ignore[misc]
        def Exists(self, request: Any, context: Any) -> Any:
            release.wait(30)
            context.abort(grpc.StatusCode.UNAVAILABLE, "hung")

        def Put(self, request_iterator: Any, context: Any) -> Any:
            release.wait(30)
            context.abort(grpc.StatusCode.UNAVAILABLE, "hung")

    try:
        with _kv_node(Hung()) as address:
            yield address
    finally:
        release.set()


def test_a_silent_node_costs_one_short_deadline_then_is_skipped(storage_cls: Any, silent_node: str) -> None:
    """MEDIUM-LOW (review 3): each RPC waited 10 s, node after node. SGLang joins its storage
    threads with timeout=10 on a cache flush (after a weight update) and then raises in its
    scheduler loop (cache_controller.py:483-531): one silent store node crashed SGLang. Now an RPC
    has a short deadline and a failed node is skipped for a while (its pages are misses)."""
    s = storage_cls(SimpleNamespace(extra_config={"kv_addresses": [silent_node]}, tp_rank=0, tp_size=1))
    t0 = time.monotonic()
    assert s.batch_exists(["a", "b"]) == 0
    first = time.monotonic() - t0
    assert first < 3.0, f"one RPC to a silent node took {first:.1f}s"
    t0 = time.monotonic()
    assert s.batch_exists(["a"]) == 0 and s.batch_set(["a"], [torch.zeros(4)]) is False
    assert time.monotonic() - t0 < 0.5  # skipped: no RPC
    now = time.monotonic()
    s._clock = lambda: now + 3600  # the skip has run out: the node is tried again
    assert s._usable(silent_node)


def test_the_flat_page_template_is_taken_once(storage_cls: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """LOW (review 3): batch_get_v1 asked SGLang's pool for a dummy flat page per page, and SGLang
    allocates a fresh (pinned) tensor each time (mem_cache/pool_host/mha.py:727-733)."""
    s = storage_cls(SimpleNamespace(extra_config={"kv_addresses": ["127.0.0.1:1"]}, tp_rank=0, tp_size=1))
    made, written = [], {}

    class Pool:
        page_size = 2

        def get_dummy_flat_data_page(self) -> torch.Tensor:
            made.append(1)
            return torch.zeros(6, dtype=torch.float32)

        def set_from_flat_data_page(self, index: int, page: torch.Tensor) -> None:
            written[index] = page.tolist()

    s.mem_pool_host = Pool()
    pages = [torch.full((6,), float(i)).numpy().tobytes() for i in range(3)]
    monkeypatch.setattr(s, "_get_pages", lambda keys: pages)
    assert s.batch_get_v1(["a", "b", "c"], torch.arange(6)) == [True, True, True]
    assert len(made) == 1
    assert written == {0: [0.0] * 6, 2: [1.0] * 6, 4: [2.0] * 6}


def test_a_host_pool_without_a_known_layout_is_a_miss_not_an_exception(
        storage_cls: Any, caplog: pytest.LogCaptureFixture) -> None:
    """L (review): _layout() read MHA attributes unguarded; an MLA host pool (no head_num) or an
    unknown dtype raised on SGLang's prefetch/backup threads. Now every page is a miss, logged once."""
    s = storage_cls(SimpleNamespace(extra_config={"kv_addresses": ["127.0.0.1:1"]}, tp_rank=0, tp_size=1))
    mla = SimpleNamespace(dtype=torch.bfloat16, page_size=4, layer_num=2, layout="layer_first",
                          kv_lora_rank=8, qk_rope_head_dim=4)  # MLAHostPool: no head_num / head_dim
    s.mem_pool_host = mla
    idx = torch.arange(8)
    with caplog.at_level("WARNING"):
        assert s.batch_get_v1(["a", "b"], idx) == [False, False]
        assert s.batch_set_v1(["a", "b"], idx) == [False, False]
        assert s.get("a") is None and s.set("a", torch.zeros(4)) is False
    assert sum("no usable page layout" in r.getMessage() for r in caplog.records) == 1


@pytest.fixture
def slow_node() -> Iterator[str]:
    """A KV store node that is alive but busy: it streams every page asked for, 70 ms apart."""

    from seer.v1 import kvstore_pb2, kvstore_pb2_grpc

    from services.kvstore.checksum import page_checksum

    class Slow(kvstore_pb2_grpc.KvStoreServiceServicer):  # type: ignore[misc]
        def Get(self, request: Any, context: Any) -> Iterator[Any]:
            for h in request.page_hashes:
                time.sleep(0.07)
                data = bytes(_PAGE_BYTES)
                yield kvstore_pb2.GetResponse(page_hash=h, data=data, checksum=page_checksum(data))

    with _kv_node(Slow()) as address:
        yield address


# A host pool page: K and V x 2 layers x 16 tokens x 4 heads x 64 dims x float32 = 64 KiB.
_POOL = SimpleNamespace(dtype=torch.float32, page_size=16, layer_num=2, head_num=4, head_dim=64, layout="layer_first")
_PAGE_BYTES = 2 * 2 * 16 * 4 * 64 * 4


def test_a_large_batch_from_a_slow_but_alive_node_is_neither_cut_off_nor_skipped(
        storage_cls: Any, slow_node: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """LOW (review 4): one 1.5 s deadline covered a whole batch of up to 128 pages (~256 MiB for an
    8B GQA model), so a healthy busy node hit DEADLINE_EXCEEDED and was skipped for 10 s: L3
    flapped. The deadline now grows with the bytes (at a floor bandwidth, scaled down here to this
    test's 2 MiB), and a stream still moving when its deadline runs out does not open the circuit."""
    import services.worker.engines.sglang.storage as st

    monkeypatch.setattr(st, "_FLOOR_BYTES_PER_S", 1e6)  # 32 pages: 1.5 s + ~2.1 s
    s = storage_cls(SimpleNamespace(extra_config={"kv_addresses": [slow_node]}, tp_rank=0, tp_size=1))
    s.mem_pool_host = _POOL
    keys = [f"k{i}" for i in range(32)]  # ~2.2 s of streaming: past a fixed 1.5 s
    got = s._get_pages(keys)
    assert sum(p is not None for p in got) == 32
    assert s._usable(slow_node)
    # Slower than even its deadline, but moving: the pages it sent are kept, the rest are misses,
    # and the node stays in use (a slow node is not a dead one).
    monkeypatch.setattr(st, "_MAX_TIMEOUT_S", 1.0)
    got = s._get_pages(keys)
    assert 0 < sum(p is not None for p in got) < 32
    assert s._usable(slow_node) and not s._down_until


@pytest.fixture
def slow_nodes() -> Iterator[list[str]]:
    """Two KV store nodes that are alive but very busy: each streams the pages asked for, 0.3 s apart."""
    from seer.v1 import kvstore_pb2, kvstore_pb2_grpc

    from services.kvstore.checksum import page_checksum

    class Slow(kvstore_pb2_grpc.KvStoreServiceServicer):  # type: ignore[misc]
        def Get(self, request: Any, context: Any) -> Iterator[Any]:
            for h in request.page_hashes:
                if not context.is_active():
                    return
                time.sleep(0.3)
                data = bytes(_PAGE_BYTES)
                yield kvstore_pb2.GetResponse(page_hash=h, data=data, checksum=page_checksum(data))

    with contextlib.ExitStack() as stack:
        yield [stack.enter_context(_kv_node(Slow())) for _ in range(2)]


def test_two_slow_nodes_share_one_call_deadline(
        storage_cls: Any, slow_nodes: list[str], monkeypatch: pytest.MonkeyPatch) -> None:
    """Final read: nodes are asked one after another, each up to _MAX_TIMEOUT_S (6 s), so two
    slow-but-moving nodes held one batch call 12 s, past SGLang's 10 s join of its storage threads.
    Now the call has one overall deadline (_CALL_S, 8 s) and a node gets only the time left."""
    import services.worker.engines.sglang.storage as st

    monkeypatch.setattr(st, "_FLOOR_BYTES_PER_S", 1e3)  # every node's own deadline is the 6 s cap
    s = storage_cls(SimpleNamespace(extra_config={"kv_addresses": slow_nodes}, tp_rank=0, tp_size=1))
    s.mem_pool_host = _POOL
    keys = [f"k{i}" for i in range(120)]
    split = s._by_node([st.page_hash(k) for k in keys])
    assert len(split) == 2 and min(len(i) for i in split.values()) * 0.3 > st._MAX_TIMEOUT_S  # both run out
    t0 = time.monotonic()
    got = s._get_pages(keys)
    took = time.monotonic() - t0
    assert took < 9.0, f"one batch call took {took:.1f}s"  # _CALL_S (8 s) and slack
    # Both nodes were asked and were moving: their pages so far are kept, neither is skipped.
    for idx in split.values():
        assert any(got[i] is not None for i in idx)
    assert all(s._usable(n) for n in slow_nodes)
