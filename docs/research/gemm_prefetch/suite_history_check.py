# ruff: noqa
# Research script (session 11); see README.md beside it. PYTHONPATH=$PWD python docs/research/gemm_prefetch/suite_history_check.py
"""Suite with speculation: warm batch then timed batch over the same prompt keys; draft stats + worker logs."""
import json, shutil, sys, time
from pathlib import Path
import grpc
from seer.v1 import draft_pb2, draft_pb2_grpc
from seer_client import PromptGroup, Sampling, SeerClient
from bench.spec import PROMPTS, tokenize_prompts, suite_workload
from services.cli.up import Suite
from services.worker.model.prepare import ensure_model
md = ensure_model()
prompts = tokenize_prompts(md, PROMPTS)[:8]
wl = suite_workload("longtail", prompts, 4, 96)
d = Path(sys.argv[1] if len(sys.argv) > 1 else "/tmp/seer-suite-history-check"); shutil.rmtree(d, ignore_errors=True)
with Suite(workers=1, data_dir=d, speculation=True, model_dir=md, metrics=False, threads_per_worker=1,
           env={"SEER_LOG_LEVEL": "DEBUG"}) as suite:
    c = SeerClient(suite.address)
    def groups(it):
        return [PromptGroup(list(p), g, mt, prompt_key=f"bench-{i}", sampling=Sampling(temperature=0.7, top_p=1.0, seed=5 + 100 * it + i, ignore_eos=True)) for i, (p, g, mt) in enumerate(wl)]
    warm = c.run_batch("warm", groups(0))
    ch = grpc.insecure_channel(suite.services["draft"].address)
    st = draft_pb2_grpc.DraftServiceStub(ch).GetDraftStats(draft_pb2.GetDraftStatsRequest())
    print("after warm:", st)
    res = c.run_batch("timed", groups(1))
    st = draft_pb2_grpc.DraftServiceStub(ch).GetDraftStats(draft_pb2.GetDraftStatsRequest())
    print("after timed:", st)
    acc = sum(int(r.stats.get("accepted_tokens", 0)) for r in res); dr = sum(int(r.stats.get("draft_tokens", 0)) for r in res)
    print("drafted", dr, "accepted", acc)
    c.close()
from bench.spec import replay
def by_group(results):
    out = {}
    for r in results:
        out.setdefault(r.request_id.rsplit("/", 1)[0].split("/")[-1], []).append(list(r.token_ids))
    return out
W, Tm = by_group(warm), by_group(res)
for mode in ("self", "grouped", "g+h", "ideal g+h"):
    tok = st_ = 0
    for i, (p, g, mt) in enumerate(wl):
        k = str(i)
        hist = W.get(k, []) if mode in ("g+h", "ideal g+h") else []
        t, s_ = replay(list(p), Tm[k], hist, siblings=mode != "self", ideal=mode.startswith("ideal"))
        tok += t; st_ += s_
    print(mode, "accepted per step %.3f" % (tok / st_))

