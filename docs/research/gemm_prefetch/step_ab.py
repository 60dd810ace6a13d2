# ruff: noqa
# Research script (session 11); see README.md beside it.
"""Engine step time (thread CPU) with small_gemm.c as it was before session 11 (prefetch during the
first pass over a weight block only) vs now (prefetch spread over every pass), alternating in one
process, for plain decode and drafted steps.

    git show f53ba86:services/worker/engines/reference/kernels/small_gemm.c > /tmp/old_gemm.c
    PYTHONPATH=$PWD python docs/research/gemm_prefetch/step_ab.py /tmp/old_gemm.c BATCH CONTEXT
"""
import ctypes, statistics, sys, tempfile, time, torch
from pathlib import Path
from services.worker.engine import Draft, GenerateRequest, SamplingParams
from services.worker.engines.reference.engine import ReferenceEngine
from services.worker.engines.reference.kernels import build, linear
from services.worker.model.prepare import ensure_model

old_src, B, ctx = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
eng = ReferenceEngine.from_dir(ensure_model(), device="cpu", max_batch_size=64, num_threads=1)
new_fn = linear._KERNEL.get()
assert new_fn is not None, linear._KERNEL.error
# The project's own build (same flags as the engine's kernel), into a scratch directory.
old_fn = ctypes.CDLL(str(build.build(Path(old_src), Path(tempfile.mkdtemp())))).seer_small_gemm
old_fn.argtypes, old_fn.restype = new_fn.argtypes, new_fn.restype
sp = SamplingParams(temperature=0.7, top_p=0.9, ignore_eos=True, seed=1)
for i in range(B):
    eng.add_request(GenerateRequest(f"r{i}", tuple(range(100, 100 + ctx + 7 * i)), 200, sp))
eng.step(None)
arms = {"g0": lambda: None, "one2": lambda: {"r0": Draft.chain([200, 201])},
        "all1": lambda: {f"r{i}": Draft.chain([200]) for i in range(B)},
        "all2": lambda: {f"r{i}": Draft.chain([200, 201]) for i in range(B)}}
res = {(k, f): [] for k in arms for f in ("old", "new")}
for rep in range(6):
    for k, fa in arms.items():
        for which in (("old", "new") if rep % 2 else ("new", "old")):
            linear._KERNEL._fn = old_fn if which == "old" else new_fn
            d = fa(); c = time.thread_time(); eng.step(d); res[(k, which)].append(time.thread_time() - c)
med = {key: statistics.median(v) * 1e3 for key, v in res.items()}
print(f"B={B} ctx~{ctx}: " + "  ".join(f"{k} old {med[(k, 'old')]:.0f} new {med[(k, 'new')]:.0f}ms ({med[(k, 'old')] / med[(k, 'new')]:.2f}x)" for k in arms))
