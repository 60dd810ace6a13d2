# ruff: noqa
"""Deferral bound with TRUE lengths (not a policy): the oracle holds the `n` shortest requests back
until clock >= T0, so they run in the tail beside the capped ones (a metric effect on 'tail' mostly).
    python docs/research/moonlight_tail/defer_bound.py moonlight N T0 [T0 ...]"""

import sys
import numpy as np
import bench.simlib.cluster as cl
from services.scheduler.core import SchedulerCore
from bench.simlib.cluster import RunConfig, simulate
from bench.simlib.model import INSTANCE_MODELS
from bench.simlib.workload import WORKLOADS, make_workload

P = {"X": -1, "T0": 0.0}


class DeferCore(SchedulerCore):
    def _try_place(self, req):
        if (req.info.true_length or 0) <= P["X"] and self.clock() < P["T0"]:
            return None
        return super()._try_place(req)


cl.SchedulerCore = DeferCore
name, n = sys.argv[1], int(sys.argv[2])
w = make_workload(WORKLOADS[name], 0)
m = INSTANCE_MODELS[name]
base = simulate(w, m, RunConfig("baseline"))
orc = simulate(w, m, RunConfig("oracle"))
P["X"] = int(np.sort(w.lengths.reshape(-1))[n - 1])
print(
    f"oracle makespan {orc.makespan:.0f} tail {orc.tail_time / base.tail_time:.3f}; held: {n} shortest (<= {P['X']} tokens)"
)
for t0 in sys.argv[3:]:
    P["T0"] = float(t0)
    r = simulate(w, m, RunConfig("oracle", admission_lookahead=10**6))
    print(
        f"T0 {t0}: makespan {r.makespan:.0f} frac-oracle {orc.makespan / r.makespan:.3f} tail {r.tail_time:.0f} s = {r.tail_time / base.tail_time:.3f}x",
        flush=True,
    )
