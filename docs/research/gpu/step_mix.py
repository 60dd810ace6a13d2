# ruff: noqa
# Research script (session 6, GPU runs); see README.md beside it.
"""Step time of a batch of 8 with drafts for none / one / all requests (mixed-batch penalty)."""
import statistics, sys, time
import torch
from services.worker.engine import Draft, GenerateRequest, SamplingParams
from services.worker.engines.reference.engine import ReferenceEngine

dev = sys.argv[1]; model = sys.argv[2]; B = int(sys.argv[3]) if len(sys.argv) > 3 else 8
eng = ReferenceEngine.from_dir(model, device=dev, max_batch_size=64, num_threads=1)
sp = SamplingParams(temperature=1.0, ignore_eos=True)
for i in range(B):
    eng.add_request(GenerateRequest(f"r{i}", tuple(range(100, 164 + 7 * i)), 4000, sp))
eng.step(None)  # prefill

def timed(drafts_for, gamma, n=25):
    ts = []
    for _ in range(n):
        d = {f"r{i}": Draft.chain([200 + k for k in range(gamma)]) for i in drafts_for} if gamma else None
        if dev != "cpu": torch.cuda.synchronize()
        t = time.perf_counter(); eng.step(d); 
        if dev != "cpu": torch.cuda.synchronize()
        ts.append(time.perf_counter() - t)
    return statistics.median(ts) * 1e3

for rep in range(2):
    row = {"none": timed([], 0), "one_g2": timed([0], 2), "half_g2": timed(range(B // 2), 2), "all_g2": timed(range(B), 2),
           "one_g8": timed([0], 8), "all_g8": timed(range(B), 8)}
    print(f"B={B} {dev} step ms: " + " ".join(f"{k} {v:.1f}" for k, v in row.items()), flush=True)
