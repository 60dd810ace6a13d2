# ruff: noqa
# Research script (session 11); see README.md beside it. PYTHONPATH=$PWD python docs/research/gemm_prefetch/b8_off_adaptive.py TABLE.json [T]
"""b8 T1.0: off vs adaptive, alternating, with step-time accounting split by drafted/plain steps."""
import statistics, sys, time, torch
from bench.engine import SpecRun, PROMPTS, GAMMA
from bench.spec import tokenize_prompts
from services.worker.adaptive import AdaptiveSpeculation, StepTimeTable
from services.worker.engine import GenerateRequest, SamplingParams
from services.worker.engines.reference.engine import ReferenceEngine
from services.worker.model.prepare import ensure_model
md = ensure_model()
prompts = tokenize_prompts(md, PROMPTS)[:6]
eng = ReferenceEngine.from_dir(md, device="cpu", max_batch_size=64, num_threads=1)
table = StepTimeTable.load(sys.argv[1])
planner = AdaptiveSpeculation(table, gamma_max=GAMMA)
T = float(sys.argv[2]) if len(sys.argv) > 2 else 1.0
orig_step = eng.step
acct = {}
mode = ["off"]
def step(drafts=None):
    c = time.thread_time(); r = orig_step(drafts); dt = time.thread_time() - c
    k = (mode[0], bool(drafts)); a = acct.setdefault(k, [0, 0.0]); a[0] += 1; a[1] += dt
    return r
eng.step = step
tot = {"off": [0, 0.0], "adaptive": [0, 0.0]}
for rep in range(2):
    for p, prompt in enumerate(prompts):
        for m in (("off", "adaptive") if (p + rep) % 2 else ("adaptive", "off")):
            mode[0] = m
            reqs = [GenerateRequest(f"{m}-{rep}-{p}-{i}", tuple(prompt), 96, SamplingParams(temperature=T, top_p=1.0, ignore_eos=True, seed=7000 + 31 * p + i)) for i in range(8)]
            r = SpecRun(eng, prompt, []).run(reqs, m, planner)
            tot[m][0] += r["tokens"]; tot[m][1] += r["cpu_s"]
print("tok/cpu-s off %.1f adaptive %.1f ratio %.3f" % (tot["off"][0]/tot["off"][1], tot["adaptive"][0]/tot["adaptive"][1], (tot["adaptive"][0]/tot["adaptive"][1])/(tot["off"][0]/tot["off"][1])))
for k, (n, s) in sorted(acct.items()): print(k, n, "steps, mean %.1f ms, total %.2f s" % (1e3*s/n, s))
print("cpu outside step: off %.2f s, adaptive %.2f s" % (tot["off"][1] - acct[("off", False)][1], tot["adaptive"][1] - sum(v[1] for k, v in acct.items() if k[0] == "adaptive")))
