# ruff: noqa
# Research script (session 10); see README.md beside it.
"""Engine step time (thread CPU) with the paged attention kernel vs gather + SDPA, alternating in
one process, for plain decode and drafted steps.

    PYTHONPATH=$PWD python docs/research/paged_attn/step_ab.py BATCH CONTEXT
"""
import statistics, sys, time, torch
from services.worker.engine import Draft, GenerateRequest, SamplingParams
from services.worker.engines.reference.engine import ReferenceEngine
from services.worker.engines.reference.kernels.attention import paged_attention_enabled
from services.worker.model.prepare import ensure_model
B = int(sys.argv[1]); ctx = int(sys.argv[2])
eng = ReferenceEngine.from_dir(ensure_model(), device="cpu", max_batch_size=64, num_threads=1)
sp = SamplingParams(temperature=0.7, top_p=0.9, ignore_eos=True, seed=1)
for i in range(B):
    eng.add_request(GenerateRequest(f"r{i}", tuple(range(100, 100 + ctx + 7 * i)), 200, sp))
eng.step(None)
arms = {"g0": lambda: None, "one2": lambda: {"r0": Draft.chain([200, 201])},
        "all2": lambda: {f"r{i}": Draft.chain([200, 201]) for i in range(B)},
        "all4": lambda: {f"r{i}": Draft.chain([200, 201, 202, 203]) for i in range(B)}}
res = {(k, f): [] for k in arms for f in (False, True)}
for rep in range(5):
    for k, fa in arms.items():
        for flag in ((False, True) if rep % 2 else (True, False)):
            with paged_attention_enabled(flag):
                d = fa(); c = time.thread_time(); eng.step(d); res[(k, flag)].append(time.thread_time() - c)
print(f"B={B} ctx~{ctx}: " + "  ".join(f"{k} sdpa {statistics.median(res[(k, False)])*1e3:.0f} kernel {statistics.median(res[(k, True)])*1e3:.0f}ms ({statistics.median(res[(k, False)])/statistics.median(res[(k, True)]):.2f}x)" for k in arms))
