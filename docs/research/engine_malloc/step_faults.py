# ruff: noqa
# Research script (session 9); see README.md beside it.
"""Minor page faults and thread CPU time per engine step, malloc tuned or not (one process = one arm).

    PYTHONPATH=$PWD python docs/research/engine_malloc/step_faults.py T TOP_P [tuned|untuned] [BATCHES] [GAMMAS] [MAX_NEW]
e.g. ... 0.7 0.9 untuned 1,4,8 0,2,4 400   /   ... 1.0 1.0 tuned 16,32 0,1 160
"""
import resource, statistics, sys, time
from services.worker.engine import Draft, GenerateRequest, SamplingParams
from services.worker.engines.reference.engine import ReferenceEngine
from services.worker.model.prepare import ensure_model

temp, topp = float(sys.argv[1]), float(sys.argv[2])
tuned = (sys.argv[3] if len(sys.argv) > 3 else "tuned") == "tuned"
batches = [int(x) for x in (sys.argv[4] if len(sys.argv) > 4 else "1,4,8").split(",")]
gammas = [int(x) for x in (sys.argv[5] if len(sys.argv) > 5 else "0,2,4").split(",")]
max_new = int(sys.argv[6]) if len(sys.argv) > 6 else 400  # small: admission reserves prefix + max_new pages
res = []
for B in batches:
    eng = ReferenceEngine.from_dir(ensure_model(), device="cpu", max_batch_size=64, num_threads=1, tune_malloc=tuned)
    sp = SamplingParams(temperature=temp, top_p=topp, ignore_eos=True, seed=1)
    for i in range(B):
        eng.add_request(GenerateRequest(f"r{i}", tuple(range(100, 164 + 7 * i)), max_new, sp))
    eng.step(None)
    assert eng.stats().running == B, eng.stats()
    for gamma in gammas:
        drafts = lambda: {f"r{i}": Draft.chain([200 + k for k in range(gamma)]) for i in range(B)} if gamma else None
        eng.step(drafts())  # not counted: the first step of a new shape grows the heap once
        ts = []
        f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        for _ in range(8):
            d = drafts()
            c = time.thread_time()
            eng.step(d)
            ts.append(time.thread_time() - c)
        fl = (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0) / 8
        res.append(f"B{B}g{gamma} {statistics.median(ts) * 1e3:.1f}ms {fl:.0f}flt")
print("TUNED" if tuned else "UNTUNED", " | ".join(res), flush=True)
