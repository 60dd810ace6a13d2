# ruff: noqa
# Research script of session 8 (what bench.sched_real's scale allows), not part of the bench.
"""What the 2-worker sched_real scale allows: the simulator's policies (incl. the oracle) on a
workload shaped like bench.sched_real's (10 groups x 4, every 4th group runs to 96 tokens, the
others stop after ~10), instances modelled on the CPU worker (1 thread, batch 4).

    PYTHONPATH=$PWD python docs/research/sched_real_scale/sim.py MAX_TOKENS LONG_GROUPS_COLLIDE LONG_GROUPS_SPREAD
    e.g. 96 3,7 3,6 (the bench's shape: the baseline's round-robin puts groups 3 and 7 on one
    worker, 3 and 6 on both)."""
import sys, statistics
import numpy as np
from bench.simlib.workload import WorkloadSpec, Workload
from bench.simlib.model import InstanceModel
from bench.simlib.cluster import RunConfig, simulate

MAXT = int(sys.argv[1]); LONGS = {False: [int(x) for x in sys.argv[2].split(",")], True: [int(x) for x in sys.argv[3].split(",")]}
def workload(seed, spread):
    rng = np.random.default_rng(seed)
    groups = 10
    spec = WorkloadSpec("sched_real", groups, 4, MAXT, 30, 2, prompt_mean=8, min_len=1)
    L = np.clip(np.round(np.exp(np.log(8) + rng.normal(0, 0.5, (groups, 1)) + rng.normal(0, 0.4, (groups, 4)))), 2, MAXT).astype(np.int64)
    longs = LONGS[spread]
    for g in longs:
        L[g, :] = MAXT
    prev = L.copy()
    return Workload(spec, np.full(groups, 8), L, prev)

model = InstanceModel(a=0.065, b=0.008, c=0.0, prefill_tps=2000.0, fetch_tps=1e6, kv_tokens=100_000, max_batch=4)
res = {}
for spread in (False, True):
    for seed in range(10):
        w = workload(seed, spread)
        base = simulate(w, model, RunConfig("baseline", chunk_size=32))
        def tail(r):
            f = np.sort(r.finish_times); return f[-1] - f[int(0.9 * len(f)) - 1]
        for pol in ("divided", "seer", "seer_history", "oracle"):
            r = simulate(w, model, RunConfig(pol, chunk_size=32, load_imbalance_threshold=1))
            res.setdefault((spread, pol), []).append((base.makespan / r.makespan, tail(r) / tail(base)))
for (spread, pol), v in sorted(res.items()):
    print("spread" if spread else "collide", pol, "thr x%.3f" % statistics.median(a for a, _ in v), "tail x%.3f" % statistics.median(b for _, b in v))
