"""Engine benchmark: the reference engine vs Hugging Face `generate` vs vLLM's CPU build, and
speculation with drafts from sibling responses, in one run on the same prompts and model.

    python -m bench.engine [--quick] [--threads N] [--model-dir DIR] [--no-vllm] [--max-tokens N]

0. Small-M GEMM: the C kernel (services/worker/engines/reference/kernels) vs F.linear on the
   model's layer shapes for M = 1..64 rows (interleaved repeats, median), and the engine's step
   time T(B, gamma) with the kernel and with F.linear (`seer profile`'s measure; thread CPU time at
   --threads 1, robust on a shared machine). The kernel table feeds the adaptive mode below.
1. Decode throughput at batch 1, 8, 32 (greedy, ignore EOS so every row makes N tokens). For each
   engine: decode tok/s = B * (N - 1) / (t(N) - t(1)), where t(n) is the wall time to generate n
   tokens for the batch; the prefill cancels out, so the three engines are compared on decoding
   alone. All run float32 on the same converted model directory with the same thread count; ours
   also runs with the GEMM kernel disabled (F.linear everywhere) and with the paged attention
   kernel disabled (gather + SDPA) to show each kernel's gain.
   vLLM runs in its own virtualenv (scripts/setup_vllm_cpu.sh); if that is absent or fails, its
   rows are skipped with the reason printed.
2. Speculation (8 samples per prompt, temperature 1.0 and 0.7): drafts come from the suffix index
   of services/draft over the group's sibling responses and the request's own prompt and output.
   - batch 1 (the long-tail case): 7 siblings have finished; the 8th sample runs alone with
     drafts from them vs without drafts, same seed and length.
   - batch 8 (one group in lockstep): each sample drafts from the siblings' progress so far.
   Each setting runs three ways on the same seeds (identical outputs: verification is lossless):
   no speculation, forced (gamma = 8 every step), and adaptive (services.worker.adaptive, Seer
   Algorithm 1, with the step-time table measured in this run: it drafts only where the predicted
   tokens/s beat no speculation). Reported: mean accepted length per step (bonus token included),
   tokens/s and the ratio to no speculation (wall clock, and thread CPU time at --threads 1, which
   the targets use: the machine is shared), and the acceptance an ideal drafter could reach on
   the same samples (bench.spec.replay with the oracle: at every step the best continuation of any
   >= 2-token suffix match in the same sibling tokens, greedy-match proxy).
Last line: RESULT {json}.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from bench.spec import PROMPTS, replay, tokenize_prompts
from services.cli.profile import measure
from services.common.memtune import malloc_tuned
from services.common.model_paths import default_model_dir
from services.draft.index import GroupIndex
from services.worker.adaptive import AdaptiveSpeculation, StepTimeTable
from services.worker.engine import Draft, GenerateRequest, SamplingParams
from services.worker.engines.reference.engine import ReferenceEngine
from services.worker.engines.reference.kernels import linear as kernel_linear
from services.worker.engines.reference.kernels.attention import paged_attention_available, paged_attention_enabled
from services.worker.engines.reference.kernels.linear import small_gemm, small_gemm_available, small_gemm_enabled

ROOT = Path(__file__).resolve().parents[1]
VLLM_VENV = ROOT / ".cache" / "vllm-venv"
GAMMA = 8


# On a GPU the host thread's CPU time is not the step's cost (it launches kernels and waits):
# --device cuda times everything by the wall clock.
_WALL_CLOCK = False


def out(msg: str) -> None:
    sys.stdout.write(msg + "\n")
    sys.stdout.flush()


# ---- small-M GEMM ---------------------------------------------------------------------------------


def layer_shapes(engine: ReferenceEngine) -> dict[str, tuple[int, int]]:
    """(N, K) of the model's four fused layer matmuls and the lm_head."""
    c = engine.model_config
    return {"qkv": ((c.num_heads + 2 * c.num_kv_heads) * c.head_dim, c.hidden_size),
            "o": (c.hidden_size, c.num_heads * c.head_dim), "gate_up": (2 * c.intermediate_size, c.hidden_size),
            "down": (c.hidden_size, c.intermediate_size), "lm_head": (c.vocab_size, c.hidden_size)}


