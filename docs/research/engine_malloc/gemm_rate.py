# ruff: noqa
# Research script (session 9); see README.md beside it.
import time, torch, statistics
torch.set_num_threads(1)
from services.worker.engines.reference.kernels.linear import small_gemm, small_gemm_available
import torch.nn.functional as F
assert small_gemm_available()
shapes = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536), "lm_head": (49152, 576)}
# 30 layers' worth of weights so they stream from memory as in the model
for M in (1, 8, 16, 32, 64):
    row = []
    for name, (N, K) in shapes.items():
        nw = 1 if name == "lm_head" else 30
        ws = [torch.randn(N, K) for _ in range(nw)]
        x = torch.randn(M, K)
        def run(f):
            ts = []
            for _ in range(5):
                t = time.perf_counter()
                for w in ws: f(x, w)
                ts.append((time.perf_counter() - t) / nw)
            return statistics.median(ts)
        tk = run(small_gemm) if M > 1 else float("nan")
        tf = run(F.linear)
        gf = lambda t: 2 * M * N * K / t / 1e9
        row.append(f"{name} ker {gf(tk):5.1f} F {gf(tf):5.1f}")
    print(f"M={M}: " + " | ".join(row), flush=True)
