# ruff: noqa
# Research script of session 6 (seer_history on Qwen2-VL-72B), not part of the bench.
"""seer_history with each history_estimate against the oracle, full scale:
python docs/research/qwen_history/compare.py WORKLOADS SEEDS ESTIMATES"""

import sys
from bench.simlib.cluster import RunConfig, simulate
from bench.simlib.model import INSTANCE_MODELS
from bench.simlib.workload import WORKLOADS, make_workload

names = sys.argv[1].split(",") if len(sys.argv) > 1 else list(WORKLOADS)
seeds = [int(x) for x in sys.argv[2].split(",")] if len(sys.argv) > 2 else [0, 1]
modes = sys.argv[3].split(",") if len(sys.argv) > 3 else ["scaled", "posterior"]
for name in names:
    for seed in seeds:
        w = make_workload(WORKLOADS[name], seed)
        m = INSTANCE_MODELS[name]
        base = simulate(w, m, RunConfig("baseline"))
        o = simulate(w, m, RunConfig("oracle"))
        cells = []
        for mode in modes:
            r = simulate(w, m, RunConfig("seer_history", history_estimate=mode))
            cells.append(f"{mode} {o.makespan / r.makespan:.3f} / {r.tail_time / base.tail_time:.3f}")
        print(f"{name} seed {seed}: " + "; ".join(cells), flush=True)
