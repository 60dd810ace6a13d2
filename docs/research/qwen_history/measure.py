# ruff: noqa
# Research script of session 6 (seer_history on Qwen2-VL-72B), not part of the bench.
"""Where seer_history loses against the group-oracle: per-request start/finish/wait and the
group estimate the core held at each dispatch (recorded by a subclass of the core; analysis only)."""

import sys
import numpy as np
from bench.simlib import cluster as cl
from bench.simlib.cluster import RunConfig, simulate
from bench.simlib.model import INSTANCE_MODELS
from bench.simlib.workload import WORKLOADS, make_workload

name = sys.argv[1] if len(sys.argv) > 1 else "qwen2-vl-72b"
seed = int(sys.argv[2]) if len(sys.argv) > 2 else 0
runs = sys.argv[3].split(",") if len(sys.argv) > 3 else ["seer_history", "group-oracle", "history-oracle", "oracle"]
extra = dict(a.split("=") for a in sys.argv[4:])
spec = WORKLOADS[name]
w = make_workload(spec, seed)
m = INSTANCE_MODELS[name]
G = spec.group_size
L = w.lengths.reshape(-1)
gmax = np.repeat(w.lengths.max(axis=1), G)
pmax = np.repeat(w.prev_lengths.max(axis=1), G)

REC = {}  # rid -> list of (t, generated_chunks_index, estimate)


class Rec(cl.SchedulerCore):
    def next_dispatches(self, limit=None):
        out = super().next_dispatches(limit)
        for d in out:
            req = self._requests[d.request_id]
            g = self._groups[req.info.group_id]
            est = self._rank(req) if self.cfg.policy != "oracle" else float(req.info.true_length or 0)
            REC.setdefault(int(d.request_id), []).append((self.clock(), req.generated, est, len(g.finished_lengths)))
        return out


cl.SchedulerCore = Rec
CFG = {
    "seer_history": RunConfig("seer_history"),
    "group-oracle": RunConfig("oracle", oracle_rank="group_max"),
    "history-oracle": RunConfig("oracle", oracle_rank="prev_group_max"),
    "oracle": RunConfig("oracle"),
}
for k, v in extra.items():
    CFG[k] = RunConfig("seer_history", history_estimate=v)
res = {}
recs = {}
for lab in runs:
    REC.clear()
    r = simulate(w, m, CFG[lab], label=lab)
    res[lab] = r
    recs[lab] = dict(REC)
o = res.get("oracle")
for lab, r in res.items():
    t90 = r.makespan - r.tail_time
    tail = np.nonzero(r.finish_times > t90)[0]
    last = np.argsort(-r.finish_times)[:50]
    print(f"\n== {lab}: makespan {r.makespan:.0f}" + (f" ({o.makespan / r.makespan:.3f} of oracle)" if o else "") + f" t90 {t90:.0f} tail {r.tail_time:.0f}")
    print(f"   tail n={tail.size}: median len {np.median(L[tail]):.0f}, group-longest {np.mean(L[tail] == gmax[tail]):.2f}, "
          f"median start {np.median(r.start_times[tail]):.0f}, started after 10% {np.mean(r.start_times[tail] > 0.1 * r.makespan):.2f}, "
          f"median queued {np.median(r.wait_times[tail]):.0f}, mean chunks {r.chunks[tail].mean():.1f}")
    # the last 50 to finish
    rows = []
    for i in last[:15]:
        rec = recs[lab].get(int(i), [])
        e0 = rec[0][2] if rec else -1
        ests = [e for (_, _, e, _) in rec]
        rows.append(f"   r{i} g{i // G} len {L[i]} gmax {gmax[i]} prevmax {pmax[i]} start {r.start_times[i]:.0f} fin {r.finish_times[i]:.0f} "
                    f"queued {r.wait_times[i]:.0f} chunks {r.chunks[i]} est@start {e0:.0f} est@chunks {[int(e) for e in ests[1:6]]}")
    print("\n".join(rows))
    # critical-path proxy: finish - (time a request of that length needs) -> lateness. Compare by length bucket.
    big = np.argsort(-L)[:200]
    print(f"   longest 200 requests: median start {np.median(r.start_times[big]):.0f}, max start {r.start_times[big].max():.0f}, "
          f"median queued {np.median(r.wait_times[big]):.0f}, max finish {r.finish_times[big].max():.0f}")
    np.savez(f"/tmp/qh_{name}_{seed}_{lab}.npz", start=r.start_times, fin=r.finish_times, wait=r.wait_times, chunks=r.chunks,
             est0=np.array([recs[lab].get(i, [(0, 0, -1, 0)])[0][2] for i in range(L.size)]))
np.savez(f"/tmp/qh_{name}_{seed}_w.npz", L=w.lengths, P=w.prev_lengths, prompt=w.prompt_len)
