"""Engine benchmark: the reference engine vs Hugging Face `generate` vs vLLM's CPU build, and
speculation with drafts from sibling responses, in one run on the same prompts and model.

    python -m bench.engine [--quick] [--model-dir DIR] [--no-vllm] [--max-tokens N]

1. Decode throughput at batch 1, 8, 32 (greedy, ignore EOS so every row makes N tokens). For each
   engine: decode tok/s = B * (N - 1) / (t(N) - t(1)), where t(n) is the wall time to generate n
   tokens for the batch; the prefill cancels out, so the three engines are compared on decoding
   alone. All run float32 on the same converted model directory with the same thread count.
   vLLM runs in its own virtualenv (scripts/setup_vllm_cpu.sh); if that is absent or fails, its
   rows are skipped with the reason printed.
2. Speculation (8 samples per prompt, temperature 1.0 and 0.7): drafts come from the suffix index
   of services/draft over the group's sibling responses and the request's own prompt and output.
   - batch 1 (the long-tail case): 7 siblings have finished; the 8th sample runs alone with
     drafts from them vs without drafts, same seed and length.
   - batch 8 (one group in lockstep): each sample drafts from the siblings' progress so far.
   Reported: mean accepted length per step (bonus token included), tokens/s with vs without, and
   the acceptance an ideal drafter could reach on the same samples (bench.spec.replay with the
   oracle: at every step the best continuation of any >= 2-token suffix match in the same sibling
   tokens, greedy-match proxy).
Last line: RESULT {json}.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from bench.spec import PROMPTS, _tokenize, replay
from services.common.model_paths import default_model_dir
from services.draft.index import GroupIndex
from services.worker.engine import Draft, GenerateRequest, SamplingParams
from services.worker.engines.reference.engine import ReferenceEngine

ROOT = Path(__file__).resolve().parents[1]
VLLM_VENV = ROOT / ".cache" / "vllm-venv"
GAMMA = 8


def out(msg: str) -> None:
    sys.stdout.write(msg + "\n")
    sys.stdout.flush()


# ---- throughput -----------------------------------------------------------------------------------


def _timed(fn: Any) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def ours_throughput(engine: ReferenceEngine, prompts: list[list[int]], batches: Sequence[int],
                    n: int) -> dict[str, Any]:
    counter = [0]

    def run(b: int, k: int) -> None:
        counter[0] += 1
        reqs = [GenerateRequest(f"tp{counter[0]}-{i}", tuple(prompts[i % len(prompts)]), k,
                                SamplingParams(temperature=0.0, ignore_eos=True)) for i in range(b)]
        engine.generate(reqs)

    run(2, 4)
    res: dict[str, Any] = {}
    for b in batches:
        run(b, 2)  # prompts now in the prefix cache for both timings
        t1 = min(_timed(lambda b=b: run(b, 1)) for _ in range(2))
        tn = _timed(lambda b=b: run(b, n))
        res[str(b)] = {"t1": t1, "tN": tn, "decode_tok_s": b * (n - 1) / max(tn - t1, 1e-9)}
    return res


def hf_throughput(model_dir: Path, prompts: list[list[int]], batches: Sequence[int], n: int) -> dict[str, Any]:
    from transformers import AutoModelForCausalLM

    model: Any = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    model.eval()
    pad = 0

    def run(b: int, k: int) -> None:
        rows = [prompts[i % len(prompts)] for i in range(b)]
        width = max(len(r) for r in rows)
        ids = torch.tensor([[pad] * (width - len(r)) + r for r in rows])  # left padding
        mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows])
        with torch.inference_mode():
            model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=k, min_new_tokens=k,
                           do_sample=False, pad_token_id=pad)

    run(2, 4)
    res: dict[str, Any] = {}
    for b in batches:
        t1 = min(_timed(lambda b=b: run(b, 1)) for _ in range(2))
        tn = _timed(lambda b=b: run(b, n))
        res[str(b)] = {"t1": t1, "tN": tn, "decode_tok_s": b * (n - 1) / max(tn - t1, 1e-9)}
    return res


def vllm_throughput(model_dir: Path, prompts: list[list[int]], batches: Sequence[int], n: int,
                    timeout: float) -> tuple[dict[str, Any] | None, str]:
    py = VLLM_VENV / "bin" / "python"
    if not py.exists():
        return None, f"vLLM CPU venv not found at {VLLM_VENV} (run scripts/setup_vllm_cpu.sh)"
    job = {"model_dir": str(model_dir), "prompts": prompts, "batch_sizes": list(batches), "max_tokens": n}
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE=os.environ.get("VLLM_CPU_KVCACHE_SPACE", "2"),
               VLLM_LOGGING_LEVEL="WARNING", OMP_NUM_THREADS=str(torch.get_num_threads()))
    env.pop("PYTHONPATH", None)
    try:
        proc = subprocess.run([str(py), str(ROOT / "bench" / "baselines" / "vllm_cpu.py")], input=json.dumps(job),
                              capture_output=True, text=True, timeout=timeout, env=env, cwd="/tmp")
    except subprocess.TimeoutExpired:
        return None, f"vLLM run timed out after {timeout:.0f} s"
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT_JSON "):
            data = json.loads(line[len("RESULT_JSON "):])
            return data["results"], f"vllm {data['vllm_version']}"
    tail = (proc.stderr or proc.stdout).strip().splitlines()[-5:]
    return None, "vLLM failed: " + " | ".join(tail)


# ---- speculation ----------------------------------------------------------------------------------


class SpecRun:
    """Drives the engine with drafts from one group's suffix index (or none)."""

    def __init__(self, engine: ReferenceEngine, prompt: list[int], siblings: list[list[int]]) -> None:
        self.engine = engine
        self.index = GroupIndex(prompt)
        for i, s in enumerate(siblings):
            self.index.append(f"sib{i}", 0, s)

    def run(self, reqs: list[GenerateRequest], speculate: bool) -> dict[str, Any]:
        eng = self.engine
        for r in reqs:
            eng.add_request(r)
        outs: dict[str, list[int]] = {r.request_id: [] for r in reqs}
        steps = drafted = accepted = decode_steps = 0
        t0 = time.perf_counter()
        while eng.has_unfinished():
            drafts: dict[str, Draft] = {}
            if speculate:
                for r in reqs:
                    if outs[r.request_id] and r.request_id not in drafts:
                        try:
                            ctx = eng.request_tokens(r.request_id)
                        except KeyError:
                            continue
                        p = self.index.propose(ctx, GAMMA)
                        if p.tokens:
                            drafts[r.request_id] = Draft(p.tokens, p.parents)
            res = eng.step(drafts or None)
            steps += 1
            for o in res:
                own = outs[o.request_id]
                if own:  # the first output of a request comes from its prefill step
                    decode_steps += 1
                self.index.append(o.request_id, len(own), o.token_ids)
                own.extend(o.token_ids)
                drafted += o.num_draft_tokens
                accepted += o.num_accepted
        wall = time.perf_counter() - t0
        tokens = sum(len(v) for v in outs.values())
        decode_tokens = tokens - len(reqs)
        return {"wall_s": wall, "tokens": tokens, "tok_s": tokens / wall,
                "accepted_len": decode_tokens / max(decode_steps, 1),
                "draft_tokens": drafted, "accepted_tokens": accepted, "outputs": outs}


