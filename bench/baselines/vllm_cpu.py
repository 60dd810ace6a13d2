"""vLLM CPU peer for bench.engine. Runs inside the separate vLLM virtualenv (scripts/setup_vllm_cpu.sh),
never in the project venv. Reads a JSON job on stdin, prints one JSON line with the timings.

Job: {"model_dir": str, "prompts": [[token ids]], "batch_sizes": [int], "max_tokens": int}
Output: {"vllm_version": str, "results": {"<B>": {"t1": s, "tN": s, "decode_tok_s": x}}}
Decode throughput = B * (N - 1) / (t(N) - t(1)): the prefill cancels out, as for the other engines.
"""

import json
import sys
import time


def main() -> None:
    job = json.loads(sys.stdin.read())
    import vllm
    from vllm import LLM, SamplingParams

    llm = LLM(model=job["model_dir"], dtype="float32", gpu_memory_utilization=job.get("mem_fraction", 0.25),
              max_model_len=2048, enforce_eager=False, seed=0)
    prompts = job["prompts"]
    n = int(job["max_tokens"])

    def run(batch: int, max_tokens: int) -> float:
        inputs = [{"prompt_token_ids": prompts[i % len(prompts)]} for i in range(batch)]
        sp = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        t = time.perf_counter()
        llm.generate(inputs, sp, use_tqdm=False)
        return time.perf_counter() - t

    run(2, 4)  # warm-up (graph capture / JIT)
    results = {}
    for b in job["batch_sizes"]:
        run(b, 2)
        t1 = min(run(b, 1) for _ in range(2))
        tn = run(b, n)
        results[str(b)] = {"t1": t1, "tN": tn, "decode_tok_s": b * (n - 1) / max(tn - t1, 1e-9)}
    sys.stdout.write("RESULT_JSON " + json.dumps({"vllm_version": vllm.__version__, "results": results}) + "\n")


if __name__ == "__main__":
    main()
