"""Side-by-side decode throughput, reference engine vs HF generate (same prompts, same threads).

python -m tests.engine.throughput_check [--tokens 32] [--threads 1]   (bench/engine.py is the full benchmark)
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from transformers import AutoModelForCausalLM

    from services.worker.engine import GenerateRequest, SamplingParams
    from services.worker.engines.reference import ReferenceEngine
    from services.worker.model.prepare import ensure_model

    d = ensure_model()
    n = args.tokens
    eng = ReferenceEngine.from_dir(d, num_pages=2048, num_threads=args.threads)
    hf = AutoModelForCausalLM.from_pretrained(str(d), dtype=torch.float32).eval()
    prompts = [list(range(200 + 7 * i, 240 + 7 * i)) for i in range(32)]
    calls = [0]

    def ours(b: int, k: int) -> None:
        calls[0] += 1
        sp = SamplingParams(temperature=0.0, ignore_eos=True)
        eng.generate([GenerateRequest(f"t{calls[0]}-{i}", tuple(prompts[i]), k, sp) for i in range(b)])

    def hfg(b: int, k: int) -> None:
        ids = torch.tensor(prompts[:b])
        with torch.inference_mode():
            hf.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=k, min_new_tokens=k,
                        do_sample=False, pad_token_id=0)

    def timed(f: Callable[[], None]) -> float:
        t = time.perf_counter()
        f()
        return time.perf_counter() - t

    for b in (1, 8, 32):
        ours(b, 2)
        hfg(b, 2)
        rate = {}
        for name, f in (("ours", ours), ("hf", hfg)):
            t1 = timed(lambda f=f, b=b: f(b, 1))  # type: ignore[misc]
            tn = timed(lambda f=f, b=b: f(b, n))  # type: ignore[misc]
            rate[name] = b * (n - 1) / max(tn - t1, 1e-9)
        print(f"batch {b}: ours {rate['ours']:.1f} tok/s, hf {rate['hf']:.1f} tok/s, "
              f"ratio {rate['ours'] / rate['hf']:.2f}x", flush=True)


if __name__ == "__main__":
    main()
