# ruff: noqa
# Research script (session 20, GPU runs); see README.md beside it.
"""Host time per step outside the model forward: engine step parts, draft client, planner."""
import sys, time, json
from collections import defaultdict
from pathlib import Path
import bench.spec as bs
from services.worker.engines.reference import engine as E, model_runner as MR, model as M
from services.worker import draft_client as DC, adaptive as AD
from services.worker.model.prepare import ensure_model

acc = defaultdict(float)
def wrap(cls, name, key):
    f = getattr(cls, name)
    def w(*a, **k):
        t = time.perf_counter()
        try:
            return f(*a, **k)
        finally:
            acc[key] += time.perf_counter() - t
            acc[key + "#"] += 1
    setattr(cls, name, w)
wrap(E.ReferenceEngine, "step", "step")
wrap(M.LlamaModel, "forward", "forward")
wrap(E.ReferenceEngine, "_verify", "verify")
wrap(MR.ModelRunner, "_group", "runner_group")
wrap(MR.ModelRunner, "_paged_group", "runner_paged_group")
wrap(E.ReferenceEngine, "_apply", "apply")
wrap(E.ReferenceEngine, "request_tokens", "request_tokens")
wrap(DC.DraftClient, "append", "client_append")
wrap(DC.DraftClient, "propose", "client_propose")
wrap(AD.AdaptiveSpeculation, "plan", "planner_plan")
wrap(AD.AdaptiveSpeculation, "observe", "planner_observe")
import os
model = Path(os.environ["SEER_MODEL_DIR"]) if os.environ.get("SEER_MODEL_DIR") else ensure_model()
temp = float(sys.argv[1]) if len(sys.argv) > 1 else 0.7
data = bs.generate_rollouts(model, 4, 16, 192, temp)
table = AD.StepTimeTable.load(sys.argv[2])
dev = sys.argv[3] if len(sys.argv) > 3 else "cpu"
mt = int(sys.argv[4]) if len(sys.argv) > 4 else 48
import services.worker.engines.reference.sampler as S
wrap(S, "target_probs", "target_probs")
E.target_probs = S.target_probs
wrap(E.ReferenceEngine, "_verify_trees", "verify_trees") if hasattr(E.ReferenceEngine, "_verify_trees") else None
for spec in (False, True, True, False):
    acc.clear()
    r = bs.throughput(model, data, 8, mt, speculate=spec, threads=1, table=table, device=dev)
    steps = r["steps"]
    print(f"spec={spec} steps {steps} tok {r['tokens']} wall {r['seconds']:.2f}s")
    for k in sorted(k for k in acc if not k.endswith("#")):
        print(f"  {k:20s} {1e3*acc[k]/steps:8.2f} ms/step  calls/step {acc[k+'#']/steps:.1f}")
