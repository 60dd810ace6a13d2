"""SeerHiCacheStorage: SGLang's HiCache L3 tier backed by the Seer KV store (DESIGN.md section 5).

Loaded by SGLang itself in its scheduler process:

    --enable-hierarchical-cache --hicache-storage-backend dynamic
    --hicache-storage-backend-extra-config '{"backend_name": "seer",
        "module_path": "services.worker.engines.sglang.storage", "class_name": "SeerHiCacheStorage",
        "kv_addresses": ["kvstore-0:50061"], "family": "smollm2", "version_file": "/run/seer/version",
        "interface_v1": 1}'

SGLang 0.5.23 (pinned) constructs it as `SeerHiCacheStorage(storage_config, kwargs)`
(mem_cache/storage/backend_factory.py:165) and calls register_mem_pool_host with its host pool
(managers/cache_controller.py:617). With "interface_v1": 1 in the extra config (the worker sets it)
pages move between that pool and the store with batch_get_v1 / batch_set_v1 (zero copy of whole
pages by host index); without it SGLang falls back to batch_get / batch_set of flat pages
(cache_controller.py:646-665), which this class serves too. batch_exists gives the longest stored
prefix (cache_controller.py:1323). Keys map to the store through services.worker.engines.sglang.pages;
SGLang seeds them with the request's extra_key (mem_cache/utils.py:125-150). Every failure is a
miss (SGLang recomputes), never an exception on SGLang's prefetch/backup threads, which would
disable L3 for the process.

This module imports sglang and torch at import time: only SGLang loads it.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import grpc
import torch
from seer.v1 import kvstore_pb2, kvstore_pb2_grpc
from sglang.srt.mem_cache.hicache_storage import (  # type: ignore[import-not-found]
    HiCacheStorage,
    HiCacheStorageConfig,
    HiCacheStorageExtraInfo,
)

from services.common.grpcutil import channel
from services.kvstore.checksum import page_checksum
from services.kvstore.ring import HashRing
from services.worker.engines.sglang.pages import VersionFile, namespace, page_hash, page_layout

log = logging.getLogger(__name__)

# RPC deadlines. SGLang stops its storage threads (on a cache flush, e.g. after a weight update) by
# joining each with timeout=10 and then RAISES from reset() (managers/cache_controller.py:483-531,
# 815-818), in its scheduler loop with no try around it (scheduler.py:2253): a thread stuck behind
# 10 s RPCs to a silent node, one node after another, crashed the scheduler. So deadlines are short
# and a dead node is skipped (_SKIP_S). But one Get/Put carries up to STORAGE_BATCH_SIZE = 128 pages
# (mem_cache/hicache_storage.py:24) of (2, layers, page_size, kv heads, head_dim) each
# (pool_host/mha.py:727-733): ~2 MiB a page for an 8B GQA model at page size 16, 256 MiB a call, which
# a fixed 1.5 s cut off on a healthy busy node (and then skipped it: L3 flapped). The deadline grows
# with the bytes moved:
# _BASE_S: a call's fixed part (a round trip, the store's lookup / RocksDB write); also all a silent
# node costs before it is skipped.
_BASE_S = 1.5
# The slowest transfer a healthy node is assumed to sustain, bytes/s: far below a datacenter NIC
# (10 GbE ~1.2 GB/s) or RocksDB's sequential write, so a busy node keeps well inside its deadline.
_FLOOR_BYTES_PER_S = 200e6
# The most one RPC may take: 256 MiB at the floor is 1.5 + 1.34 s.
_MAX_TIMEOUT_S = 6.0
# The most one batch call (_get_pages, _put_pages, batch_exists: one SGLang thread's) may take in
# all. Nodes are asked one after another, so per-node deadlines alone add up: two slow-but-moving
# nodes at _MAX_TIMEOUT_S each passed SGLang's 10 s join. Each node gets the smaller of its own
# deadline and the time this call has left; a node reached with none left is not asked (misses).
_CALL_S = 8.0
# A node that failed an RPC is skipped (its pages are misses, its puts fail) for this long.
_SKIP_S = 10.0
# The failures that open the circuit: the node is unreachable, or it let a whole deadline pass
# without moving anything. A stream that was still moving when its deadline ran out is a slow node,
# not a dead one: its missing pages are misses and the node stays in use.
_DEAD = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)


def _deadline(nbytes: int) -> float:
    """The deadline of one RPC moving `nbytes` of pages."""
    return min(_MAX_TIMEOUT_S, _BASE_S + nbytes / _FLOOR_BYTES_PER_S)


def _call_end() -> float:
    """When a batch call that starts now must be done (time.monotonic)."""
    return time.monotonic() + _CALL_S


def _within(end: float, timeout: float) -> float:
    """An RPC's timeout: its own, cut to the time left before the call's `end` (0 when none)."""
    return max(0.0, min(timeout, end - time.monotonic()))


class SeerHiCacheStorage(HiCacheStorage):  # type: ignore[misc]
    def __init__(self, storage_config: HiCacheStorageConfig, kwargs: dict[str, Any] | None = None) -> None:
        extra = dict(storage_config.extra_config or {})
        addresses = list(extra.get("kv_addresses") or [])
        if not addresses:
            raise ValueError("kv_addresses: the seer HiCache backend needs at least one KV store address")
        self.family = str(extra.get("family") or "model")
        self.version_file = VersionFile(str(extra["version_file"])) if extra.get("version_file") else None
        self.default_version = int(extra.get("policy_version", 0))
        self.tp_rank = int(storage_config.tp_rank)
        self.tp_size = int(storage_config.tp_size)
        self.ring = HashRing(addresses, 64)
        self._stubs = {a: kvstore_pb2_grpc.KvStoreServiceStub(channel(a)) for a in self.ring.nodes}
        self.mem_pool_host: Any = None
        self._layout_pb: kvstore_pb2.PageLayout | None = None
        self._page_bytes = 0
        self._layout_error_logged = False
        self._flat_page: torch.Tensor | None = None  # the host pool's flat page shape and dtype
        self._down_until: dict[str, float] = {}  # node -> monotonic time it is skipped until
        self._down_lock = threading.Lock()  # SGLang's prefetch and backup threads share it
        self._clock: Callable[[], float] = time.monotonic

    # -- helpers -----------------------------------------------------------------------------

    def _namespace(self) -> str:
        if self.version_file is None:
            return namespace(self.family, self.default_version, self.tp_rank, self.tp_size)
        v, family = self.version_file.read_both(self.default_version, self.family)
        return namespace(family, v, self.tp_rank, self.tp_size)

    def _layout(self) -> kvstore_pb2.PageLayout:
        if self._layout_pb is None:
            pool = self.mem_pool_host
            lay = page_layout(
                dtype=str(pool.dtype).replace("torch.", ""), page_size=int(pool.page_size),
                num_layers=int(pool.layer_num), num_kv_heads=int(pool.head_num), head_dim=int(pool.head_dim),
                mem_layout=str(pool.layout), tp_rank=self.tp_rank, tp_size=self.tp_size,
            )
            # _page_bytes first: another of SGLang's threads that sees _layout_pb set skips this
            # block and must find the page size already there (0 would make every page a miss).
            self._page_bytes = lay.page_bytes
            self._layout_pb = kvstore_pb2.PageLayout(dtype=lay.dtype, page_size=lay.page_size,
                                                     num_layers=lay.num_layers, num_kv_heads=lay.num_kv_heads,
                                                     head_dim=lay.head_dim, layout=lay.layout)
        return self._layout_pb

    def _layout_or_none(self) -> kvstore_pb2.PageLayout | None:
        """The layout, or None when this host pool has none the store knows (an MLA pool has no
        head_num, a dtype without a known width): every page is then a miss. Raising would reach
        SGLang's prefetch/backup threads. Logged once per process."""
        try:
            return self._layout()
        except Exception as e:
            if not self._layout_error_logged:
                self._layout_error_logged = True
                log.warning("seer hicache disabled: host pool %s has no usable page layout: %s",
                            type(self.mem_pool_host).__name__, e)
            return None

    def _usable(self, node: str) -> bool:
        """False while a node that failed recently is skipped (circuit open)."""
        with self._down_lock:
            until = self._down_until.get(node)
            if until is None:
                return True
            if self._clock() >= until:
                del self._down_until[node]  # tried again (one RPC decides whether it stays skipped)
                return True
            return False

    def _failed(self, node: str, op: str, e: grpc.RpcError, moved: int = 0) -> None:
        """Opens the node's circuit on a dead node's failure (_DEAD with nothing moved); other
        failures only lose this call's pages."""
        code = e.code()
        if code not in _DEAD or (code == grpc.StatusCode.DEADLINE_EXCEEDED and moved > 0):
            log.warning("seer hicache %s failed on %s: %s after %d pages; the node stays in use", op, node, code,
                        moved)
            return
        with self._down_lock:
            self._down_until[node] = self._clock() + _SKIP_S
        log.warning("seer hicache %s failed on %s: %s; skipping the node for %.0fs", op, node, e.code(), _SKIP_S)

    def _by_node(self, hashes: Sequence[bytes]) -> dict[str, list[int]]:
        out: dict[str, list[int]] = {}
        for i, h in enumerate(hashes):
            out.setdefault(self.ring.node_for(h), []).append(i)
        return out

    def _get_pages(self, keys: Sequence[str]) -> list[bytes | None]:
        found: list[bytes | None] = [None] * len(keys)
        layout = self._layout_or_none()
        if layout is None:
            return found
        hashes = [page_hash(k) for k in keys]
        ns, end = self._namespace(), _call_end()
        for node, idx in self._by_node(hashes).items():
            timeout = _within(end, _deadline(len(idx) * self._page_bytes))
            if timeout <= 0 or not self._usable(node):
                continue
            req = kvstore_pb2.GetRequest(namespace=ns, page_hashes=[hashes[i] for i in idx], layout=layout)
            received = 0
            try:
                for i, msg in zip(idx, self._stubs[node].Get(req, timeout=timeout), strict=False):
                    received += 1
                    ok = not msg.missing and len(msg.data) == self._page_bytes
                    if ok and page_checksum(msg.data) == msg.checksum:
                        found[i] = msg.data
            except grpc.RpcError as e:
                self._failed(node, "get", e, received)
        return found

    def _put_pages(self, keys: Sequence[str], datas: Sequence[bytes]) -> list[bool]:
        layout = self._layout_or_none()
        if layout is None:
            return [False] * len(keys)
        hashes = [page_hash(k) for k in keys]
        ns, ok, end = self._namespace(), [False] * len(keys), _call_end()
        for node, idx in self._by_node(hashes).items():
            timeout = _within(end, _deadline(sum(len(datas[i]) for i in idx)))
            if timeout <= 0 or not self._usable(node):
                continue
            pulled = [0]  # requests gRPC took from the stream

            def stream(idx: list[int] = idx, pulled: list[int] = pulled) -> Iterator[kvstore_pb2.PutRequest]:
                for i in idx:
                    pulled[0] += 1
                    yield kvstore_pb2.PutRequest(namespace=ns, layout=layout, page_hash=hashes[i], data=datas[i],
                                                 checksum=page_checksum(datas[i]))
            try:
                self._stubs[node].Put(stream(), timeout=timeout)
                for i in idx:
                    ok[i] = True
            except grpc.RpcError as e:
                # gRPC takes the next request once the previous one was sent: pages beyond the first
                # taken mean the node was receiving.
                self._failed(node, "put", e, max(0, pulled[0] - 1))
        return ok

    # -- the v1 zero-copy interface (whole pages by host index) -------------------------------

    def batch_exists(self, keys: list[str], extra_info: HiCacheStorageExtraInfo | None = None) -> int:
        if not keys:
            return 0
        hashes = [page_hash(k) for k in keys]
        ns, n, end = self._namespace(), len(keys), _call_end()
        for node, idx in self._by_node(hashes).items():
            have = 0
            timeout = _within(end, _BASE_S)
            if timeout > 0 and self._usable(node):
                try:
                    have = self._stubs[node].Exists(
                        kvstore_pb2.ExistsRequest(namespace=ns, page_hashes=[hashes[i] for i in idx]),
                        timeout=timeout,
                    ).prefix_pages
                except grpc.RpcError as e:
                    self._failed(node, "exists", e)
            if have < len(idx):
                n = min(n, idx[have])
        return n

    def batch_get_v1(self, keys: list[str], host_indices: torch.Tensor,
                     extra_info: HiCacheStorageExtraInfo | None = None) -> list[bool]:
        pool = self.mem_pool_host
        page = int(pool.page_size)
        out: list[bool] = []
        for i, data in enumerate(self._get_pages(keys)):
            if data is None:
                out.append(False)
                continue
            if self._flat_page is None:
                # Once: SGLang's dummy page is a freshly allocated (pinned) tensor per call
                # (mem_cache/pool_host/mha.py:727-733); only its shape and dtype are needed.
                self._flat_page = pool.get_dummy_flat_data_page()
            dummy = self._flat_page
            flat = torch.frombuffer(bytearray(data), dtype=dummy.dtype).view(dummy.shape)
            pool.set_from_flat_data_page(int(host_indices[i * page].item()), flat)
            out.append(True)
        return out

    def batch_set_v1(self, keys: list[str], host_indices: torch.Tensor,
                     extra_info: HiCacheStorageExtraInfo | None = None) -> list[bool]:
        if self._layout_or_none() is None:
            return [False] * len(keys)  # before copying the pages out
        pool = self.mem_pool_host
        page = int(pool.page_size)
        datas = [
            pool.get_data_page(int(host_indices[i * page].item()), flat=True).contiguous().view(torch.uint8)
            .cpu().numpy().tobytes()
            for i in range(len(keys))
        ]
        return self._put_pages(keys, datas)

    # -- the key/value interface -------------------------------------------------------------

    def get(self, key: str, target_location: Any = None, target_sizes: Any = None) -> torch.Tensor | None:
        data = self._get_pages([key])[0]
        if data is None:
            return None
        if target_location is not None:
            buf = target_location.view(torch.uint8).reshape(-1)
            buf.copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))
            return target_location  # type: ignore[no-any-return]
        return torch.frombuffer(bytearray(data), dtype=torch.uint8)

    def batch_get(self, keys: list[str], target_locations: Any = None, target_sizes: Any = None) -> list[Any]:
        locs = target_locations or [None] * len(keys)
        return [self.get(k, loc) for k, loc in zip(keys, locs, strict=True)]

    def set(self, key: str, value: Any = None, target_location: Any = None, target_sizes: Any = None) -> bool:
        if value is None:
            return False
        return self._put_pages([key], [value.contiguous().view(torch.uint8).cpu().numpy().tobytes()])[0]

    def batch_set(self, keys: list[str], values: Any = None, target_locations: Any = None,
                  target_sizes: Any = None) -> bool:
        if values is None:
            return False
        datas = [v.contiguous().view(torch.uint8).cpu().numpy().tobytes() for v in values]
        return all(self._put_pages(keys, datas))

    def exists(self, key: str) -> bool:
        return self.batch_exists([key]) == 1
