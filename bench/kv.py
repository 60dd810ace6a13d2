"""KV store benchmark: page throughput (memory copy vs RocksDB vs loopback gRPC) and migration.

    python -m bench.kv [--quick] [--contexts 1024,4096] [--mib 256] [--no-migration] [--streams 2]
                       [--malloc-arenas N]

Throughput: the same SmolLM2-135M float32 pages (30 layers x K/V x 16 tokens x 3 heads x 64 dims
= 720 KiB) are (1) copied in process (the baseline), (2) written to / read from RocksDB directly
(services.kvstore.ssd, blob files, reads checked by our checksum as the store does), (3) sent one way
over bare loopback gRPC (generic handler, raw bytes, no store / protobuf / checksum: the transport's
ceiling here), (4) Put / fetched through a kvstore server process over loopback gRPC by the
worker's KVClient (Put = put_pages: Exists + streamed Put, acknowledged once stored; Get =
fetch_prefix: Exists + streamed Get + checksum check), with the DRAM tier, RocksDB only
(--dram-bytes 0), and without server-side Put verification. (3) and (4) alternate round by round;
each path is reported as GB/s (best round), as a ratio to the memory copy and as the median ratio
to the bare transport of the same round, with client and server CPU seconds per GB. Put "cold" is
the first Put into an empty store (fresh memory); the other Puts follow the release of the
previous batch (steady state).

Migration (DESIGN.md section 4, divided rollout): a request with C tokens of context ran on worker
A; its next chunk runs on worker B. Re-prefill = B computes the whole context; via the store = B
fetches the pages A offloaded (fetch_prefix), imports them and computes only the uncached tail.
Both produce the next token greedily; the tokens must agree. Target: via store <= 0.3x re-prefill
at 4K.

The last line is `RESULT {json}`.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import random
import resource
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from services.common.memtune import malloc_tuned, tune_malloc
from services.common.pagehash import chain_hashes
from services.kvstore.checksum import ALGORITHM as CHECKSUM
from services.kvstore.checksum import page_checksum
from services.kvstore.ssd import SsdTier
from services.worker.engine import GenerateRequest, KVLayout, KVPages, SamplingParams
from services.worker.kv_client import KVClient

SMOLLM_LAYOUT = KVLayout(dtype="float32", page_size=16, num_layers=30, num_kv_heads=3, head_dim=64)
GB = 1e9


def _gbps(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / GB if seconds > 0 else float("inf")


def _best(fn: Any, repeat: int) -> float:
    """Best wall time of `repeat` runs (the machine is shared: the minimum is the least disturbed)."""
    best = float("inf")
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def synthetic_pages(num_pages: int, layout: KVLayout, version: str, seed: int = 0) -> KVPages:
    rng = random.Random(seed)
    tokens = [rng.randrange(100, 49000) for _ in range(num_pages * layout.page_size)]
    hashes = chain_hashes(tokens, layout.page_size, version)
    # Distinct incompressible pages (RocksDB compression must not flatter it).
    base = os.urandom(layout.page_bytes)
    pages = tuple(i.to_bytes(8, "little") + base[8:] for i in range(num_pages))
    return KVPages(version, layout, tuple(tokens), tuple(hashes), pages)


def _server_cpu_s(pid: int) -> float:
    """user + system CPU seconds of another process (Linux /proc)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return float("nan")
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _wait_port(proc: subprocess.Popen[bytes], port_file: str) -> str:
    deadline = time.time() + 60
    while not os.path.exists(port_file) or not Path(port_file).read_text().strip():
        if proc.poll() is not None or time.time() > deadline:
            raise RuntimeError(f"{proc.args!r} did not start")
        time.sleep(0.05)
    return f"127.0.0.1:{Path(port_file).read_text().strip()}"


class KvStoreProcess:
    """`python -m services.kvstore` on a free loopback port, stopped with SIGTERM."""

    def __init__(self, data_dir: str, dram_bytes: int, ssd_bytes: int, extra: tuple[str, ...] = ()) -> None:
        os.makedirs(data_dir, exist_ok=True)
        port_file = os.path.join(data_dir, "port")
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "services.kvstore",
                "--port",
                "0",
                "--port-file",
                port_file,
                "--data-dir",
                os.path.join(data_dir, "db"),
                "--dram-bytes",
                str(dram_bytes),
                "--ssd-bytes",
                str(ssd_bytes),
                "--grace-seconds",
                "1",
                *extra,
            ],
            stderr=subprocess.DEVNULL,
        )
        self.address = _wait_port(self.proc, port_file)

    def cpu_s(self) -> float:
        return _server_cpu_s(self.proc.pid)

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()


