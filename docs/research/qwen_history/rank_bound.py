# ruff: noqa
# Research script of session 6 (seer_history on Qwen2-VL-72B), not part of the bench.
"""Bounds: the oracle policy ranking every member by a per-group score (true group max times noise
of a given log-sd; history-only estimators). Analysis only (subclasses the core)."""

import sys
import numpy as np
from bench.simlib import cluster as cl
from bench.simlib.cluster import RunConfig, simulate
from bench.simlib.model import INSTANCE_MODELS
from bench.simlib.workload import WORKLOADS, make_workload

name = sys.argv[1] if len(sys.argv) > 1 else "qwen2-vl-72b"
seed = int(sys.argv[2]) if len(sys.argv) > 2 else 0
spec = WORKLOADS[name]
w = make_workload(spec, seed)
m = INSTANCE_MODELS[name]
G = spec.group_size
SCORE = None


class Ranked(cl.SchedulerCore):
    def _key(self, req):
        if SCORE is not None and self.cfg.policy == "oracle":
            return (-float(SCORE[int(req.info.request_id) // G]),)
        return super()._key(req)


cl.SchedulerCore = Ranked
o = simulate(w, m, RunConfig("oracle"))
gmax = w.lengths.max(1).astype(float)
lp = np.log(w.prev_lengths)
s = np.sqrt(np.mean(np.var(lp, axis=1, ddof=1)))
z = np.random.default_rng(123).normal(size=gmax.size)
scores = {f"gmax*exp(N(0,{sd}))": gmax * np.exp(sd * z) for sd in (0.05, 0.1, 0.15, 0.175, 0.205)}
scores["prev max"] = w.prev_lengths.max(1).astype(float)
scores["prev mean log"] = np.exp(lp.mean(1))
scores["prev median"] = np.median(w.prev_lengths, 1).astype(float)
for lab, sc in scores.items():
    SCORE = sc
    r = simulate(w, m, RunConfig("oracle"))
    err = np.log(sc) - np.log(gmax)
    err -= err.mean()
    print(f"{name} seed {seed} {lab:24s} log-err sd {err.std():.3f}: {o.makespan / r.makespan:.3f} of oracle, tail {r.tail_time:.0f} s", flush=True)
