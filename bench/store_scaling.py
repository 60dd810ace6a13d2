"""Store scaling over a long RL run: the draft store's append cost vs live groups, and the KV store's
RocksDB column families and memtable memory vs policy versions.

    python -m bench.store_scaling [--quick]

Draft store (services.draft.store, in process): the median time of a 1-token Append to one group
with N other live groups (10, 1,000, 5,000), and with the budget full of N completed groups (every
append evicts). Before session 23 the budget check summed every group's memory under the store's
lock on each append: 0.76 ms at 1,000 groups, 5.1 ms at 5,000 (docs/benchmarks.md, session 23).
Also the cost, under the store's lock, of one forced TTL sweep (expire_now) with N live groups none
of which is due, and of seed_history for one key with N live groups of other keys (10, 1,000, 5,000;
50,000 in the full run): both scanned every live group before the expiry heap and the key index
(sweep 43 us at 1,000 groups, 0.25 ms at 5,000, 9 ms at 50,000; seed_history 0.11, 0.29, 6.4 ms), and
should now stay flat in N.

KV store (services.kvstore.store, real RocksDB in a temp dir, SSD tier only): V policy versions,
each its own namespace as a worker names them after LoadWeights (<dir>@<weights id>@v<N>), each
writes P SmolLM2-135M float32 pages (720 KiB) and releases them all, as one RL iteration does. Reports
the column families left open and the memtable bytes RocksDB holds (rocksdb.cur-size-all-mem-tables,
all column families), and the process RSS. Before session 23 each version kept its column family
(and 64 MiB x 2 of memtables) for the store's life: the quick run (30 versions) held 30 and 241 MiB.

The last line is `RESULT {json}`.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import statistics
import tempfile
import time

from services.common.kvlayout import KVLayout
from services.draft.store import DraftStore, StoreLimits
from services.kvstore.checksum import page_checksum
from services.kvstore.store import KvStore

_LAYOUT = KVLayout("float32", 16, 30, 3, 64)  # SmolLM2-135M: 720 KiB a page


def _draft_store(groups: int, completed: bool) -> DraftStore:
    s = DraftStore(StoreLimits())
    for i in range(groups):
        s.register_group(f"g{i}", f"k{i}", [(i + j) % 997 for j in range(20)], group_size=1 if completed else 4)
        s.append(f"g{i}", "r0", 0, [(i * 7 + j) % 991 for j in range(50)], finished=completed)
    s.register_group("hot", "hot", list(range(20)), group_size=4)
    return s


def _median_us(times: list[float]) -> dict[str, float]:
    return {"median": round(statistics.median(times) * 1e6, 1), "mean": round(statistics.fmean(times) * 1e6, 1)}


def _append_us(s: DraftStore, reps: int) -> dict[str, float]:
    """Median and mean microseconds of a 1-token append to the group "hot"."""
    times: list[float] = []
    for k in range(reps):
        t0 = time.perf_counter()
        s.append("hot", "r", k, [k % 1000])
        times.append(time.perf_counter() - t0)
    return _median_us(times)


def _idle_store(groups: int) -> DraftStore:
    """N live groups of keys k0..k{N-1} with the default TTL (an hour: none due in the benchmark),
    registered only (what a group holds does not change what the sweep or the key lookup cost), and
    one group of the key "hot"."""
    s = DraftStore(StoreLimits())
    for i in range(groups):
        s.register_group(f"g{i}", f"k{i}", [(i + j) % 997 for j in range(20)], group_size=4)
    s.register_group("hot", "hot", list(range(20)), group_size=4)
    return s


def _sweep_us(s: DraftStore, reps: int) -> dict[str, float]:
    """Microseconds of one forced TTL sweep (expire_now) when no group is due."""
    times: list[float] = []
    for _ in range(reps):
        t0 = time.perf_counter()
        s.expire_now()
        times.append(time.perf_counter() - t0)
    return _median_us(times)


def _seed_us(s: DraftStore, reps: int) -> dict[str, float]:
    """Microseconds of seed_history of the key "hot" (one live group) with one new 8-token response
    each time (new responses: the same ones again return before the lookup)."""
    times: list[float] = []
    for k in range(reps):
        response = [k % 1000, (k // 1000) % 1000] + [k % 7] * 6
        t0 = time.perf_counter()
        s.seed_history("hot", k, [response])
        times.append(time.perf_counter() - t0)
    return _median_us(times)


def draft(sizes: list[int], reps: int, idle_sizes: list[int] | None = None) -> dict[str, object]:
    live = {str(n): _append_us(_draft_store(n, completed=False), reps) for n in sizes}
    sweep: dict[str, dict[str, float]] = {}
    seed: dict[str, dict[str, float]] = {}
    for n in idle_sizes or sizes:
        s = _idle_store(n)
        sweep[str(n)] = _sweep_us(s, reps)
        seed[str(n)] = _seed_us(s, reps)
        assert s.expire_now() == n + 1, "a group expired during the benchmark"
    full: dict[str, dict[str, float]] = {}
    for n in sizes[1:]:
        s = _draft_store(n, completed=True)
        # The budget is the memory of the groups alone: the first append evicts all history (one
        # iteration per completed group), the later ones completed groups.
        budget = s.stats().memory_bytes - s._history.memory_bytes
        s.limits = dataclasses.replace(s.limits, memory_budget_bytes=budget)
        full[str(n)] = _append_us(s, min(reps, 100))
    return {"append_us_by_live_groups": live, "append_us_budget_full_by_completed_groups": full,
            "sweep_us_by_live_groups": sweep, "seed_history_us_by_live_groups": seed}


def _rss_mib() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return round(int(line.split()[1]) / 1024, 1)
    return 0.0


def _memtable_mib(store: KvStore) -> float:
    return round(store.stats().memtable_bytes / 2**20, 1)  # as GetKvStats reports it


def kvstore(versions: int, pages: int) -> dict[str, object]:
    d = tempfile.mkdtemp(prefix="seer-bench-cf-")
    try:
        store = KvStore(d, dram_bytes=0, ssd_bytes=64 << 30)
        data = os.urandom(_LAYOUT.page_bytes)
        csum = page_checksum(data)
        peak_cfs = 0
        peak_mib = 0.0
        t0 = time.perf_counter()
        for v in range(versions):
            ns = f"smollm2@{v:012x}@v{v}"
            for p in range(pages):
                store.put(ns, _LAYOUT, v.to_bytes(8, "big") + p.to_bytes(8, "big"), data, csum, f"r{p % 4}")
            peak_cfs = max(peak_cfs, store.stats().column_families)
            peak_mib = max(peak_mib, _memtable_mib(store))
            for r in range(4):
                store.release(ns, f"r{r}")
        out: dict[str, object] = {
            "versions": versions,
            "pages_per_version": pages,
            "seconds": round(time.perf_counter() - t0, 2),
            "column_families_open": store.stats().column_families,
            "column_families_peak": peak_cfs,
            "memtable_mib_end": _memtable_mib(store),
            "memtable_mib_peak": peak_mib,
            "rss_mib": _rss_mib(),
            "namespaces": store.stats().namespaces,
        }
        store.close()
        return out
    finally:
        shutil.rmtree(d, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.store_scaling", description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="smaller sizes, under 60 s")
    args = ap.parse_args(argv)
    sizes = [10, 1000, 5000]
    result = {
        "quick": args.quick,
        "draft": draft(sizes, reps=200 if args.quick else 500,
                       idle_sizes=sizes if args.quick else [*sizes, 50000]),
        "kvstore": kvstore(versions=30 if args.quick else 200, pages=10 if args.quick else 20),
    }
    print("RESULT " + json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