def spec_bench(engine: ReferenceEngine, prompts: list[list[int]], temperature: float, n: int,
               group: int = 8) -> dict[str, Any]:
    res: dict[str, Any] = {}
    # Siblings (no speculation): the finished responses of each group.
    sib: list[list[list[int]]] = []
    for p, prompt in enumerate(prompts):
        reqs = [GenerateRequest(f"sib-{temperature}-{p}-{s}", tuple(prompt), n,
                                SamplingParams(temperature=temperature, top_p=1.0, ignore_eos=True,
                                               seed=1000 + 97 * p + s)) for s in range(group)]
        got = engine.generate(reqs)
        sib.append([got[r.request_id].token_ids for r in reqs])

    for batch in (1, group):
        agg = {k: 0.0 for k in ("w_on", "w_off", "tok_on", "tok_off", "acc_steps", "acc_tok", "ideal_tok",
                                "ideal_steps")}
        acc_lens = []
        for p, prompt in enumerate(prompts):
            siblings = sib[p][: group - 1] if batch == 1 else []
            seeds = [5000 + p] if batch == 1 else [7000 + 31 * p + s for s in range(group)]

            def mk(tag: str, p: int = p, prompt: list[int] = prompt, seeds: list[int] = seeds,
                   batch: int = batch) -> list[GenerateRequest]:
                return [GenerateRequest(f"{tag}-b{batch}-{temperature}-{p}-{i}", tuple(prompt), n,
                                        SamplingParams(temperature=temperature, top_p=1.0, ignore_eos=True, seed=sd))
                        for i, sd in enumerate(seeds)]

            off = SpecRun(engine, prompt, siblings).run(mk("off"), speculate=False)
            on = SpecRun(engine, prompt, siblings).run(mk("on"), speculate=True)
            agg["w_on"] += on["wall_s"]
            agg["w_off"] += off["wall_s"]
            agg["tok_on"] += on["tokens"]
            agg["tok_off"] += off["tokens"]
            acc_lens.append(on["accepted_len"])
            # Ideal replay over the same tokens: the measured outputs against the same siblings.
            outs = [o[1:] for o in on["outputs"].values()]  # drop the prefill token (no draft there)
            if batch == 1:
                t, s = replay(list(prompt), outs, [list(x) for x in siblings], siblings=True, ideal=True)
            else:
                t, s = replay(list(prompt), outs, [], siblings=True, ideal=True)
            agg["ideal_tok"] += t
            agg["ideal_steps"] += s
        tok_s_on = agg["tok_on"] / agg["w_on"]
        tok_s_off = agg["tok_off"] / agg["w_off"]
        res[f"b{batch}"] = {
            "tok_s_spec": tok_s_on, "tok_s_nospec": tok_s_off, "speedup": tok_s_on / tok_s_off,
            "accepted_len": sum(acc_lens) / len(acc_lens),
            "ideal_accepted_len": agg["ideal_tok"] / max(agg["ideal_steps"], 1),
        }
    return res