# ------------------------------------------------------------------------------ bare gRPC ceiling
# The transport alone: a generic-handler server (no protobuf, no checksum, no store) that discards
# what it is sent (Sink) or streams byte strings it holds (Source). Same message size (one page),
# same process layout (a separate server process), same channel options and malloc tuning as the
# kvstore path, so "our Put / bare" shows what the store and its protocol cost on top.
_BARE_SERVICE = "seerbench.Bare"


def _identity(b: bytes) -> bytes:
    return b


def serve_bare(port_file: str, page_bytes: int, pages: int) -> int:
    """The bare server (run as `python -m bench.kv --serve-bare PORT_FILE ...`)."""
    from concurrent import futures

    import grpc

    from services.common.grpcutil import MAX_MESSAGE_BYTES
    from services.common.memtune import tune_malloc

    tune_malloc(trim_bytes=512 << 20, arenas=1)  # as the kvstore server's defaults
    payload = [i.to_bytes(8, "little") + os.urandom(page_bytes - 8) for i in range(min(pages, 64))]

    def sink(requests: Any, context: Any) -> bytes:
        n = 0
        for msg in requests:
            n += len(msg)
        return n.to_bytes(8, "little")

    def source(request: bytes, context: Any) -> Any:
        for i in range(int.from_bytes(request, "little")):
            yield payload[i % len(payload)]

    opts = [("grpc.max_send_message_length", MAX_MESSAGE_BYTES), ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES)]
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=16), options=opts)
    handler = grpc.method_handlers_generic_handler(
        _BARE_SERVICE,
        {
            "Sink": grpc.stream_unary_rpc_method_handler(sink, _identity, _identity),
            "Source": grpc.unary_stream_rpc_method_handler(source, _identity, _identity),
        },
    )
    server.add_generic_rpc_handlers((handler,))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    tmp = port_file + ".tmp"
    Path(tmp).write_text(str(port))
    os.replace(tmp, port_file)
    signal.sigwait({signal.SIGTERM, signal.SIGINT})
    server.stop(0)
    return 0


class _Cpu:
    """CPU seconds of this process (the client) and a server process over the spans measured
    (`with cpu:`), per GB moved."""

    def __init__(self, server_pid: int) -> None:
        self.server_pid = server_pid
        self.client = self.server = 0.0
        self.nbytes = self.faults = 0

    def span(self, nbytes: int) -> _Cpu:
        self.nbytes += nbytes
        return self

    def __enter__(self) -> _Cpu:
        self._c0, self._s0 = time.process_time(), _server_cpu_s(self.server_pid)
        self._f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        return self

    def __exit__(self, *_exc: object) -> None:
        self.client += time.process_time() - self._c0
        self.server += _server_cpu_s(self.server_pid) - self._s0
        self.faults += resource.getrusage(resource.RUSAGE_SELF).ru_minflt - self._f0

    def per_gb(self, prefix: str) -> dict[str, float]:
        n = max(self.nbytes, 1)
        return {
            f"{prefix}client_cpu_s_per_gb": self.client / n * GB,
            f"{prefix}server_cpu_s_per_gb": self.server / n * GB,
            f"{prefix}client_page_faults_per_gb": self.faults / n * GB,
        }


