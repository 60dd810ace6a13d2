# Research script (session 20, GPU runs); see README.md beside it.
# ruff: noqa
"""torch.profiler of one plain and one drafted engine step at batch B on the GPU (session 20)."""
import sys, time, statistics
import torch
from torch.profiler import profile, ProfilerActivity
from services.worker.engine import Draft, GenerateRequest, SamplingParams
from services.worker.engines.reference.engine import ReferenceEngine
model, B = sys.argv[1], int(sys.argv[2])
eng = ReferenceEngine.from_dir(model, device="cuda", max_batch_size=64, num_threads=1)
sp = SamplingParams(temperature=0.7, ignore_eos=True)
for i in range(B):
    eng.add_request(GenerateRequest(f"r{i}", tuple(range(100, 164 + 7 * i)), 4000, sp))
eng.step(None)
def drafts(g): return {f"r{i}": Draft.chain([200 + k for k in range(g)]) for i in range(B)} if g else None
for g in (0, 2, 0, 2):
    ts = []
    for _ in range(15):
        torch.cuda.synchronize(); t = time.perf_counter(); eng.step(drafts(g)); torch.cuda.synchronize(); ts.append(time.perf_counter() - t)
    print(f"B={B} gamma={g} step median {statistics.median(ts)*1e3:.1f} ms min {min(ts)*1e3:.1f}", flush=True)
for g in (0, 2):
    eng.step(drafts(g))
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as p:
        for _ in range(3):
            eng.step(drafts(g))
        torch.cuda.synchronize()
    ka = p.key_averages()
    print(f"== gamma {g}: ops {sum(e.count for e in ka if e.key.startswith('aten::'))//3} aten calls per step")
    print(ka.table(sort_by="cpu_time_total", row_limit=30, max_name_column_width=45))