# ---- main -----------------------------------------------------------------------------------------


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.engine")
    ap.add_argument("--quick", action="store_true", help="small run, under 60 s (no vLLM)")
    ap.add_argument("--model-dir", default=None)
    ap.add_argument("--max-tokens", type=int, default=None)
    ap.add_argument("--no-vllm", action="store_true")
    ap.add_argument("--no-hf", action="store_true")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--vllm-timeout", type=float, default=900.0)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)

    from services.worker.model.prepare import ensure_model

    model_dir = Path(args.model_dir) if args.model_dir else ensure_model(default_model_dir())
    quick = args.quick
    batches = (1, 8) if quick else (1, 8, 32)
    n = args.max_tokens or (16 if quick else 64)
    prompts = _tokenize(model_dir, PROMPTS)
    engine = ReferenceEngine.from_dir(model_dir, max_batch_size=64, num_threads=args.threads)
    result: dict[str, Any] = {"quick": quick, "max_tokens": n, "threads": args.threads}

    out(f"== decode throughput (greedy, {n} tokens, float32, {args.threads} threads) ==")
    ours = ours_throughput(engine, prompts, batches, n)
    result["ours"] = {b: round(v["decode_tok_s"], 1) for b, v in ours.items()}
    hf: dict[str, Any] | None = None
    if not args.no_hf:
        hf = hf_throughput(model_dir, prompts, batches, n)
        result["hf"] = {b: round(v["decode_tok_s"], 1) for b, v in hf.items()}
    vllm: dict[str, Any] | None = None
    if quick or args.no_vllm:
        out("vllm: skipped (--quick / --no-vllm)")
    else:
        vllm, why = vllm_throughput(model_dir, prompts, batches, n, args.vllm_timeout)
        out(f"vllm: {why}")
        if vllm is not None:
            result["vllm"] = {b: round(v["decode_tok_s"], 1) for b, v in vllm.items()}
        else:
            result["vllm_skipped"] = why
    out(f"{'batch':>6} {'ours tok/s':>11} {'HF tok/s':>9} {'vLLM tok/s':>11} {'ours/HF':>8} {'ours/vLLM':>10}")
    for b in map(str, batches):
        o = ours[b]["decode_tok_s"]
        h = hf[b]["decode_tok_s"] if hf else float("nan")
        v = vllm[b]["decode_tok_s"] if vllm else float("nan")
        out(f"{b:>6} {o:>11.1f} {h:>9.1f} {v:>11.1f} {o / h:>8.2f} {o / v:>10.2f}")
        result.setdefault("ours_vs_hf", {})[b] = round(o / h, 3) if hf else None
        result.setdefault("ours_vs_vllm", {})[b] = round(o / v, 3) if vllm else None

    spec_prompts = prompts[:2] if quick else prompts[:6]
    spec_n = 24 if quick else 96
    result["spec"] = {}
    for temp in (1.0, 0.7):
        out(f"== speculation, temperature {temp}, 8 samples per prompt, {spec_n} tokens ==")
        sb = spec_bench(engine, spec_prompts, temp, spec_n)
        result["spec"][str(temp)] = {k: {kk: round(vv, 3) for kk, vv in v.items()} for k, v in sb.items()}
        for k, v in sb.items():
            out(f"  {k}: accepted len {v['accepted_len']:.2f} (ideal {v['ideal_accepted_len']:.2f}), "
                f"tok/s {v['tok_s_spec']:.1f} vs {v['tok_s_nospec']:.1f} no-spec = {v['speedup']:.2f}x")

    targets: dict[str, bool | None] = {}
    big = str(batches[-1])
    if vllm and big == "32":
        targets["b32_ge_0.8x_vllm"] = result["ours_vs_vllm"][big] >= 0.8
    if hf and big == "32":
        targets["b32_ge_3x_hf"] = result["ours_vs_hf"][big] >= 3.0
    targets["t0.7_b1_spec_ge_1.2x"] = result["spec"]["0.7"]["b1"]["speedup"] >= 1.2
    targets["spec_never_below_0.95x"] = all(v["speedup"] >= 0.95 for t in result["spec"].values() for v in t.values())
    result["targets"] = targets
    for k, ok in targets.items():
        out(f"target {k}: {'PASS' if ok else 'FAIL'}")
    out("RESULT " + json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
