# ruff: noqa
# Research script of session 8, not part of the bench.
"""trace.py with CPU accounting and kept logs (seer, divided, seer, divided; logs under
/tmp/s8/suite_logs2 for occupancy.py). When the long requests of bench.sched_real's workload finish under divided and seer (the same
samples, seed scope "x", the collide order of repetition 0), polled from GetBatch every 50 ms.
A request's "start" is its first committed chunk. PYTHONPATH=$PWD python docs/research/sched_real_scale/trace.py"""
import sys, time
from pathlib import Path
from seer_client import SeerClient
from services.cli.up import Suite
from services.worker.model.prepare import ensure_model
from bench.sched_real import RealWorkload, switch_policy
wl = RealWorkload(groups=10, group_size=4, max_tokens=96, long_every=4)
model = ensure_model()
out = {}
with Suite(data_dir=Path("/tmp/s8/suite_logs2"), workers=2, policy="divided", speculation=False, model_dir=Path(model), chunk_size=32, threads_per_worker=1,
           cpu_affinity=[0, 1], extra_args={f"worker-{i}": ["--max-batch-size", "4"] for i in range(2)}) as suite:
    with SeerClient(suite.address) as c:
        c.run_batch("warm", wl.prompt_groups(seed=1))
    order = wl.submission_order(0, 2)
    from bench.spec import _process_cpu_s
    for policy in ("seer", "divided", "seer", "divided"):
        switch_policy(suite, policy, 2)
        bid = f"{policy}-{time.time():.0f}"
        first, chunks_seen, fin = {}, {}, {}
        pids = {n: sv.pid for n, sv in suite.services.items()}
        cpu0 = {n: _process_cpu_s(p) for n, p in pids.items()}
        with SeerClient(suite.address) as c:
            t0 = time.monotonic()
            c.submit_batch(bid, wl.prompt_groups(seed=100, order=order), seed_scope="x")
            while True:
                st = c.get_batch(bid, include_requests=True)
                t = time.monotonic() - t0
                for r in st.requests:
                    if r.generated_tokens > 0 and r.request_id not in first: first[r.request_id] = t
                    if r.state == "finished" and r.request_id not in fin: fin[r.request_id] = t
                if st.done: break
                time.sleep(0.05)
        print(policy, "cpu s", {n: round(_process_cpu_s(p) - cpu0[n], 2) for n, p in pids.items()}, flush=True)
        longs = [f"{bid}/{g}/{s}" for g, i in enumerate(order) if wl.is_long(i) for s in range(4)]
        print(policy, "makespan %.2f" % max(fin.values()), "long starts", sorted(round(first.get(r, -1), 1) for r in longs),
              "long finishes", sorted(round(fin[r], 1) for r in longs), flush=True)
