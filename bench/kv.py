"""KV store benchmark: page throughput (memory copy vs RocksDB vs loopback gRPC) and migration.

    python -m bench.kv [--quick] [--contexts 1024,4096] [--mib 256] [--no-migration]

Throughput: the same SmolLM2-135M float32 pages (30 layers x K/V x 16 tokens x 3 heads x 64 dims
= 720 KiB) are (1) copied in process (the baseline), (2) written to / read from RocksDB directly
(services.kvstore.ssd, blob files), (3) Put / fetched through a kvstore server process over
loopback gRPC by the worker's KVClient (Put = put_pages; Get = fetch_prefix: Exists + streamed Get +
crc32 check). Results are GB/s and ratios to the memory copy, all measured in this run.

Migration (DESIGN.md section 4, divided rollout): a request with C tokens of context ran on worker
A; its next chunk runs on worker B. Re-prefill = B computes the whole context; via the store = B
fetches the pages A offloaded (fetch_prefix), imports them and computes only the uncached tail.
Both produce the next token greedily; the tokens must agree. Target: via store <= 0.3x re-prefill
at 4K.

The last line is `RESULT {json}`.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from services.common.pagehash import chain_hashes
from services.kvstore.checksum import IMPLEMENTATION as CRC32_IMPL
from services.kvstore.checksum import crc32
from services.kvstore.memtune import tune_malloc_for_pages
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
    from services.kvstore.memtune import tune_malloc_for_pages

    tune_malloc_for_pages()
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


def bench_bare(pages: KVPages, repeat: int, streams: int, workdir: str) -> dict[str, Any]:
    """One-way ceilings of Python gRPC here: client-streaming into a discarding server (Put-like) and
    server-streaming out of one (Get-like), with `streams` concurrent streams."""
    from concurrent.futures import ThreadPoolExecutor

    import grpc

    from services.common.grpcutil import CHANNEL_OPTIONS

    port_file = os.path.join(workdir, "bare-port")
    page_bytes = len(pages.pages[0])
    proc = subprocess.Popen(
        [sys.executable, "-m", "bench.kv", "--serve-bare", port_file, "--bare-page-bytes", str(page_bytes)],
        stderr=subprocess.DEVNULL,
    )
    try:
        address = _wait_port(proc, port_file)
        ch = grpc.insecure_channel(address, options=CHANNEL_OPTIONS)
        sink = ch.stream_unary(f"/{_BARE_SERVICE}/Sink", _identity, _identity)
        source = ch.unary_stream(f"/{_BARE_SERVICE}/Source", _identity, _identity)
        parts = [pages.pages[k::streams] for k in range(streams)]
        nbytes = sum(len(p) for p in pages.pages)
        pool = ThreadPoolExecutor(max_workers=streams)

        def put_one(part: tuple[bytes, ...]) -> int:
            return int.from_bytes(sink(iter(part), timeout=120), "little")

        def get_one(part: tuple[bytes, ...]) -> int:
            return sum(len(m) for m in source(len(part).to_bytes(8, "little"), timeout=120))

        out: dict[str, Any] = {"streams": streams}
        for name, fn in (("put", put_one), ("get", get_one)):
            fn(parts[0][:2])  # warm up the connection and both ends
            cpu = _Cpu(proc.pid)
            best = float("inf")
            for _ in range(repeat):
                t = time.perf_counter()
                moved = sum(pool.map(fn, parts))
                best = min(best, time.perf_counter() - t)
                assert moved == nbytes, f"bare {name} moved {moved} of {nbytes} bytes"
            out[f"{name}_gbps"] = _gbps(nbytes, best)
            out.update(cpu.per_gb(f"{name}_", nbytes * repeat))
        pool.shutdown()
        ch.close()
        return out
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()


class _Cpu:
    """CPU seconds per GB moved, of this process (client) and the server process, since creation."""

    def __init__(self, server_pid: int) -> None:
        self.server_pid = server_pid
        self.client0 = time.process_time()
        self.server0 = _server_cpu_s(server_pid)

    def per_gb(self, prefix: str, nbytes: int) -> dict[str, float]:
        client = time.process_time() - self.client0
        server = _server_cpu_s(self.server_pid) - self.server0
        return {
            f"{prefix}client_cpu_s_per_gb": client / nbytes * GB,
            f"{prefix}server_cpu_s_per_gb": server / nbytes * GB,
        }


def bench_kvstore(
    layout: KVLayout,
    n: int,
    repeat: int,
    workdir: str,
    name: str,
    streams: int,
    dram: bool,
    extra: tuple[str, ...] = (),
) -> dict[str, Any]:
    """Put (put_pages) and Get (fetch_prefix) through a kvstore process; dram=False: the server
    has no DRAM tier, so every Put lands in RocksDB and every Get reads (and crc-checks) from it."""
    nbytes = n * layout.page_bytes
    server = KvStoreProcess(
        os.path.join(workdir, name),
        dram_bytes=(repeat + 2) * nbytes if dram else 0,
        ssd_bytes=(repeat + 2) * 4 * nbytes,
        extra=extra,
    )
    out: dict[str, Any] = {}
    try:
        with KVClient([server.address], streams_per_replica=streams) as kv:
            kv.put_pages(synthetic_pages(2, layout, "bench@v1", seed=1), "warmup")
            t_put = float("inf")
            batches = [synthetic_pages(n, layout, "bench@v1", seed=100 + i) for i in range(repeat)]
            cpu = _Cpu(server.proc.pid)
            for i, fresh in enumerate(batches):
                # Fresh pages each time (a fresh owner of the same pages would only claim them).
                t = time.perf_counter()
                stored = kv.put_pages(fresh, f"put{i}")
                t_put = min(t_put, time.perf_counter() - t)
                assert stored == n, f"stored {stored} of {n}"
            out.update(cpu.per_gb("put_", nbytes * repeat))
            out["put_gbps"] = _gbps(nbytes, t_put)
            last = batches[-1]
            t_get = float("inf")
            cpu = _Cpu(server.proc.pid)
            for _ in range(repeat):
                t = time.perf_counter()
                got = kv.fetch_prefix(last.token_ids, "bench@v1", layout)
                t_get = min(t_get, time.perf_counter() - t)
                assert got is not None and got.pages == last.pages, "fetched pages differ from the stored ones"
                del got
            out.update(cpu.per_gb("get_", nbytes * repeat))
            out["get_gbps"] = _gbps(nbytes, t_get)
            stats = kv.store_stats()[server.address] or {}
            out["dram_bytes"], out["ssd_bytes"] = stats.get("dram_bytes", 0), stats.get("ssd_bytes", 0)
    finally:
        server.stop()
    return out


def bench_throughput(total_bytes: int, repeat: int, workdir: str, streams: int) -> dict[str, Any]:
    layout = SMOLLM_LAYOUT
    n = max(8, total_bytes // layout.page_bytes)
    pages = synthetic_pages(n, layout, "bench@v1")
    nbytes = n * layout.page_bytes
    out: dict[str, Any] = {"page_bytes": layout.page_bytes, "pages": n, "bytes": nbytes, "streams": streams}
    # The client process is tuned as KVClient does it (the first KVClient would do it anyway); the
    # bare server and the kvstore server tune themselves.
    out["malloc_tuned"] = tune_malloc_for_pages()
    out["crc32_impl"] = CRC32_IMPL

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
    ssd = SsdTier(os.path.join(workdir, "rocks"))
    meta = b"{}"

    def rocks_put() -> None:
        for h, p in zip(pages.page_hashes, pages.pages, strict=True):
            ssd.put("bench@v1", h, p, meta)

    def rocks_get() -> None:
        for h in pages.page_hashes:
            data = ssd.get("bench@v1", h)
            assert data is not None and crc32(data) >= 0

    t_rput = _best(rocks_put, 1)
    t_rget = _best(rocks_get, repeat)
    ssd.close()
    out["rocksdb_put_gbps"] = _gbps(nbytes, t_rput)
    out["rocksdb_get_gbps"] = _gbps(nbytes, t_rget)

    # 3. The bare one-way gRPC ceiling (no store, no protobuf, no crc32).
    bare = bench_bare(pages, repeat, streams, workdir)
    out["bare"] = bare
    out["bare_put_gbps"], out["bare_get_gbps"] = bare["put_gbps"], bare["get_gbps"]

    # 4. A kvstore process over loopback gRPC, through the worker's client: DRAM tier (the default
    # path: Put is acknowledged once the page is in DRAM), then RocksDB only (--dram-bytes 0).
    dram = bench_kvstore(layout, n, repeat, workdir, "svc", streams, dram=True)
    ssd_only = bench_kvstore(layout, n, repeat, workdir, "svc-ssd", streams, dram=False)
    # 5. The DRAM path with the server trusting the writer's crc32 (--verify-put-checksums false).
    noverify = bench_kvstore(
        layout, n, repeat, workdir, "svc-noverify", streams, dram=True, extra=("--verify-put-checksums", "false")
    )
    out["detail"] = {"dram": dram, "ssd": ssd_only, "noverify": noverify}
    out["grpc_put_gbps"], out["grpc_get_gbps"] = dram["put_gbps"], dram["get_gbps"]
    out["grpc_put_ssd_gbps"], out["grpc_get_ssd_gbps"] = ssd_only["put_gbps"], ssd_only["get_gbps"]
    out["grpc_put_noverify_gbps"] = noverify["put_gbps"]
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
    for k in ("grpc_put", "grpc_put_ssd", "grpc_put_noverify"):
        out[f"{k}_vs_bare"] = out[f"{k}_gbps"] / out["bare_put_gbps"]
    for k in ("grpc_get", "grpc_get_ssd"):
        out[f"{k}_vs_bare"] = out[f"{k}_gbps"] / out["bare_get_gbps"]
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
        tp = bench_throughput(mib << 20, repeat, workdir, args.streams)
        result["throughput"] = tp
        print(
            f"pages: {tp['pages']} x {tp['page_bytes']} B = {tp['bytes'] / 1e6:.0f} MB, {args.streams} streams, "
            f"crc32 by {tp['crc32_impl']}, malloc tuned: {tp['malloc_tuned']}"
        )
        for k in ("memcpy", "rocksdb_put", "rocksdb_get", "bare_put", "bare_get"):
            ratio = "" if k == "memcpy" else f"  ({tp[k + '_gbps'] / tp['memcpy_gbps']:.3f}x memcpy)"
            print(f"{k:>17}: {tp[k + '_gbps']:7.2f} GB/s{ratio}")
        for k in ("grpc_put", "grpc_get", "grpc_put_ssd", "grpc_get_ssd", "grpc_put_noverify"):
            print(
                f"{k:>17}: {tp[k + '_gbps']:7.2f} GB/s  ({tp[k + '_vs_memcpy']:.3f}x memcpy, "
                f"{tp[k + '_vs_bare']:.2f}x bare gRPC)"
            )
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
