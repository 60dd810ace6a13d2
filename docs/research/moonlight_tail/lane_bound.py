# ruff: noqa
# Research script of session 6 (tail on Moonlight), not part of the bench; see the module docstring.
"""Idealised fast lane with TRUE lengths (a bound, not a policy): oracle longest-first order; requests
whose true length >= thr go only to the first L workers ("lane"); the lane holds at most `lane_batch`
requests; other requests go to non-lane workers (or to the lane if `share`, only when it is below lane_batch)."""

import sys, itertools
import numpy as np
import bench.simlib.cluster as cl
from services.scheduler.core import SchedulerCore
from bench.simlib.cluster import RunConfig, simulate
from bench.simlib.model import INSTANCE_MODELS
from bench.simlib.workload import WORKLOADS, make_workload

P = {}


class LaneCore(SchedulerCore):
    def _try_place(self, req):
        L, thr, lb, share = P["L"], P["thr"], P["lane_batch"], P["share"]
        if L == 0:
            return super()._try_place(req)
        ids = sorted(self._workers)
        lane = set(ids[:L])
        if POLICY == "oracle":
            crit = (req.info.true_length or 0) >= thr
        else:
            g = self._groups[req.info.group_id]
            informed = g.prior is not None or bool(g.finished_lengths)
            crit = informed and g.request_estimate(req.generated, self._factor(g)) >= thr
        crit = crit and req.generated >= GEN0
        full = self._workers
        if crit:
            sub = {k: v for k, v in full.items() if k in lane and v.load < lb}
        else:
            sub = {k: v for k, v in full.items() if k not in lane or (share and v.load < lb)}
        self._workers = sub
        try:
            return super()._try_place(req)
        finally:
            self._workers = full


cl.SchedulerCore = LaneCore

import os

RANK = os.environ.get("RANK", "true")
POLICY = os.environ.get("POLICY", "oracle")
GEN0 = int(os.environ.get("GEN0", "0"))
name = sys.argv[1]
scale = float(sys.argv[2])
spec = WORKLOADS[name].scaled(scale) if scale != 1 else WORKLOADS[name]
w = make_workload(spec, int(os.environ.get("SEED", "0")))
m = INSTANCE_MODELS[name]
P.update(L=0, thr=0, lane_batch=10**9, share=False)
base = simulate(w, m, RunConfig("baseline"))
orc = simulate(w, m, RunConfig("oracle"))
print(f"{name} x{scale}: oracle makespan {orc.makespan:.0f} tail {orc.tail_time / base.tail_time:.3f}")
Ls = sorted(np.unique(w.lengths))[::-1]
for arg in sys.argv[3:]:
    L, thr, lb, share = arg.split(":")
    P.update(L=int(L), thr=float(thr), lane_batch=int(lb), share=share == "1")
    r = simulate(w, m, RunConfig(POLICY, oracle_rank=RANK))
    crit = w.lengths.reshape(-1) >= float(thr)  # truly long (reporting)
    ft = r.finish_times
    print(
        f"L={L:>3} thr={thr:>6} lane_batch={lb:>4} share={share}: crit {crit.sum()}, makespan {r.makespan:.0f} "
        f"frac-oracle {orc.makespan / r.makespan:.3f} tail {r.tail_time:.0f} s = {r.tail_time / base.tail_time:.3f}x; "
        f"crit finish median {np.median(ft[crit]):.0f} max {ft[crit].max():.0f}; non-crit max {ft[~crit].max():.0f}; wall {r.wall_seconds:.0f}s",
        flush=True,
    )
