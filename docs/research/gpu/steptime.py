# Research script (session 20, GPU runs); see README.md beside it.
# ruff: noqa
"""Median engine step time, plain and with 2-token drafts for every request, at batch B (GPU)."""
import sys, time, statistics
import torch
from services.worker.engine import Draft, GenerateRequest, SamplingParams
from services.worker.engines.reference.engine import ReferenceEngine
model, B, tag = sys.argv[1], int(sys.argv[2]), sys.argv[3]
eng = ReferenceEngine.from_dir(model, device="cuda", max_batch_size=64, num_threads=1)
sp = SamplingParams(temperature=0.7, ignore_eos=True)
for i in range(B):
    eng.add_request(GenerateRequest(f"r{i}", tuple(range(100, 164 + 7 * i)), 4000, sp))
eng.step(None)
def drafts(g): return {f"r{i}": Draft.chain([200 + k for k in range(g)]) for i in range(B)} if g else None
res = {0: [], 2: []}
for rep in range(4):
    for g in (0, 2):
        ts = []
        for _ in range(20):
            torch.cuda.synchronize(); t = time.perf_counter(); eng.step(drafts(g)); torch.cuda.synchronize(); ts.append(time.perf_counter() - t)
        res[g].append(statistics.median(ts) * 1e3)
print(f"{tag} B={B} plain ms {[round(x, 1) for x in res[0]]} drafted(2) ms {[round(x, 1) for x in res[2]]}", flush=True)