class BareGrpc:
    """The bare server process and a client of it: one-way ceilings of Python gRPC here, client
    streaming into a discarding server (Put-like) and server streaming out of one (Get-like), over
    `streams` concurrent streams, page-sized messages."""

    def __init__(self, pages: KVPages, streams: int, workdir: str) -> None:
        from concurrent.futures import ThreadPoolExecutor

        import grpc

        from services.common.grpcutil import CHANNEL_OPTIONS

        port_file = os.path.join(workdir, "bare-port")
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "bench.kv",
                "--serve-bare",
                port_file,
                "--bare-page-bytes",
                str(len(pages.pages[0])),
            ],
            stderr=subprocess.DEVNULL,
        )
        address = _wait_port(self.proc, port_file)
        self.channel = grpc.insecure_channel(address, options=CHANNEL_OPTIONS)
        self._sink = self.channel.stream_unary(f"/{_BARE_SERVICE}/Sink", _identity, _identity)
        self._source = self.channel.unary_stream(f"/{_BARE_SERVICE}/Source", _identity, _identity)
        # Raw messages must be bytes (bytes(b) of bytes is b itself: no copy).
        self.parts = [[bytes(p) for p in pages.pages[k::streams]] for k in range(streams)]
        self.nbytes = sum(len(p) for p in pages.pages)
        self.pool = ThreadPoolExecutor(max_workers=streams)
        self.put_cpu, self.get_cpu = _Cpu(self.proc.pid), _Cpu(self.proc.pid)
        self._put_one(self.parts[0][:2])  # warm up the connection and both ends
        self._get_one(self.parts[0][:2])

    def _put_one(self, part: Sequence[bytes]) -> int:
        return int.from_bytes(self._sink(iter(part), timeout=120), "little")

    def _get_one(self, part: Sequence[bytes]) -> int:
        return sum(len(m) for m in self._source(len(part).to_bytes(8, "little"), timeout=120))

    def put(self) -> float:
        t = time.perf_counter()
        with self.put_cpu.span(self.nbytes):
            moved = sum(self.pool.map(self._put_one, self.parts))
        dt = time.perf_counter() - t
        assert moved == self.nbytes, f"bare put moved {moved} of {self.nbytes} bytes"
        return dt

    def get(self) -> float:
        t = time.perf_counter()
        with self.get_cpu.span(self.nbytes):
            moved = sum(self.pool.map(self._get_one, self.parts))
        dt = time.perf_counter() - t
        assert moved == self.nbytes, f"bare get moved {moved} of {self.nbytes} bytes"
        return dt

    def close(self) -> None:
        self.pool.shutdown()
        self.channel.close()
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()


class StorePath:
    """A kvstore process and the worker's KVClient: Put = put_pages, Get = fetch_prefix.

    dram=False: the server has no DRAM tier, so every Put lands in RocksDB and every Get reads (and
    checks the checksums) from it. The first Put goes into the empty store ("cold": every page lands in memory
    the server never touched, page faults included); each later Put comes after the previous
    request released its pages, as finished rollouts do, so the store reuses that memory (steady
    state). Get fetches the latest batch, and the result is dropped (imported, then freed)."""

    def __init__(
        self, layout: KVLayout, n: int, workdir: str, name: str, streams: int, dram: bool, extra: tuple[str, ...] = ()
    ) -> None:
        self.layout, self.n = layout, n
        self.nbytes = n * layout.page_bytes
        self.tier = "dram" if dram else "rocksdb"
        self.server = KvStoreProcess(
            os.path.join(workdir, name),
            dram_bytes=3 * self.nbytes if dram else 0,
            ssd_bytes=8 * self.nbytes,
            extra=extra,
        )
        try:  # a failure here must not leave the server process behind
            self.kv = KVClient([self.server.address], streams_per_replica=streams)
            self.kv.put_pages(synthetic_pages(2, layout, "bench@v1", seed=1), "warmup")
            self.put_cpu, self.get_cpu = _Cpu(self.server.proc.pid), _Cpu(self.server.proc.pid)
            self.puts = 0
            self.pages = synthetic_pages(n, layout, "bench@v1", seed=100)
            t = time.perf_counter()
            self._put()
            self.cold_put_s = time.perf_counter() - t
        except BaseException:
            self.server.stop()
            raise

    def _put(self) -> None:
        stored = self.kv.put_pages(self.pages, f"put{self.puts}")
        if stored != self.n:
            raise RuntimeError(f"the store took {stored} of {self.n} pages")
        self.puts += 1

    def put(self) -> float:
        self.kv.release("bench@v1", f"put{self.puts - 1}")
        # Fresh pages each time (a fresh owner of the same pages would only claim them).
        self.pages = synthetic_pages(self.n, self.layout, "bench@v1", seed=100 + self.puts)
        t = time.perf_counter()
        with self.put_cpu.span(self.nbytes):
            self._put()
        return time.perf_counter() - t

    def get(self) -> float:
        t = time.perf_counter()
        with self.get_cpu.span(self.nbytes):
            got = self.kv.fetch_prefix(self.pages.token_ids, "bench@v1", self.layout)
        dt = time.perf_counter() - t
        if got is None or got.pages != self.pages.pages:
            raise RuntimeError("fetched pages differ from the stored ones")
        return dt

    def close(self) -> dict[str, int]:
        stats = self.kv.store_stats()[self.server.address] or {}
        self.kv.close()
        self.server.stop()
        return {"dram_bytes": stats.get("dram_bytes", 0), "ssd_bytes": stats.get("ssd_bytes", 0)}


