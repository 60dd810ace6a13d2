# ruff: noqa
# Research script of session 6 (tail on Moonlight), not part of the bench; see the module docstring.
"""Where Moonlight's tail goes: per-segment instance state for the capped requests."""

import sys, json, time
import numpy as np
from bench.simlib import instance as inst_mod
from bench.simlib.cluster import RunConfig, simulate
from bench.simlib.model import INSTANCE_MODELS
from bench.simlib.workload import WORKLOADS, make_workload

name = sys.argv[1] if len(sys.argv) > 1 else "moonlight"
scale = float(sys.argv[2]) if len(sys.argv) > 2 else 1.0
policies = sys.argv[3].split(",") if len(sys.argv) > 3 else ["seer", "seer_history", "oracle"]
spec = WORKLOADS[name].scaled(scale) if scale != 1 else WORKLOADS[name]
w = make_workload(spec, 0)
m = INSTANCE_MODELS[name]
L = w.lengths.reshape(-1)
cap = spec.max_tokens
capped = set(np.nonzero(L == cap)[0].tolist())
SEG = []
orig = inst_mod.Instance.advance


def adv(self, t):
    b = self.batch
    start = max(self.t, self.stall_until)
    if b and t > start:
        S = float(self.ctx[:b].sum())
        cr = [int(s.rid) for s in self.slots if int(s.rid) in capped]
        SEG.append((self.iid, start, t, b, S, cr, self.m.step_time(b, S, self.m.gamma if self.spec_now else 0)))
    return orig(self, t)


inst_mod.Instance.advance = adv
base = simulate(w, m, RunConfig("baseline"))
print(
    f"{name} scale {scale}: {L.size} req, {len(capped)} capped; baseline makespan {base.makespan:.0f} tail {base.tail_time:.0f}"
)
for pol in policies:
    SEG.clear()
    r = simulate(w, m, RunConfig(pol))
    t90 = r.makespan - r.tail_time
    ft = r.finish_times
    tail = np.nonzero(ft > t90)[0]
    ncap_tail = sum(1 for i in tail if i in capped)
    cap_idx = np.array(sorted(capped))
    # per capped request: time-weighted batch/ctx/step over its life, and after t90
    life = {i: [0.0, 0.0, 0.0, 0.0] for i in capped}  # span, span*B, span*S, span*step
    after = {i: [0.0, 0.0, 0.0, 0.0] for i in capped}
    inst_after = {}  # iid -> span*B, span after t90 with capped present
    for iid, s, e, b, S, cr, st in SEG:
        for i in cr:
            d = life[i]
            d[0] += e - s
            d[1] += (e - s) * b
            d[2] += (e - s) * S
            d[3] += (e - s) * st
            if e > t90:
                s2 = max(s, t90)
                a = after[i]
                a[0] += e - s2
                a[1] += (e - s2) * b
                a[2] += (e - s2) * S
                a[3] += (e - s2) * st

    def agg(dd):
        sp = sum(v[0] for v in dd.values())
        return (
            sp,
            sum(v[1] for v in dd.values()) / sp,
            sum(v[2] for v in dd.values()) / sp,
            sum(v[3] for v in dd.values()) / sp,
        )

    sp, B, S, st = agg(life)
    spa, Ba, Sa, sta = agg(after)
    alone = m.a + m.b + m.c * (1024 + cap / 2)
    print(
        f"\n[{pol}] makespan {r.makespan:.0f} t90 {t90:.0f} tail {r.tail_time:.0f} ({r.tail_time / base.tail_time:.3f}x base); "
        f"tail reqs {tail.size}, capped among them {ncap_tail} (of {len(capped)} capped)"
    )
    cs = r.start_times[cap_idx]
    cf = ft[cap_idx]
    print(
        f"  capped: start median {np.median(cs):.0f} max {cs.max():.0f}; finish min {cf.min():.0f} median {np.median(cf):.0f} max {cf.max():.0f}; "
        f"queued median {np.median(r.wait_times[cap_idx]):.0f} s; running time median {np.median(cf - cs - r.wait_times[cap_idx]):.0f}"
    )
    print(
        f"  capped lifetime (time-weighted over their running segments): batch {B:.0f}, ctx sum {S / 1e3:.0f}K, step {st * 1e3:.1f} ms "
        f"(alone at mean ctx: {alone * 1e3:.1f} ms -> {cap * alone:.0f} s for a full response)"
    )
    print(
        f"  capped after t90: running-request-seconds {spa:.0f} (= {spa / max(r.tail_time, 1):.1f} capped requests on average), batch {Ba:.0f}, ctx {Sa / 1e3:.0f}K, step {sta * 1e3:.1f} ms"
    )
    # cluster after t90
    tot = sum(e - max(s, t90) for iid, s, e, b, S, cr, st in SEG if e > t90)
    busyB = sum((e - max(s, t90)) * b for iid, s, e, b, S, cr, st in SEG if e > t90)
    capB = sum((e - max(s, t90)) * len(cr) for iid, s, e, b, S, cr, st in SEG if e > t90)
    print(
        f"  cluster after t90: instance-busy-seconds {tot:.0f} of {spec.instances * r.tail_time:.0f}; mean batch when busy {busyB / max(tot, 1):.1f}; capped share of running {capB / max(busyB, 1):.2f}"
    )
    # timeline: number of capped running and unfinished over time in deciles of the makespan
    qs = np.linspace(0, r.makespan, 11)[1:]
    print("  unfinished capped at 10%..100% of makespan:", [int((cf > q).sum()) for q in qs])
    print("  unfinished all at 10%..100%:", [int((ft > q).sum()) for q in qs])
    # tail composition by length
    Lt = L[tail]
    print(
        f"  tail lengths: capped {np.mean(Lt == cap):.2f}, >=0.8cap {np.mean(Lt >= 0.8 * cap):.2f}, median {np.median(Lt):.0f}, min {Lt.min()}"
    )
    # what the last-finishing capped request would need: tokens left at t90
