# ruff: noqa
# Research script (session 6): torch.profiler of the lockstep b8 arms on the GPU; see README.md.
import sys, torch
from pathlib import Path
import bench.engine as be
from services.worker.adaptive import StepTimeTable
from services.worker.engines.reference.engine import ReferenceEngine
from torch.profiler import profile, ProfilerActivity
be._WALL_CLOCK = True
eng = ReferenceEngine.from_dir(Path(sys.argv[1]), device="cuda", max_batch_size=64, num_threads=1)
prompt = be.tokenize_prompts(Path(sys.argv[1]), be.PROMPTS)[0]
from services.worker.engine import GenerateRequest, SamplingParams
def mk(tag): return [GenerateRequest(f"{tag}-{i}", tuple(prompt), 48, SamplingParams(temperature=0.7, top_p=1.0, ignore_eos=True, seed=7000+i)) for i in range(8)]
be.SpecRun(eng, prompt, []).run(mk("warm"), "forced")
for mode in ("off", "forced"):
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as p:
        r = be.SpecRun(eng, prompt, []).run(mk(mode), mode)
    print(f"== {mode}: steps {r['steps']} wall {r['wall_s']:.2f}s")
    print(p.key_averages().table(sort_by="self_cpu_time_total", row_limit=14, max_name_column_width=40))
    print(p.key_averages().table(sort_by="self_cuda_time_total", row_limit=8, max_name_column_width=40))
