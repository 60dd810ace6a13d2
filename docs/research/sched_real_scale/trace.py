# ruff: noqa
# Research script of session 8, not part of the bench.
"""When the long requests of bench.sched_real's workload finish under each policy (the same
samples, seed scope "x", the collide order of repetition 0), polled from GetBatch every 50 ms, and
the CPU seconds of every service per arm. A request's "start" is its first committed chunk.

    PYTHONPATH=$PWD python docs/research/sched_real_scale/trace.py [LOG_DIR] [POLICIES]

LOG_DIR keeps the suite's data dir (its logs/ are what occupancy.py reads); POLICIES defaults to
divided,seer,divided,seer."""
import sys, tempfile, time
from pathlib import Path
from seer_client import SeerClient
from services.cli.up import Suite
from services.worker.model.prepare import ensure_model
from bench.sched_real import RealWorkload, switch_policy
from bench.spec import _process_cpu_s

data_dir = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(tempfile.mkdtemp(prefix="trace-"))
policies = sys.argv[2].split(",") if len(sys.argv) > 2 else ["divided", "seer", "divided", "seer"]
wl = RealWorkload(groups=10, group_size=4, max_tokens=96, long_every=4)
with Suite(data_dir=data_dir, workers=2, policy="divided", speculation=False, model_dir=Path(ensure_model()),
           chunk_size=32, threads_per_worker=1, cpu_affinity=[0, 1],
           extra_args={f"worker-{i}": ["--max-batch-size", "4"] for i in range(2)}) as suite:
    with SeerClient(suite.address) as c:
        c.run_batch("warm", wl.prompt_groups(seed=1))
    order = wl.submission_order(0, 2)
    for policy in policies:
        switch_policy(suite, policy, 2)
        bid = f"{policy}-{time.time():.0f}"
        first, fin = {}, {}
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
        longs = [f"{bid}/{g}/{s}" for g, i in enumerate(order) if wl.is_long(i) for s in range(4)]
        print(policy, "makespan %.2f" % max(fin.values()), "long starts", sorted(round(first.get(r, -1), 1) for r in longs),
              "long finishes", sorted(round(fin[r], 1) for r in longs),
              "cpu s", {n: round(_process_cpu_s(p) - cpu0[n], 2) for n, p in pids.items()}, flush=True)
