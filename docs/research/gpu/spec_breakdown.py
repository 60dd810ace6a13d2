# ruff: noqa
# Research script (session 6, GPU runs); see README.md beside it.
"""Where the wall time of bench.engine's lockstep speculation arms goes: engine step vs drafting vs
the rest, per arm (off / forced / adaptive), plus steps and requests per step.

    python3 docs/research/gpu/spec_breakdown.py DEVICE MODEL_DIR TABLE [BATCH] [TEMP] [PROMPTS]
"""
import sys, time
from collections import defaultdict
from pathlib import Path
import torch
import bench.engine as be
from services.worker.adaptive import StepTimeTable
from services.worker.engines.reference.engine import ReferenceEngine

dev, model, table = sys.argv[1], Path(sys.argv[2]), StepTimeTable.load(sys.argv[3])
batch = int(sys.argv[4]) if len(sys.argv) > 4 else 8
temp = float(sys.argv[5]) if len(sys.argv) > 5 else 0.7
n_prompts = int(sys.argv[6]) if len(sys.argv) > 6 else 3
be._WALL_CLOCK = dev != "cpu"
torch.set_num_threads(1)
eng = ReferenceEngine.from_dir(model, device=dev, max_batch_size=64, num_threads=1)
prompts = be.tokenize_prompts(model, be.PROMPTS)[:n_prompts]

acc = defaultdict(lambda: defaultdict(float))
mode = ["sib"]
orig_step, orig_drafts, orig_run = ReferenceEngine.step, be.SpecRun._drafts, be.SpecRun.run

def step(self, drafts=None):
    t = time.perf_counter(); out = orig_step(self, drafts); dt = time.perf_counter() - t
    a = acc[mode[0]]; a["step_s"] += dt; a["steps"] += 1; a["reqs"] += len(out)
    if drafts:
        a["draft_steps"] += 1; a["draft_step_s"] += dt; a["drafted_reqs"] += len(drafts)
    return out

def drafts(self, *a, **k):
    t = time.perf_counter(); out = orig_drafts(self, *a, **k); acc[mode[0]]["drafts_s"] += time.perf_counter() - t
    return out

def run(self, reqs, m, planner=None):
    mode[0] = m; t = time.perf_counter(); out = orig_run(self, reqs, m, planner)
    acc[m]["wall_s"] += time.perf_counter() - t; acc[m]["tokens"] += out["tokens"]
    return out

ReferenceEngine.step, be.SpecRun._drafts, be.SpecRun.run = step, drafts, run
res, _ = be.spec_bench(eng, prompts, temp, 96, table, batches=(batch,))
print(f"{dev} b{batch} T{temp} {n_prompts} prompts: forced {res[f'b{batch}']['speedup']:.2f}x adaptive {res[f'b{batch}']['speedup_adaptive']:.2f}x")
for m in ("off", "forced", "adaptive"):
    a = acc[m]
    other = a["wall_s"] - a["step_s"] - a["drafts_s"]
    print(f"  {m:8s} wall {a['wall_s']:.2f}s tok/s {a['tokens']/a['wall_s']:.0f} steps {a['steps']:.0f} "
          f"reqs/step {a['reqs']/max(a['steps'],1):.2f} step {1e3*a['step_s']/max(a['steps'],1):.1f} ms "
          f"(draft steps {a['draft_steps']:.0f} at {1e3*a['draft_step_s']/max(a['draft_steps'],1):.1f} ms, "
          f"{a['drafted_reqs']/max(a['draft_steps'],1):.1f} drafted reqs) drafting {1e3*a['drafts_s']/max(a['steps'],1):.2f} ms/step "
          f"other {1e3*other/max(a['steps'],1):.2f} ms/step")