def _median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def bench_throughput(
    total_bytes: int, repeat: int, workdir: str, streams: int, client_arenas: int | None = None
) -> dict[str, Any]:
    layout = SMOLLM_LAYOUT
    n = max(8, total_bytes // layout.page_bytes)
    pages = synthetic_pages(n, layout, "bench@v1")
    nbytes = n * layout.page_bytes
    out: dict[str, Any] = {"page_bytes": layout.page_bytes, "pages": n, "bytes": nbytes, "streams": streams}
    # The client process is tuned as KVClient does it (the first KVClient would do it anyway); the
    # bare server and the kvstore servers tune themselves.
    tune_malloc(arenas=client_arenas)
    tuning = malloc_tuned()
    out["client_malloc"] = dataclasses.asdict(tuning) if tuning is not None else None
    out["checksum"] = CHECKSUM

    # 1. In-process memory copy of the same page buffers into one preallocated buffer: the ceiling
    # (no allocation or page faults, just memory bandwidth).
    dst = memoryview(bytearray(nbytes))

    def copy() -> None:
        off = 0
        for p in pages.pages:
            dst[off : off + len(p)] = p
            off += len(p)

    copy()  # fault the destination in
    t_copy = _best(copy, repeat)
    out["memcpy_gbps"] = _gbps(nbytes, t_copy)

    # 2. RocksDB directly (blob files), as the SSD tier writes and reads pages.
    # As the store reads pages: its own checksum (XXH3) instead of RocksDB's (software crc32c) one.
    ssd = SsdTier(os.path.join(workdir, "rocks"), verify_page_reads=False)
    meta = b"{}"

    def rocks_put() -> None:
        for h, p in zip(pages.page_hashes, pages.pages, strict=True):
            ssd.put("bench@v1", h, p, meta)

    def rocks_get() -> None:
        for h in pages.page_hashes:
            data = ssd.get("bench@v1", h)
            assert data is not None and page_checksum(data) >= 0

    t_rput = _best(rocks_put, 1)
    t_rget = _best(rocks_get, repeat)
    ssd.close()
    out["rocksdb_put_gbps"] = _gbps(nbytes, t_rput)
    out["rocksdb_get_gbps"] = _gbps(nbytes, t_rget)

    # 3. Over loopback gRPC: the bare transport (no store, no protobuf, no checksum) and the kvstore
    # paths, interleaved round by round so that each "x bare" ratio compares runs seconds apart
    # (the machine is shared: its load drifts over a run). Each kvstore path: DRAM tier (default;
    # Put is acknowledged once the page is in DRAM), RocksDB only (--dram-bytes 0), and DRAM with
    # the server trusting the writer's checksum (--verify-put-checksums false).
    bare = BareGrpc(pages, streams, workdir)
    paths = {
        "": ("svc", True, ()),
        "_ssd": ("svc-ssd", False, ()),
        "_noverify": ("svc-noverify", True, ("--verify-put-checksums", "false")),
    }
    detail: dict[str, Any] = {}
    bare_put: list[float] = []
    bare_get: list[float] = []
    try:
        for suffix, (name, dram, extra) in paths.items():
            path = StorePath(layout, n, workdir, name, streams, dram, extra)
            try:
                put_ratio, get_ratio, t_put, t_get = [], [], [], []
                for _ in range(repeat):
                    tb = bare.put()
                    tk = path.put()
                    bare_put.append(tb)
                    t_put.append(tk)
                    put_ratio.append(tb / tk)
                    if suffix != "_noverify":  # the same Get as the DRAM path
                        tb = bare.get()
                        tk = path.get()
                        bare_get.append(tb)
                        t_get.append(tk)
                        get_ratio.append(tb / tk)
                d: dict[str, Any] = {"tier": path.tier, "put_cold_gbps": _gbps(nbytes, path.cold_put_s)}
                d["put_gbps"] = _gbps(nbytes, min(t_put))
                d["put_vs_bare_median"] = _median(put_ratio)
                d.update(path.put_cpu.per_gb("put_"))
                if t_get:
                    d["get_gbps"] = _gbps(nbytes, min(t_get))
                    d["get_vs_bare_median"] = _median(get_ratio)
                    d.update(path.get_cpu.per_gb("get_"))
            finally:
                closed = path.close()  # first: on an error above, d may not exist
            d.update(closed)
            detail[name] = d
            out[f"grpc_put{suffix}_gbps"] = d["put_gbps"]
            out[f"grpc_put{suffix}_vs_bare"] = d["put_vs_bare_median"]
            out[f"grpc_put{suffix}_cold_gbps"] = d["put_cold_gbps"]
            if "get_gbps" in d:
                out[f"grpc_get{suffix}_gbps"] = d["get_gbps"]
                out[f"grpc_get{suffix}_vs_bare"] = d["get_vs_bare_median"]
    finally:
        bare.close()
    out["bare_put_gbps"] = _gbps(nbytes, min(bare_put))
    out["bare_get_gbps"] = _gbps(nbytes, min(bare_get))
    out["bare"] = {"streams": streams, **bare.put_cpu.per_gb("put_"), **bare.get_cpu.per_gb("get_")}
    out["detail"] = detail
    for k in (
        "rocksdb_put",
        "rocksdb_get",
        "grpc_put",
        "grpc_get",
        "grpc_put_ssd",
        "grpc_get_ssd",
        "grpc_put_noverify",
    ):
        out[f"{k}_vs_memcpy"] = out[f"{k}_gbps"] / out["memcpy_gbps"]
    return out


def bench_migration(contexts: list[int], workdir: str, threads: int | None) -> dict[str, Any]:
    from services.common.model_paths import default_model_dir
    from services.worker.engines.reference.engine import ReferenceEngine
    from services.worker.model.prepare import ensure_model

    model_dir = ensure_model() if not default_model_dir().exists() else default_model_dir()
    num_pages = max(contexts) // 16 + 64
    # Worker A (where the request ran) and worker B (where its next chunk runs).
    a = ReferenceEngine.from_dir(model_dir, num_pages=num_pages, model_version="smollm2@v1", num_threads=threads)
    b = ReferenceEngine.from_dir(model_dir, num_pages=num_pages, model_version="smollm2@v1", num_threads=threads)
    greedy = SamplingParams(temperature=0.0)
    for eng in (a, b):  # warm up kernels and thread pools
        eng.generate([GenerateRequest("warm", tuple(range(200, 232)), 2, greedy)])
    server = KvStoreProcess(os.path.join(workdir, "mig"), dram_bytes=4 << 30, ssd_bytes=16 << 30)
    out: dict[str, Any] = {}
    rng = random.Random(7)
    try:
        with KVClient([server.address]) as kv:
            for ctx in contexts:
                tokens = tuple(rng.randrange(100, 49000) for _ in range(ctx))
                # Re-prefill: a worker without the KV computes the whole context, then one token.
                t = time.perf_counter()
                ref = a.generate([GenerateRequest(f"re{ctx}", tokens, 1, greedy)])[f"re{ctx}"]
                t_reprefill = time.perf_counter() - t
                # A offloads at chunk end (off the decode path; timed for the record).
                t = time.perf_counter()
                pages = a.export_kv(tokens)
                kv.offload_async(pages, f"req{ctx}").result()
                t_offload = time.perf_counter() - t
                # B resumes via the store: fetch, import, compute the uncached tail and one token.
                before = b.stats()
                t = time.perf_counter()
                fetched = kv.fetch_prefix(tokens, b.model_version, b.kv_layout)
                t_fetch = time.perf_counter() - t
                assert fetched is not None
                b.import_kv(fetched)
                t_import = time.perf_counter() - t - t_fetch
                res = b.generate([GenerateRequest(f"mv{ctx}", tokens, 1, greedy)])[f"mv{ctx}"]
                t_resume = time.perf_counter() - t
                after = b.stats()
                assert res.token_ids == ref.token_ids, f"resumed token {res.token_ids} != {ref.token_ids}"
                out[str(ctx)] = {
                    "reprefill_s": t_reprefill,
                    "resume_via_store_s": t_resume,
                    "ratio": t_resume / t_reprefill,
                    "fetch_s": t_fetch,
                    "import_s": t_import,
                    "offload_s": t_offload,
                    "kv_bytes": sum(len(p) for p in fetched.pages),
                    "prefill_tokens_on_b": after.prefill_tokens - before.prefill_tokens,
                    "same_next_token": True,
                }
                kv.release(b.model_version, f"req{ctx}")
    finally:
        server.stop()
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.kv", description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="small sizes, under 60 s")
    ap.add_argument("--mib", type=int, default=None, help="bytes moved per throughput pass (MiB)")
    ap.add_argument("--contexts", default=None, help="comma-separated context lengths for migration")
    ap.add_argument("--repeat", type=int, default=None)
    ap.add_argument("--no-migration", action="store_true", help="skip the engine part")
    ap.add_argument("--streams", type=int, default=2, help="concurrent streams per replica (KVClient)")
    ap.add_argument(
        "--malloc-arenas",
        type=int,
        default=None,
        help="cap the client's glibc malloc arenas (KVClient(malloc_arenas=N); default: leave them)",
    )
    ap.add_argument("--serve-bare", default=None, metavar="PORT_FILE", help=argparse.SUPPRESS)
    ap.add_argument("--bare-page-bytes", type=int, default=SMOLLM_LAYOUT.page_bytes, help=argparse.SUPPRESS)
    ap.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch threads of the engines (1 is robust on a shared machine; 0 = torch's default)",
    )
    args = ap.parse_args(argv)
    if args.serve_bare:
        return serve_bare(args.serve_bare, args.bare_page_bytes, 64)
    mib = args.mib or (32 if args.quick else 512)
    repeat = args.repeat or (2 if args.quick else 3)
    contexts = [int(c) for c in (args.contexts or ("256,512" if args.quick else "1024,4096")).split(",")]
    workdir = tempfile.mkdtemp(prefix="bench-kv-")
    result: dict[str, Any] = {"quick": args.quick, "engine_threads": args.threads, "contexts": contexts}
    t0 = time.perf_counter()
    try:
        tp = bench_throughput(mib << 20, repeat, workdir, args.streams, args.malloc_arenas)
        result["throughput"] = tp
        print(
            f"pages: {tp['pages']} x {tp['page_bytes']} B = {tp['bytes'] / 1e6:.0f} MB, {args.streams} streams, "
            f"checksum {tp['checksum']}, client malloc: {tp['client_malloc']}"
        )
        for k in ("memcpy", "rocksdb_put", "rocksdb_get", "bare_put", "bare_get"):
            ratio = "" if k == "memcpy" else f"  ({tp[k + '_gbps'] / tp['memcpy_gbps']:.3f}x memcpy)"
            print(f"{k:>17}: {tp[k + '_gbps']:7.2f} GB/s{ratio}")
        for k in ("grpc_put", "grpc_get", "grpc_put_ssd", "grpc_get_ssd", "grpc_put_noverify"):
            print(
                f"{k:>17}: {tp[k + '_gbps']:7.2f} GB/s  ({tp[k + '_vs_memcpy']:.3f}x memcpy, "
                f"median {tp[k + '_vs_bare']:.2f}x bare gRPC of the same round)"
            )
        print(f"{'grpc_put_cold':>17}: {tp['grpc_put_cold_gbps']:7.2f} GB/s  (first Put into the empty store)")
        if not args.no_migration:
            mig = bench_migration(contexts, workdir, args.threads or None)
            result["migration"] = mig
            for ctx, m in mig.items():
                print(
                    f"migration {ctx:>5} tokens: re-prefill {m['reprefill_s']:.2f} s, via store "
                    f"{m['resume_via_store_s']:.2f} s (fetch {m['fetch_s']:.2f}, import {m['import_s']:.2f}) "
                    f"= {m['ratio']:.3f}x; B prefilled {m['prefill_tokens_on_b']} tokens"
                )
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    result["wall_s"] = time.perf_counter() - t0
    print("RESULT " + json.dumps(result, sort_keys=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
