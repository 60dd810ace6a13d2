"""The worker's client of the global KV cache pool (services/kvstore), sharded over N replicas.

Use (DESIGN.md section 3, steps 3-4):

    kv = KVClient(["kvstore-0:50054", "kvstore-1:50054"])
    # chunk start: pull the stored prefix the local prefix cache lacks (no re-prefill after a move)
    pages = kv.fetch_prefix(tokens, engine.model_version, engine.kv_layout,
                            min_tokens=engine.cached_prefix_tokens(tokens))
    if pages is not None:
        engine.import_kv(pages)
    # chunk end: offload only the pages not stored yet (start_page = pages already offloaded),
    # in the background; the next decode step does not wait
    kv.offload_async(engine.export_kv(tokens, start_page=stored_pages), request_id)
    # request finished
    kv.release(engine.model_version, request_id)

Pages are placed by a consistent-hash ring over their page hash (services.kvstore.ring). Every
failure is a cache miss, never an error of the rollout and never wrong KV: a replica that is down or
slow (UNAVAILABLE / DEADLINE_EXCEEDED) makes its pages missing; fetch_prefix stops at the first page
that is missing or fails its checksum and returns the prefix before it (the engine recomputes the rest);
each case is counted in stats().

Throughput (services/kvstore/README.md, "Page throughput"): Put and Get messages go through
services.kvstore.wire (one page copy fewer each way than the generated classes; the server answers a Get with the
stored Put frame), page checksums by XXH3 (services.kvstore.checksum), a replica's share over `streams_per_replica`
concurrent streams, and the constructor tunes glibc malloc for page-sized buffers
(`tune_malloc=False` leaves the process as it is).
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import asdict, dataclass
from typing import Protocol, TypeVar

import grpc
from seer.v1 import kvstore_pb2, kvstore_pb2_grpc

from services.common import memtune
from services.common.errors import InvalidArgument
from services.common.grpcutil import channel
from services.common.log import get_logger, kv
from services.common.pagehash import chain_hashes
from services.kvstore.checksum import page_checksum
from services.kvstore.ring import HashRing
from services.kvstore.wire import GetMessage, decode_get, encode_put
from services.worker.engine import KVLayout, KVPages
from services.worker.ports import PutResult

log = get_logger(__name__)

T = TypeVar("T")

_SERVICE = "/" + kvstore_pb2.DESCRIPTOR.services_by_name["KvStoreService"].full_name
_PUT_METHOD = _SERVICE + "/Put"
_GET_METHOD = _SERVICE + "/Get"


def split_even(items: Sequence[T], parts: int) -> list[Sequence[T]]:
    """items cut into at most `parts` contiguous, non-empty runs of nearly equal length."""
    if not items:
        return []
    parts = max(1, min(parts, len(items)))
    q, r = divmod(len(items), parts)
    out: list[Sequence[T]] = []
    start = 0
    for k in range(parts):
        end = start + q + (1 if k < r else 0)
        out.append(items[start:end])
        start = end
    return out


# How long a Get fan-out waits past its streams' common deadline (their own DEADLINE_EXCEEDED,
# which keeps the pages received, must come first).
_GET_GRACE_S = 0.25


class _FanOutTimeout(grpc.RpcError):  # type: ignore[misc]
    """A replica's call that did not end within its fan-out's deadline (it may not even have
    started: its pool was busy with calls to a hung replica). Read like the RPC's own
    DEADLINE_EXCEEDED."""

    def __init__(self, timeout: float) -> None:
        self._details = f"no answer within the fan-out's {timeout:g} s"
        super().__init__(self._details)

    def code(self) -> grpc.StatusCode:
        return grpc.StatusCode.DEADLINE_EXCEEDED

    def details(self) -> str:
        return self._details


# How often a fetch looks at its caller's `cancelled` (the RunChunk stream was cancelled, the chunk
# aborted) while its Get streams run.
_CANCEL_POLL_S = 0.05


class _GetStream(Protocol):
    """One Get call as the fetch uses it (grpc's call iterator): its decoded pages, and a cancel."""

    def __iter__(self) -> Iterator[GetMessage]: ...

    def cancel(self) -> bool: ...


class _GetRpc(Protocol):
    """A replica's Get method (a unary-stream callable over services.kvstore.wire's decoder)."""

    def __call__(self, request: kvstore_pb2.GetRequest, /, timeout: float | None = None) -> _GetStream: ...


class _GetCalls:
    """The Get streams of one fetch, so that a cancelled fetch ends all of them, those started
    after the cancellation too (cancelled as they start)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._calls: set[_GetStream] = set()
        self.cancelled = False

    def add(self, call: _GetStream) -> None:
        with self._lock:
            if not self.cancelled:
                self._calls.add(call)
                return
        call.cancel()

    def discard(self, call: _GetStream) -> None:
        with self._lock:
            self._calls.discard(call)

    def cancel(self) -> None:
        with self._lock:
            self.cancelled = True
            calls, self._calls = list(self._calls), set()
        for call in calls:
            call.cancel()

    def watch(self, cancelled: Callable[[], bool], done: threading.Event) -> None:
        """Until `done`: cancels the streams once `cancelled()` (a thread of its own: the fetch's
        caller is blocked in the fan-out, possibly on a replica that sends nothing)."""
        while not done.wait(_CANCEL_POLL_S):
            if cancelled():
                self.cancel()
                return


# Status codes that mean "this replica cannot help right now": degrade to recompute.
_DEGRADE = {
    grpc.StatusCode.UNAVAILABLE,
    grpc.StatusCode.DEADLINE_EXCEEDED,
    grpc.StatusCode.CANCELLED,
    grpc.StatusCode.INTERNAL,
    grpc.StatusCode.UNKNOWN,
    grpc.StatusCode.DATA_LOSS,
    # A namespace superseded by a newer weight version (the pages are useless anyway), or a late
    # offload of a request already released (no one would release its pages).
    grpc.StatusCode.FAILED_PRECONDITION,
    # The replica's SSD tier is full, or all its page streams are busy: it cannot take pages now.
    # (A page over its message limit is refused so too: a deployment mismatch, logged per call.)
    grpc.StatusCode.RESOURCE_EXHAUSTED,
}


@dataclass
class KVClientStats:
    put_pages: int = 0  # pages sent to the store
    put_bytes: int = 0  # page bytes actually sent
    stored_pages: int = 0  # pages the replicas did not have yet
    claimed_pages: int = 0  # pages already stored: only ownership sent, not the bytes
    put_failures: int = 0  # pages whose offload failed (replica down/slow, stale version)
    offloads_dropped: int = 0  # offload_async calls dropped: max_pending_offloads were in flight
    fetch_calls: int = 0
    fetch_hits: int = 0  # fetch_prefix calls that returned at least one page
    fetched_pages: int = 0
    fetched_bytes: int = 0
    missing_pages: int = 0  # a fetch stopped at a page the store no longer had (recompute from there)
    checksum_failures: int = 0  # a fetch stopped at a page whose bytes failed their checksum (recompute)
    replica_errors: int = 0  # RPCs that failed and were degraded to a miss
    released_pages: int = 0
    fetch_cancels: int = 0  # fetches whose caller gave up before or while their Gets ran


def layout_to_pb(layout: KVLayout) -> kvstore_pb2.PageLayout:
    """The page layout as the wire message."""
    return kvstore_pb2.PageLayout(
        dtype=layout.dtype,
        page_size=layout.page_size,
        num_layers=layout.num_layers,
        num_kv_heads=layout.num_kv_heads,
        head_dim=layout.head_dim,
        layout=layout.layout,
    )


class KVClient:
    def __init__(
        self,
        addresses: Sequence[str],
        *,
        vnodes: int = 64,
        rpc_timeout_s: float = 10.0,
        exists_timeout_s: float = 2.0,
        max_pending_offloads: int = 8,
        streams_per_replica: int = 2,
        tune_malloc: bool = True,
        malloc_arenas: int | None = None,
        max_concurrent_fetches: int = 16,
    ) -> None:
        if max_pending_offloads < 1:
            raise InvalidArgument(f"must be >= 1, got {max_pending_offloads}", field="max_pending_offloads")
        if streams_per_replica < 1:
            raise InvalidArgument(f"must be >= 1, got {streams_per_replica}", field="streams_per_replica")
        if max_concurrent_fetches < 1:
            raise InvalidArgument(f"must be >= 1, got {max_concurrent_fetches}", field="max_concurrent_fetches")
        if malloc_arenas is not None and malloc_arenas < 1:
            raise InvalidArgument(f"must be >= 1, got {malloc_arenas}", field="malloc_arenas")
        if tune_malloc:
            # Page buffers churn through glibc's mmap/munmap otherwise (services/common/memtune.py).
            memtune.tune_malloc(arenas=malloc_arenas)
        self.streams_per_replica = streams_per_replica
        self.ring = HashRing(list(addresses), vnodes)
        self.max_pending_offloads = max_pending_offloads
        self._pending = 0  # offloads queued or running
        self.rpc_timeout_s = rpc_timeout_s
        self.exists_timeout_s = exists_timeout_s
        self._channels = {a: channel(a) for a in self.ring.nodes}
        self._stubs = {a: kvstore_pb2_grpc.KvStoreServiceStub(ch) for a, ch in self._channels.items()}
        # Put and Get carry the pages: (de)serialized by services.kvstore.wire (same wire format as
        # the generated classes, fewer page copies). Put takes requests already serialized.
        self._put_rpc = {
            a: ch.stream_unary(
                _PUT_METHOD, request_serializer=None, response_deserializer=kvstore_pb2.PutResponse.FromString
            )
            for a, ch in self._channels.items()
        }
        self._get_rpc: dict[str, _GetRpc] = {
            a: ch.unary_stream(
                _GET_METHOD,
                request_serializer=kvstore_pb2.GetRequest.SerializeToString,
                response_deserializer=decode_get,
            )
            for a, ch in self._channels.items()
        }
        # One offload thread: offloads of a worker run in order and never block its decode loop.
        self._offload = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kv-offload")
        # Fan-out to replicas in parallel (one call per replica per operation). Offloads have their
        # own pool so a large offload never delays the fetch at the start of the next chunk.
        # Sized for max_concurrent_fetches admissions fetching at once (threads start lazily): a
        # pool of 2n made concurrent fetches queue behind calls to a hung replica, each holding a
        # thread for its whole deadline (16 fetches, one replica hung: up to 8 s for a fetch).
        n = len(self.ring.nodes)
        self._io = ThreadPoolExecutor(max_workers=2 * n * max_concurrent_fetches, thread_name_prefix="kv-io")
        self._offload_io = ThreadPoolExecutor(max_workers=n, thread_name_prefix="kv-offload-io")
        # Extra Get streams within one replica's share (consumed here: decode, checksum).
        self._get_io = ThreadPoolExecutor(
            max_workers=max(1, n * (streams_per_replica - 1) * max_concurrent_fetches), thread_name_prefix="kv-get-io"
        )
        self._lock = threading.Lock()
        self._stats = KVClientStats()

    # ------------------------------------------------------------------ helpers
    def _count(self, **deltas: int) -> None:
        with self._lock:
            for name, d in deltas.items():
                setattr(self._stats, name, getattr(self._stats, name) + d)

    def _by_node(self, hashes: Sequence[bytes]) -> dict[str, list[int]]:
        groups: dict[str, list[int]] = {}
        for i, h in enumerate(hashes):
            groups.setdefault(self.ring.node_for(h), []).append(i)
        return groups

    def _fan_out(
        self,
        calls: Mapping[str, Callable[[], T]],
        *,
        strict: bool = False,
        pool: ThreadPoolExecutor | None = None,
        timeout: float | None = None,
    ) -> dict[str, T | grpc.RpcError]:
        """Runs one call per replica in parallel; a failed call's RpcError is returned, not raised.

        strict: a rejection that is not a replica fault (INVALID_ARGUMENT: a layout that disagrees
        with the namespace) raises InvalidArgument, since retrying elsewhere cannot fix it.
        timeout: one deadline for the whole fan-out, counted from here. Each call's own RPC
        deadline starts only when a pool thread runs it; a call still queued or running at this
        deadline is given up (DEADLINE_EXCEEDED, a replica fault), so the caller never waits
        longer than this however busy the pool is."""
        if len(calls) == 1:  # no thread hand-off for a single replica
            ((node, fn),) = calls.items()
            done: Future[T] = Future()
            try:
                done.set_result(fn())
            except Exception as exc:
                done.set_exception(exc)
            futures = {node: done}
        else:
            futures = {node: (pool or self._io).submit(fn) for node, fn in calls.items()}
            if timeout is not None:
                _, late = wait(futures.values(), timeout=timeout)
                for fut in late:
                    fut.cancel()  # not started: it never runs (running: its RPC deadline ends it)
        out: dict[str, T | grpc.RpcError] = {}
        for node, fut in futures.items():
            try:
                if timeout is not None and (fut.cancelled() or not fut.done()):
                    raise _FanOutTimeout(timeout)
                out[node] = fut.result()
            except grpc.RpcError as exc:
                code = exc.code() if hasattr(exc, "code") else None
                if strict and code not in _DEGRADE:
                    raise InvalidArgument(f"kvstore {node} rejected the pages: {exc.details()}", field="pages") from exc
                self._count(replica_errors=1)
                log.warning(
                    "kvstore replica call failed; degrading to recompute",
                    extra=kv(replica=node, code=str(code), details=exc.details()),
                )
                out[node] = exc
        return out

    # ------------------------------------------------------------------ offload
    def put_pages(self, pages: KVPages, request_id: str) -> int:
        """Stores a request's pages (synchronously); returns how many were new to the store
        (put_pages_result says which are missing after a replica failure)."""
        return self.put_pages_result(pages, request_id).stored

    def put_pages_result(self, pages: KVPages, request_id: str) -> PutResult:
        """Stores a request's pages (synchronously).

        Each replica is first asked how much of its share is already stored (Exists): those pages
        are only claimed for request_id (a message without bytes), so offloading a longer context
        after every chunk sends just the new pages. A replica that fails loses only its share of the
        offload (counted in put_failures)."""
        if len(pages.pages) != len(pages.page_hashes):
            raise InvalidArgument(f"{len(pages.pages)} pages for {len(pages.page_hashes)} hashes", field="pages.pages")
        if not pages.pages:
            return PutResult()
        layout = layout_to_pb(pages.layout)
        sent = [0]  # bytes actually sent (claims carry none)

        def stream(indices: Sequence[int], claims: int) -> Iterator[bytes]:
            """Serialized PutRequests: the first `claims` pages as claims (no bytes), then pages."""
            for j, i in enumerate(indices):
                # The store inherits namespace, layout and owner within one stream.
                ns, lay, owner = (pages.model_version, layout, request_id) if j == 0 else ("", None, "")
                data = b"" if j < claims else pages.pages[i]
                if data:
                    with self._lock:
                        sent[0] += len(data)
                checksum = page_checksum(data) if data else 0
                yield encode_put(pages.page_hashes[i], data, checksum, namespace=ns, layout=lay, request_id=owner)

        def put(node: str, idx: list[int]) -> tuple[int, int, int | None]:
            """(pages stored, pages claimed, first page of idx whose claim found nothing or None)."""
            have = (
                self._stubs[node]
                .Exists(
                    kvstore_pb2.ExistsRequest(
                        namespace=pages.model_version, page_hashes=[pages.page_hashes[i] for i in idx]
                    ),
                    timeout=self.exists_timeout_s,
                )
                .prefix_pages
            )
            # The new pages go in streams_per_replica concurrent streams (gRPC consumes each request
            # iterator on its own thread: the checksum and serialization of one stream overlap the
            # transfer of another); the claims ride on the first.
            parts = split_even(idx[have:], self.streams_per_replica) or [[]]
            parts[0] = [*idx[:have], *parts[0]]
            futures = [
                self._put_rpc[node].future(stream(part, have if k == 0 else 0), timeout=self.rpc_timeout_s)
                for k, part in enumerate(parts)
            ]
            results = [f.result() for f in futures]
            if len(parts) > 1:
                # The streams ran concurrently, each leaving its pages used tail first; asking once
                # more leaves the whole chain so (the store's Exists touches the prefix it finds),
                # so that eviction takes its tail first: a chain without its head is unusable.
                with contextlib.suppress(grpc.RpcError):
                    self._stubs[node].Exists(kvstore_pb2.ExistsRequest(
                        namespace=pages.model_version, page_hashes=[pages.page_hashes[i] for i in idx]),
                        timeout=self.exists_timeout_s)
            first = results[0]
            # A claim finds nothing when the page went (released or evicted) after our Exists: that
            # page is not stored, whatever Exists said, and the caller must send it again.
            lost = idx[first.first_unclaimed] if first.claimed_pages < have else None
            return sum(r.stored_pages for r in results), first.claimed_pages, lost

        groups = self._by_node(pages.page_hashes)
        calls = {node: (lambda node=node, idx=idx: put(node, idx)) for node, idx in groups.items()}
        stored = failed = claimed = 0
        failed_first: list[int] = []  # per failed replica the first page it held; per lost claim its page
        for node, res in self._fan_out(calls, strict=True, pool=self._offload_io).items():
            # A replica answers for every message or fails the call: fewer "stored" than sent
            # means a sibling stored some of them meanwhile, not that they are missing.
            if isinstance(res, grpc.RpcError):
                failed += len(groups[node])
                failed_first.append(groups[node][0])
            else:
                stored += res[0]
                claimed += res[1]
                if res[2] is not None:
                    failed_first.append(res[2])
        self._count(
            put_pages=len(pages.pages),
            put_bytes=sent[0],
            stored_pages=stored,
            claimed_pages=claimed,
            put_failures=failed,
        )
        return PutResult(stored=stored, claimed=claimed, first_unstored=min(failed_first, default=None))

    def offload_async(self, pages: KVPages, request_id: str) -> Future[PutResult]:
        """put_pages_result on the background offload thread; returns at once (the future never
        raises for a replica that is down, only for a rejected layout). When max_pending_offloads
        are already queued the offload is dropped (PutResult(dropped=True, first_unstored=0),
        counted in offloads_dropped)."""
        with self._lock:
            if self._pending >= self.max_pending_offloads:
                # The store cannot keep up: holding more page copies would grow the worker's memory
                # without bound. Dropping one is only a later miss (recompute), so drop and count it.
                self._stats.offloads_dropped += 1
                done: Future[PutResult] = Future()
                done.set_result(PutResult(first_unstored=0 if pages.pages else None, dropped=True))
                return done
            self._pending += 1

        def run() -> PutResult:
            try:
                return self.put_pages_result(pages, request_id)
            finally:
                with self._lock:
                    self._pending -= 1

        return self._offload.submit(run)

    # ------------------------------------------------------------------ fetch
    def prefix_pages(self, hashes: Sequence[bytes], model_version: str) -> int:
        """How many leading pages of a hash chain are stored across the ring (Exists per replica)."""
        if not hashes:
            return 0
        groups = self._by_node(hashes)
        calls = {
            node: (
                lambda node=node, idx=idx: self._stubs[node].Exists(
                    kvstore_pb2.ExistsRequest(namespace=model_version, page_hashes=[hashes[i] for i in idx]),
                    timeout=self.exists_timeout_s,
                )
            )
            for node, idx in groups.items()
        }
        n = len(hashes)
        for node, res in self._fan_out(calls, timeout=self.exists_timeout_s).items():
            idx = groups[node]
            have = 0 if isinstance(res, grpc.RpcError) else res.prefix_pages
            if have < len(idx):
                n = min(n, idx[have])  # this replica's first missing page bounds the global prefix
        return n

    def fetch_prefix(
        self,
        token_ids: Sequence[int],
        model_version: str,
        layout: KVLayout,
        *,
        min_tokens: int = 0,
        cancelled: Callable[[], bool] | None = None,
    ) -> KVPages | None:
        """The longest stored, verified KV prefix of token_ids beyond min_tokens (what the caller's
        prefix cache already holds): the pages from page min_tokens // page_size on (KVPages with
        that first_page, which import_kv continues from the caller's cached pages), so a chunk that
        resumes where part of its prefix is cached transfers only the rest. None when nothing past
        min_tokens is stored.

        cancelled: whether the caller gave up (its RunChunk stream cancelled, the chunk aborted):
        looked at before the Gets start and every _CANCEL_POLL_S while they run; once true the Get
        streams are cancelled (a fetch of a dead chunk held kvstore streams and pool threads up to
        rpc_timeout_s) and the fetch returns None."""
        if min_tokens < 0:
            raise InvalidArgument(f"must be >= 0, got {min_tokens}", field="min_tokens")
        self._count(fetch_calls=1)
        hashes = chain_hashes(token_ids, layout.page_size, model_version)
        start = min(min_tokens // layout.page_size, len(hashes))
        n = self.prefix_pages(hashes[start:], model_version)  # pages stored from `start` on
        if n == 0 or (start + n) * layout.page_size <= min_tokens:
            return None
        if cancelled is not None and cancelled():
            # Gone before any Get: counted like one cancelled mid-transfer (the README's count of
            # fetches whose chunk was gone), with no streams to cancel.
            self._count(fetch_cancels=1)
            log.info("kv fetch cancelled before its gets: its chunk is gone", extra=kv(pages=n))
            return None
        streams = _GetCalls()
        wanted = hashes[start : start + n]
        groups = self._by_node(wanted)
        layout_pb = layout_to_pb(layout)

        # Per page: None = missing, False = failed its checksum, bytes = verified data. Each page is
        # checked as it arrives (XXH3 releases the GIL), overlapping the transfer of the next one.
        def verified(msg: GetMessage) -> memoryview | bool | None:
            if not msg.found:
                return None
            if len(msg.data) != layout.page_bytes or page_checksum(msg.data) != msg.checksum:
                return False
            # No copy: the view keeps the received message alive, which is the page plus a few
            # dozen bytes of header, and the importer copies it into its KV cache.
            return msg.data

        def get_part(node: str, part: Sequence[int]) -> dict[bytes, memoryview | bool | None]:
            req = kvstore_pb2.GetRequest(
                namespace=model_version, page_hashes=[wanted[i] for i in part], layout=layout_pb
            )
            out: dict[bytes, memoryview | bool | None] = {}
            # The time left of the fetch's one deadline: a stream started late (queued on a busy
            # pool) ends with it, and its own DEADLINE_EXCEEDED keeps what arrived (below).
            call = self._get_rpc[node](req, timeout=max(0.0, deadline - time.monotonic()))
            streams.add(call)
            try:
                for msg in call:
                    out[msg.page_hash] = verified(msg)
            except grpc.RpcError:
                if streams.cancelled:
                    return out  # our own cancellation: no replica fault (the fetch returns None)
                if not out:
                    raise
                self._count(replica_errors=1)  # keep what arrived before the failure
            finally:
                streams.discard(call)
            return out

        def get(node: str, idx: list[int]) -> dict[bytes, memoryview | bool | None]:
            # streams_per_replica concurrent streams: one consumed here, the others on _get_io, so
            # the checksum of one stream's page overlaps the transfer of another's.
            parts = split_even(idx, self.streams_per_replica)
            others = [self._get_io.submit(get_part, node, part) for part in parts[1:]]
            results: list[dict[bytes, memoryview | bool | None] | grpc.RpcError] = []
            for k in range(len(parts)):
                try:
                    results.append(get_part(node, parts[0]) if k == 0 else others[k - 1].result())
                except grpc.RpcError as exc:
                    results.append(exc)
            out: dict[bytes, memoryview | bool | None] = {}
            for res in results:
                if isinstance(res, grpc.RpcError):
                    if len(results) == 1 or all(isinstance(r, grpc.RpcError) for r in results):
                        raise res
                    self._count(replica_errors=1)  # a missing part ends the prefix there
                else:
                    out.update(res)
            return out

        got: dict[bytes, memoryview | bool | None] = {}
        calls = {node: (lambda node=node, idx=idx: get(node, idx)) for node, idx in groups.items()}
        deadline = time.monotonic() + self.rpc_timeout_s
        done = threading.Event()
        if cancelled is not None:
            threading.Thread(target=streams.watch, args=(cancelled, done), name="kv-fetch-cancel", daemon=True).start()
        try:
            # The fan-out waits a little past the streams' deadline: each stream's own
            # DEADLINE_EXCEEDED lands first and keeps the pages it received (given up by the fan-out
            # at the same instant, a slow but healthy replica's whole share was lost; session 27).
            for res in self._fan_out(calls, timeout=self.rpc_timeout_s + _GET_GRACE_S).values():
                if not isinstance(res, grpc.RpcError):
                    got.update(res)
        finally:
            done.set()
        if streams.cancelled:
            self._count(fetch_cancels=1)
            log.info("kv fetch cancelled: its chunk is gone", extra=kv(pages=n))
            return None
        pages: list[memoryview] = []
        for h in wanted:
            page = got.get(h)
            if page is None:
                self._count(missing_pages=1)
                log.info(
                    "kv prefix page missing; recomputing from here",
                    extra=kv(page=start + len(pages), of_pages=start + n),
                )
                break
            if not isinstance(page, memoryview):  # False: failed its checksum
                self._count(checksum_failures=1)
                log.warning(
                    "kv prefix page failed its checksum; recomputing from here",
                    extra=kv(page=start + len(pages), of_pages=start + n),
                )
                break
            pages.append(page)
        if not pages or (start + len(pages)) * layout.page_size <= min_tokens:
            return None
        k = len(pages)
        self._count(fetch_hits=1, fetched_pages=k, fetched_bytes=sum(len(p) for p in pages))
        return KVPages(
            model_version=model_version,
            layout=layout,
            token_ids=tuple(token_ids[: (start + k) * layout.page_size]),
            page_hashes=tuple(wanted[:k]),
            pages=tuple(pages),
            first_page=start,
        )

    # ------------------------------------------------------------------ release / stats
    def release(self, model_version: str, request_id: str) -> int:
        """Drops a finished request's ownership of its pages on every replica; returns pages released."""
        if not request_id:
            raise InvalidArgument("must not be empty", field="request_id")
        req = kvstore_pb2.ReleaseRequest(namespace=model_version, request_id=request_id)
        calls = {
            node: (lambda node=node: self._stubs[node].Release(req, timeout=self.exists_timeout_s))
            for node in self.ring.nodes
        }
        n = sum(r.released_pages for r in self._fan_out(calls, timeout=self.exists_timeout_s).values()
                if not isinstance(r, grpc.RpcError))
        self._count(released_pages=n)
        return n

    def store_stats(self) -> dict[str, dict[str, int] | None]:
        """Each replica's GetKvStats as a dict (None for a replica that did not answer)."""
        req = kvstore_pb2.GetKvStatsRequest()
        calls = {
            node: (lambda node=node: self._stubs[node].GetKvStats(req, timeout=self.exists_timeout_s))
            for node in self.ring.nodes
        }
        out: dict[str, dict[str, int] | None] = {}
        for node, res in self._fan_out(calls, timeout=self.exists_timeout_s).items():
            if isinstance(res, grpc.RpcError):
                out[node] = None
            else:
                out[node] = {f.name: int(getattr(res, f.name)) for f in res.DESCRIPTOR.fields}
        return out

    def stats(self) -> KVClientStats:
        with self._lock:
            return KVClientStats(**asdict(self._stats))

    def close(self) -> None:
        """Waits for pending offloads, then closes the channels. Other calls still queued are
        cancelled and running ones end with the channels (CANCELLED): a hung replica must not make
        close wait out their deadlines (a Release queued at shutdown, say)."""
        self._offload.shutdown(wait=True)
        self._offload_io.shutdown(wait=True)
        self._io.shutdown(wait=False, cancel_futures=True)
        self._get_io.shutdown(wait=False, cancel_futures=True)
        for ch in self._channels.values():
            ch.close()
        self._io.shutdown(wait=True)
        self._get_io.shutdown(wait=True)

    def __enter__(self) -> KVClient:
        return self

    def __exit__(self, *_exc: object) -> None:
        self.close()
