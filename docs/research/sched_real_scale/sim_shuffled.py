# ruff: noqa
# Research script of session 8, not part of the bench.
"""sim.py with the long groups at random positions, as bench.sched_real shuffles them (20 seeds per
placement): PYTHONPATH=$PWD python docs/research/sched_real_scale/sim_shuffled.py"""
import statistics, random
import numpy as np
from bench.simlib.workload import WorkloadSpec, Workload
from bench.simlib.model import InstanceModel
from bench.simlib.cluster import RunConfig, simulate
model = InstanceModel(a=0.065, b=0.008, c=0.0, prefill_tps=2000.0, fetch_tps=1e6, kv_tokens=100_000, max_batch=4)
def tail(r):
    f = np.sort(r.finish_times); return f[-1] - f[int(0.9 * len(f)) - 1]
res = {}
for seed in range(20):
    rng = np.random.default_rng(seed); prng = random.Random(seed)
    L = np.clip(np.round(np.exp(np.log(8) + rng.normal(0, 0.5, (10, 1)) + rng.normal(0, 0.4, (10, 4)))), 2, 96).astype(np.int64)
    for collide in (True, False):
        while True:
            longs = prng.sample(range(10), 2)
            if (longs[0] % 2 == longs[1] % 2) == collide: break
        LL = L.copy()
        for g in longs: LL[g, :] = 96
        w = Workload(WorkloadSpec("x", 10, 4, 96, 30, 2, prompt_mean=8, min_len=1), np.full(10, 8), LL, LL.copy())
        base = simulate(w, model, RunConfig("baseline", chunk_size=32))
        for pol in ("divided", "seer", "oracle"):
            r = simulate(w, model, RunConfig(pol, chunk_size=32, load_imbalance_threshold=1))
            res.setdefault((collide, pol), []).append((base.makespan / r.makespan, tail(r), tail(base)))
for (collide, pol), v in sorted(res.items()):
    print("collide" if collide else "spread", pol, "thr x%.3f" % statistics.median(a for a, _, _ in v),
          "tail median x%.3f" % statistics.median(t / b for _, t, b in v), "pooled x%.3f" % (sum(t for _, t, _ in v) / sum(b for _, _, b in v)))
