# ruff: noqa
# Research script (session 11); see README.md beside it.
"""Old vs new small_gemm.c, alternating in one process; model shapes, weights streamed from memory.

    PYTHONPATH=$PWD python docs/research/gemm_prefetch/kernel_ab.py OLD.c [NEW.c [M,M,...]]
"""
import ctypes, sys, tempfile, time, torch
from pathlib import Path
from services.worker.engines.reference.kernels import build
torch.set_num_threads(1)
def load(src, out_dir):
    # The project's own build (same flags as the engine's kernel), into a scratch directory.
    f = ctypes.CDLL(str(build.build(Path(src), Path(out_dir)))).seer_small_gemm
    f.argtypes = [ctypes.c_void_p, ctypes.c_long, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_long, ctypes.c_long, ctypes.c_long, ctypes.c_long, ctypes.c_int]
    return f
old_src = sys.argv[1]
new_src = sys.argv[2] if len(sys.argv) > 2 else "services/worker/engines/reference/kernels/small_gemm.c"
tmp = tempfile.mkdtemp()
fa, fb = load(old_src, tmp), load(new_src, tmp)
shapes = {"qkv": (960, 576), "o": (576, 576), "gu": (3072, 576), "down": (576, 1536), "lm": (49152, 576)}
Ms = [int(a) for a in (sys.argv[3].split(",") if len(sys.argv) > 3 else "2,4,8,12,16,24,32,48,64".split(","))]
tot = {}
for name, (N, K) in shapes.items():
    copies = 2 if name == "lm" else 30
    ws = [torch.randn(N, K) for _ in range(copies)]
    line = []
    for M in Ms:
        x = torch.randn(M, K); y = torch.empty(M, N)
        ta, tb = [], []
        for r in range(7):
            for f, acc in ((fa, ta), (fb, tb)):
                t = time.perf_counter()
                for w in ws: f(x.data_ptr(), K, w.data_ptr(), None, y.data_ptr(), N, M, N, K, 1)
                acc.append((time.perf_counter() - t) / copies)
        ref = x @ ws[-1].T
        assert torch.allclose(y, ref, atol=1e-3, rtol=1e-4), (name, M)
        a, b = sorted(ta)[3], sorted(tb)[3]
        mult = 1 if name == "lm" else 30
        tot.setdefault(M, [0, 0]); tot[M][0] += a * mult; tot[M][1] += b * mult
        line.append(f"M{M} {a/b:.2f}")
    print(f"{name:5s}", " ".join(line), flush=True)
print("model (30 layers + lm) old/new ms:", " ".join(f"M{M} {v[0]*1e3:.1f}/{v[1]*1e3:.1f}={v[0]/v[1]:.2f}" for M, v in tot.items()))