def gemm_bench(engine: ReferenceEngine, rows: Sequence[int], repeats: int) -> dict[str, dict[str, float]]:
    """F.linear time / kernel time per layer shape and row count (median of interleaved repeats).
    As in the model, the weights stream from memory: each timing walks copies of the weight that
    together exceed the last-level cache (~96 MB), not one hot copy."""
    res: dict[str, dict[str, float]] = {}
    gen = torch.Generator().manual_seed(0)
    for name, (n, k) in layer_shapes(engine).items():
        ws = [torch.randn(n, k, generator=gen) for _ in range(max(1, int(96e6 // (n * k * 4))))]
        res[name] = {}
        for m in rows:
            x = torch.randn(m, k, generator=gen)
            ratios = []

            def ref(x: torch.Tensor = x, ws: list[torch.Tensor] = ws) -> None:
                for w in ws:
                    torch.nn.functional.linear(x, w)

            def ker(x: torch.Tensor = x, ws: list[torch.Tensor] = ws) -> None:
                for w in ws:
                    small_gemm(x, w)

            for _ in range(repeats):
                ratios.append(_timed(ref) / _timed(ker))
            res[name][str(m)] = statistics.median(ratios)
        del ws
    return res


def step_tables(engine: ReferenceEngine, batches: Sequence[int], gammas: Sequence[int], steps: int,
                clock: str, kernel: bool = True) -> dict[str, StepTimeTable]:
    """T(B, gamma) with the kernel and with F.linear, interleaved per batch size (without the
    kernel, e.g. on a GPU, both tables are the one F.linear measurement)."""
    on: list[tuple[float, ...]] = []
    off: list[tuple[float, ...]] = []
    for b in batches:
        for flag, rows in ((True, on), (False, off)) if kernel else ((False, off),):
            with small_gemm_enabled(flag):
                rows.append(measure(engine, (b,), gammas, steps=steps, clock=clock, log=False).times_s[0])
    if not kernel:
        on = list(off)
    src = f"bench.engine ({clock} clock)"
    return {"kernel": StepTimeTable(tuple(batches), tuple(gammas), tuple(on), src),
            "f_linear": StepTimeTable(tuple(batches), tuple(gammas), tuple(off), src)}


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


def hf_throughput(model_dir: Path, prompts: list[list[int]], batches: Sequence[int], n: int,
                  device: str = "cpu") -> dict[str, Any]:
    from transformers import AutoModelForCausalLM

    model: Any = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    model = model.to(device)
    model.eval()
    pad = 0

    def run(b: int, k: int) -> None:
        rows = [prompts[i % len(prompts)] for i in range(b)]
        width = max(len(r) for r in rows)
        ids = torch.tensor([[pad] * (width - len(r)) + r for r in rows], device=device)  # left padding
        mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows], device=device)
        with torch.inference_mode():
            model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=k, min_new_tokens=k,
                           do_sample=False, pad_token_id=pad)
        if device != "cpu":
            torch.cuda.synchronize()

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
    """Drives the engine with drafts from one group's suffix index: none, forced (GAMMA every step)
    or sized by an adaptive planner (fed the per-position acceptance as the worker core does)."""

    def __init__(self, engine: ReferenceEngine, prompt: list[int], siblings: list[list[int]]) -> None:
        self.engine = engine
        self.index = GroupIndex(prompt)
        for i, s in enumerate(siblings):
            self.index.append(f"sib{i}", 0, s)

    def _drafts(self, reqs: list[GenerateRequest], outs: dict[str, list[int]],
                planner: AdaptiveSpeculation | None) -> dict[str, Draft]:
        live = [r.request_id for r in reqs if outs[r.request_id] and len(outs[r.request_id]) < r.max_new_tokens]
        lengths = planner.plan([(rid, False) for rid in live]) if planner else dict.fromkeys(live, GAMMA)
        drafts: dict[str, Draft] = {}
        for rid in live:
            if lengths.get(rid, 0) <= 0:
                continue
            try:
                ctx = self.engine.request_tokens(rid)
            except KeyError:
                continue
            p = self.index.propose(ctx, lengths[rid], request_id=rid)
            if p.tokens:
                drafts[rid] = Draft(p.tokens, p.parents)
        return drafts

    def run(self, reqs: list[GenerateRequest], mode: str, planner: AdaptiveSpeculation | None = None) -> dict[str, Any]:
        """mode: off | forced | adaptive (then `planner` sizes the drafts)."""
        eng = self.engine
        for r in reqs:
            eng.add_request(r)
        outs: dict[str, list[int]] = {r.request_id: [] for r in reqs}
        steps = drafted = accepted = decode_steps = spec_steps = 0
        # The planner learns each decode step's cost, on the clock the targets use (thread CPU
        # time at one thread: the machine is shared), as the worker core reports its steps.
        clock = time.thread_time if torch.get_num_threads() == 1 and not _WALL_CLOCK else time.perf_counter
        t0, c0 = time.perf_counter(), time.thread_time()
        while eng.has_unfinished():
            s0 = clock()
            drafts = self._drafts(reqs, outs, planner if mode == "adaptive" else None) if mode != "off" else {}
            res = eng.step(drafts or None)
            steps += 1
            spec_steps += bool(drafts)
            proposed_pos, accepted_pos = [0] * GAMMA, [0] * GAMMA
            per_request: list[tuple[str, int, int]] = []  # (request, depth verified, accepted)
            prefill = False
            for o in res:
                own = outs[o.request_id]
                prefill = prefill or not own or not o.token_ids
                if own:  # the first output of a request comes from its prefill step
                    decode_steps += 1
                self.index.append(o.request_id, len(own), o.token_ids)
                own.extend(o.token_ids)
                drafted += o.num_draft_tokens
                accepted += o.num_accepted
                d = drafts.get(o.request_id)
                if d is not None and o.num_draft_tokens > 0:
                    depth = _depth(d.parents[: o.num_draft_tokens])
                    for i in range(min(depth, GAMMA)):
                        proposed_pos[i] += 1
                    for i in range(min(o.num_accepted, GAMMA)):
                        accepted_pos[i] += 1
                    per_request.append((o.request_id, depth, o.num_accepted))
            if mode == "adaptive" and planner is not None:
                if drafts:
                    planner.observe(proposed_pos, accepted_pos)  # its own drafts only, as in the worker
                    for rid, depth, acc in per_request:  # and each request's own, as the worker core does
                        planner.observe_request(rid, depth, acc)
                for o in res:
                    if o.finished:
                        planner.forget_request(o.request_id)
                if res and not prefill:
                    planner.observe_step(len(res), sum(len(o.token_ids) for o in res), clock() - s0)
        wall, cpu = time.perf_counter() - t0, time.thread_time() - c0
        tokens = sum(len(v) for v in outs.values())
        decode_tokens = tokens - len(reqs)
        return {"wall_s": wall, "cpu_s": cpu, "tokens": tokens, "tok_s": tokens / wall,
                "accepted_len": decode_tokens / max(decode_steps, 1), "spec_steps": spec_steps, "steps": steps,
                "draft_tokens": drafted, "accepted_tokens": accepted, "outputs": outs}


def _depth(parents: Sequence[int]) -> int:
    """Depth of a draft tree (1 = a single level)."""
    depth: list[int] = []
    for p in parents:
        depth.append(1 if p < 0 else depth[p] + 1)
    return max(depth, default=0)


MODES = ("off", "forced", "adaptive")


def spec_bench(engine: ReferenceEngine, prompts: list[list[int]], temperature: float, n: int,
               table: StepTimeTable, group: int = 8, batches: Sequence[int] = (1, 8),
               ) -> tuple[dict[str, Any], dict[str, Any]]:
    """Per batch: the ratios of forced and adaptive speculation to none; and the adaptive planner's
    stats (its decisions, measured cost corrections and guard verdicts)."""
    res: dict[str, Any] = {}
    planners: dict[str, Any] = {}
    # Siblings (no speculation): the finished responses of each group.
    sib: list[list[list[int]]] = []
    for p, prompt in enumerate(prompts):
        reqs = [GenerateRequest(f"sib-{temperature}-{p}-{s}", tuple(prompt), n,
                                SamplingParams(temperature=temperature, top_p=1.0, ignore_eos=True,
                                               seed=1000 + 97 * p + s)) for s in range(group)]
        got = engine.generate(reqs)
        sib.append([got[r.request_id].token_ids for r in reqs])

    for batch in batches:
        if batch not in (1, group):
            raise ValueError(f"batches: {batch} is neither 1 nor the group size {group}")
        wall = dict.fromkeys(MODES, 0.0)
        cpu = dict.fromkeys(MODES, 0.0)
        toks = dict.fromkeys(MODES, 0)
        acc_lens: dict[str, list[float]] = {m: [] for m in MODES}
        spec_frac: list[float] = []
        per_prompt: dict[str, list[float]] = {"forced": [], "adaptive": []}  # CPU-time ratio to "off"
        ideal_tok = ideal_steps = 0
        # One planner per setting, as one worker would keep: it learns the acceptance across prompts.
        planner = AdaptiveSpeculation(table, gamma_max=GAMMA)
        for p, prompt in enumerate(prompts):
            siblings = sib[p][: group - 1] if batch == 1 else []
            seeds = [5000 + p] if batch == 1 else [7000 + 31 * p + s for s in range(group)]

            def mk(tag: str, p: int = p, prompt: list[int] = prompt, seeds: list[int] = seeds,
                   batch: int = batch) -> list[GenerateRequest]:
                return [GenerateRequest(f"{tag}-b{batch}-{temperature}-{p}-{i}", tuple(prompt), n,
                                        SamplingParams(temperature=temperature, top_p=1.0, ignore_eos=True, seed=sd))
                        for i, sd in enumerate(seeds)]

            # The arms' order rotates over prompts: whichever runs first or last in a row of
            # three is not always the same arm (warm caches, a neighbour's burst).
            order = MODES[p % len(MODES):] + MODES[: p % len(MODES)]
            runs = {m: SpecRun(engine, prompt, siblings).run(mk(m), m, planner) for m in order}
            off = runs["off"]["tokens"] / runs["off"]["cpu_s"]
            for m in ("forced", "adaptive"):
                per_prompt[m].append(runs[m]["tokens"] / runs[m]["cpu_s"] / off)
            for m, r in runs.items():
                wall[m] += r["wall_s"]
                cpu[m] += r["cpu_s"]
                toks[m] += r["tokens"]
                acc_lens[m].append(r["accepted_len"])
            spec_frac.append(runs["adaptive"]["spec_steps"] / max(runs["adaptive"]["steps"], 1))
            # Ideal replay over the same tokens: the measured outputs against the same siblings.
            outs = [o[1:] for o in runs["forced"]["outputs"].values()]  # drop the prefill token (no draft there)
            if batch == 1:
                t, s = replay(list(prompt), outs, [list(x) for x in siblings], siblings=True, ideal=True)
            else:
                t, s = replay(list(prompt), outs, [], siblings=True, ideal=True)
            ideal_tok += t
            ideal_steps += s
        row: dict[str, float] = {"tok_s_nospec": toks["off"] / wall["off"]}
        for m, tag in (("forced", "spec"), ("adaptive", "adaptive")):
            row[f"tok_s_{tag}"] = toks[m] / wall[m]
            row[f"speedup_{tag}" if tag != "spec" else "speedup"] = (toks[m] / wall[m]) / row["tok_s_nospec"]
            row[f"cpu_speedup_{tag}"] = (toks[m] / cpu[m]) / (toks["off"] / cpu["off"])
            row[f"accepted_len_{tag}" if tag != "spec" else "accepted_len"] = statistics.fmean(acc_lens[m])
        row["adaptive_spec_step_frac"] = statistics.fmean(spec_frac)
        for m in ("forced", "adaptive"):
            row[f"cpu_speedup_{m}_per_prompt_min"] = min(per_prompt[m])
            row[f"cpu_speedup_{m}_per_prompt_max"] = max(per_prompt[m])
        row["ideal_accepted_len"] = ideal_tok / max(ideal_steps, 1)
        res[f"b{batch}"] = row
        planners[f"b{batch}"] = planner.stats()
    return res, planners


def decode_section(args: argparse.Namespace, engine: ReferenceEngine, model_dir: Path, prompts: list[list[int]],
                   batches: Sequence[int], n: int, kernel: bool, result: dict[str, Any]) -> None:
    quick = args.quick
    out(f"== decode throughput (greedy, {n} tokens, float32, {args.device}, {args.threads} threads) ==")
    ours = ours_throughput(engine, prompts, batches, n)
    result["ours"] = {b: round(v["decode_tok_s"], 1) for b, v in ours.items()}
    ours_fl: dict[str, Any] | None = None
    if kernel:
        with small_gemm_enabled(False):
            ours_fl = ours_throughput(engine, prompts, batches, n)
        result["ours_f_linear"] = {b: round(v["decode_tok_s"], 1) for b, v in ours_fl.items()}
    ours_sdpa: dict[str, Any] | None = None
    if args.device == "cpu" and paged_attention_available():
        with paged_attention_enabled(False):
            ours_sdpa = ours_throughput(engine, prompts, batches, n)
        result["ours_sdpa"] = {b: round(v["decode_tok_s"], 1) for b, v in ours_sdpa.items()}
    hf: dict[str, Any] | None = None
    if not args.no_hf:
        hf = hf_throughput(model_dir, prompts, batches, n, args.device)
        result["hf"] = {b: round(v["decode_tok_s"], 1) for b, v in hf.items()}
    vllm: dict[str, Any] | None = None
    if quick or args.no_vllm or args.device != "cpu":
        out("vllm: skipped (--quick / --no-vllm / vllm-cpu is a CPU baseline)")
    else:
        vllm, why = vllm_throughput(model_dir, prompts, batches, n, args.vllm_timeout)
        out(f"vllm: {why}")
        if vllm is not None:
            result["vllm"] = {b: round(v["decode_tok_s"], 1) for b, v in vllm.items()}
        else:
            result["vllm_skipped"] = why
    out(f"{'batch':>6} {'ours tok/s':>11} {'F.linear':>9} {'SDPA':>7} {'HF tok/s':>9} {'vLLM tok/s':>11} "
        f"{'ours/HF':>8} {'ours/vLLM':>10}")
    for b in map(str, batches):
        o = ours[b]["decode_tok_s"]
        fl = ours_fl[b]["decode_tok_s"] if ours_fl else float("nan")
        sd = ours_sdpa[b]["decode_tok_s"] if ours_sdpa else float("nan")
        h = hf[b]["decode_tok_s"] if hf else float("nan")
        v = vllm[b]["decode_tok_s"] if vllm else float("nan")
        out(f"{b:>6} {o:>11.1f} {fl:>9.1f} {sd:>7.1f} {h:>9.1f} {v:>11.1f} {o / h:>8.2f} {o / v:>10.2f}")
        result.setdefault("ours_vs_hf", {})[b] = round(o / h, 3) if hf else None
        result.setdefault("ours_vs_vllm", {})[b] = round(o / v, 3) if vllm else None


def spec_section(engine: ReferenceEngine, prompts: list[list[int]], quick: bool, temps: Sequence[float],
                 table: StepTimeTable, result: dict[str, Any], num_prompts: int | None = None,
                 batches: Sequence[int] = (1, 8)) -> None:
    spec_prompts = prompts[: num_prompts or (1 if quick else 6)]
    spec_n = 16 if quick else 96
    result["spec"] = {}
    for temp in temps:
        out(f"== speculation, temperature {temp}, 8 samples per prompt, {spec_n} tokens ==")
        sb, planners = spec_bench(engine, spec_prompts, temp, spec_n, table, batches=batches)
        result["spec"][str(temp)] = {k: {kk: round(vv, 3) for kk, vv in v.items()} for k, v in sb.items()}
        result.setdefault("spec_planner", {})[str(temp)] = planners
        for k, v in sb.items():
            out(f"  {k}: no-spec {v['tok_s_nospec']:.1f} tok/s (ideal accepted len {v['ideal_accepted_len']:.2f})")
            out(f"      forced:   accepted len {v['accepted_len']:.2f}, {v['tok_s_spec']:.1f} tok/s = "
                f"{v['speedup']:.2f}x wall, {v['cpu_speedup_spec']:.2f}x cpu")
            out(f"      adaptive: accepted len {v['accepted_len_adaptive']:.2f}, {v['tok_s_adaptive']:.1f} tok/s = "
                f"{v['speedup_adaptive']:.2f}x wall, {v['cpu_speedup_adaptive']:.2f}x cpu, "
                f"drafted in {v['adaptive_spec_step_frac'] * 100:.0f}% of steps; per prompt (cpu) "
                f"[{v['cpu_speedup_adaptive_per_prompt_min']:.2f}-{v['cpu_speedup_adaptive_per_prompt_max']:.2f}]")
            out(f"      planner: {json.dumps(planners[k])}")


# ---- main -----------------------------------------------------------------------------------------


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.engine")
    ap.add_argument("--quick", action="store_true", help="small run, under 60 s (no vLLM)")
    ap.add_argument("--model-dir", default=None)
    ap.add_argument("--max-tokens", type=int, default=None)
    ap.add_argument("--no-vllm", action="store_true")
    ap.add_argument("--no-hf", action="store_true")
    ap.add_argument("--only", default="gemm,steps,decode,spec",
                    help="comma-separated sections to run (gemm, steps, decode, spec); a full run is long, "
                         "so it can be split into runs under 10 minutes")
    ap.add_argument("--temps", default=None, help="speculation temperatures (default 1.0,0.7; --quick: 0.7)")
    ap.add_argument("--spec-prompts", type=int, default=None, help="prompts in the speculation runs (default 6)")
    ap.add_argument("--spec-batches", default="1,8", help="speculation batch sizes (1 and/or 8)")
    ap.add_argument("--table", default=None, help="step-time table JSON for the adaptive mode (default: measured)")
    ap.add_argument("--save-table", default=None, help="write the measured (kernel) step-time table here")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--vllm-timeout", type=float, default=900.0)
    ap.add_argument("--device", default="cpu", help="torch device of our engine and HF (cpu | cuda | cuda:N)")
    ap.add_argument("--no-tune-malloc", action="store_true",
                    help="leave glibc malloc untuned (the engine tunes it by default; for A/B runs)")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    global _WALL_CLOCK
    _WALL_CLOCK = args.device != "cpu"

    from services.worker.model.prepare import ensure_model

    model_dir = Path(args.model_dir) if args.model_dir else ensure_model(default_model_dir())
    quick = args.quick
    batches = (1, 8) if quick else (1, 8, 32)
    n = args.max_tokens or (16 if quick else 64)
    prompts = tokenize_prompts(model_dir, PROMPTS)
    # The engine tunes glibc malloc for the whole process (services/common/memtune.py), so HF's
    # `generate` below runs on the same allocator settings as ours.
    engine = ReferenceEngine.from_dir(model_dir, device=args.device, max_batch_size=64, num_threads=args.threads,
                                      tune_malloc=not args.no_tune_malloc)
    # Thread CPU time measures the step's compute without the time other tenants take; it equals
    # the step's cost only when the engine runs in the calling thread (one thread) on the CPU.
    clock = "cpu" if args.threads == 1 and not _WALL_CLOCK else "wall"
    kernel = small_gemm_available() and args.device == "cpu"  # a CPU kernel
    device_name = torch.cuda.get_device_name(torch.device(args.device)) if args.device != "cpu" else "cpu"
    result: dict[str, Any] = {"quick": quick, "max_tokens": n, "threads": args.threads, "clock": clock,
                              "device": args.device, "device_name": device_name,
                              "small_gemm": kernel, "malloc_tuned": malloc_tuned() is not None,
                              "small_gemm_rows": [kernel_linear.MIN_ROWS, kernel_linear.MAX_ROWS,
                                                  kernel_linear.MAX_ROWS_WIDE]}

    only = {x.strip() for x in args.only.split(",") if x.strip()}
    if only - {"gemm", "steps", "decode", "spec"}:
        ap.error(f"--only: unknown sections {sorted(only - {'gemm', 'steps', 'decode', 'spec'})}")
    result["sections"] = sorted(only)

    if kernel and "gemm" in only:
        rows = (2, 8) if quick else (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 40, 48, 64, 96)
        out(f"== small-M GEMM: F.linear time / kernel time ({args.threads} threads, median of repeats) ==")
        gb = gemm_bench(engine, rows, 2 if quick else 7)
        result["gemm_speedup"] = {k: {m: round(v, 2) for m, v in r.items()} for k, r in gb.items()}
        out(f"{'shape':>8} " + " ".join(f"{'M=' + str(m):>6}" for m in rows))
        for name, r in gb.items():
            out(f"{name:>8} " + " ".join(f"{r[str(m)]:>6.2f}" for m in rows))

    table: StepTimeTable | None = StepTimeTable.load(args.table) if args.table else None
    if "steps" in only or ("spec" in only and table is None):
        gammas = (0, 2, 8) if quick else (0, 1, 2, 4, 8)
        t_batches = (1, 8) if quick else (1, 4, 8, 16, 32)
        out(f"== step time T(B, gamma) ({clock} clock), kernel vs F.linear ==")
        tables = step_tables(engine, t_batches, gammas, 1 if quick else 3, clock, kernel)
        table = tables["kernel"] if kernel else tables["f_linear"]
        result["step_time"] = {k: [[round(x * 1e3, 1) for x in row] for row in t.times_s] for k, t in tables.items()}
        result["step_time_axes"] = {"batch": list(t_batches), "gamma": list(gammas)}
        out(f"{'B':>4} {'gamma':>6} {'kernel ms':>10} {'F.linear ms':>12} {'kernel/T0':>10} {'F.linear/T0':>12}")
        for bi, tb in enumerate(t_batches):
            for gi, g in enumerate(gammas):
                k_row, f_row = tables["kernel"].times_s[bi], tables["f_linear"].times_s[bi]
                out(f"{tb:>4} {g:>6} {k_row[gi] * 1e3:>10.1f} {f_row[gi] * 1e3:>12.1f} "
                    f"{k_row[gi] / k_row[0]:>10.2f} {f_row[gi] / f_row[0]:>12.2f}")

        if args.save_table:
            table.save(args.save_table)

    if "decode" in only:
        decode_section(args, engine, model_dir, prompts, batches, n, kernel, result)

    if "spec" in only:
        assert table is not None
        temps = args.temps or ("0.7" if quick else "1.0,0.7")
        spec_section(engine, prompts, quick, [float(t) for t in temps.split(",") if t.strip()], table, result,
                     args.spec_prompts, [int(b) for b in args.spec_batches.split(",") if b.strip()])

    targets: dict[str, bool | None] = {}
    big = str(batches[-1])
    if result.get("vllm") and big == "32":
        targets["b32_ge_0.8x_vllm"] = result["ours_vs_vllm"][big] >= 0.8
    if result.get("hf") and big == "32":
        targets["b32_ge_3x_hf"] = result["ours_vs_hf"][big] >= 3.0
    # Speedups by thread CPU time at one thread (the shared machine's wall clock varies +-30%).
    key = "cpu_speedup_adaptive" if clock == "cpu" else "speedup_adaptive"
    spec = result.get("spec", {})
    if "b1" in spec.get("0.7", {}):
        targets["t0.7_b1_spec_ge_1.2x"] = spec["0.7"]["b1"][key] >= 1.2
    if spec:
        targets["spec_never_below_0.95x"] = all(v[key] >= 0.95 for t in spec.values() for v in t.values())
    result["targets"] = targets
    result["targets_use"] = key
    for k, ok in targets.items():
        out(f"target {k}: {'PASS' if ok else 'FAIL'}")
    out("RESULT " + json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
