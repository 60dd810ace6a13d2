# ruff: noqa
# Research script (session 10); see README.md beside it.
"""One attention layer, the paged kernel vs gather + padded SDPA, SmolLM2-135M head shapes.

    PYTHONPATH=$PWD python docs/research/paged_attn/attn_rate.py [THREADS]
"""
import time, statistics, torch, numpy as np, sys
import torch.nn.functional as F
from services.worker.engines.reference.kernels.attention import PagedQueries, paged_attention
torch.set_num_threads(int(sys.argv[1]) if len(sys.argv) > 1 else 1)
H, KV, D = 9, 3, 64
R = H // KV
torch.manual_seed(0)
nslots = 16 * 4000
kc = torch.randn(nslots, KV, D); vc = torch.randn(nslots, KV, D)
def run(B, ctx, qlens):
    lens = [ctx + 7 * b for b in range(B)]
    pages = torch.randperm(nslots // 16)
    slots = []; koff = [0]; pi = 0
    for b in range(B):
        npg = (lens[b] + 8 + 15) // 16
        s = (pages[pi:pi + npg][:, None] * 16 + torch.arange(16)[None]).reshape(-1)[: lens[b] + 8]
        pi += npg
        slots.append(s); koff.append(koff[-1] + lens[b] + 8)
    slots_flat = torch.cat(slots).long()
    koff_t = torch.tensor(koff[:-1], dtype=torch.long)
    T = sum(qlens)
    q = torch.randn(T, H, D)
    lo = []; hi = []; xm = []; qoff = [0]
    for b in range(B):
        Lb = lens[b] - (qlens[b] - 1)
        for m in range(qlens[b]):
            lo.append(0); hi.append(Lb); xm.append(sum(1 << i for i in range(m)))
        qoff.append(qoff[-1] + qlens[b])
    t = lambda a: torch.tensor(a, dtype=torch.long)
    lo, hi, qoff_t = t(lo), t(hi), t(qoff)
    xm = torch.tensor(np.array(xm, dtype=np.uint64).view(np.int64))
    pq = PagedQueries(slots=slots_flat, koff=koff_t, qoff=qoff_t, lo=lo, hi=hi, xmask=xm,
                      max_rows=max(qlens) * R, max_keys=max(lens))
    def kern():
        return paged_attention(q, kc, vc, pq)
    Qm = max(qlens); Km = max(lens)
    gather = torch.zeros(B, Km, dtype=torch.long)
    mask = torch.zeros(B, Qm, Km, dtype=torch.bool)
    pad = []
    for b in range(B):
        gather[b, :lens[b]] = slots[b][:lens[b]]
        Lb = lens[b] - (qlens[b] - 1)
        for m in range(qlens[b]):
            mask[b, m, :Lb] = True; mask[b, m, Lb:Lb + m] = True
            pad.append(b * Qm + m)
    pad = torch.tensor(pad)
    gflat = gather.reshape(-1)
    mask4 = mask[:, None].expand(B, R, Qm, Km).reshape(B, 1, R * Qm, Km)
    def ref():
        kk = kc.index_select(0, gflat).view(B, Km, KV, D).transpose(1, 2)
        vv = vc.index_select(0, gflat).view(B, Km, KV, D).transpose(1, 2)
        qp = q.new_zeros(B * Qm, H, D); qp[pad] = q
        qp = qp.view(B, Qm, KV, R, D).permute(0, 2, 3, 1, 4).reshape(B, KV, R * Qm, D)
        o = F.scaled_dot_product_attention(qp, kk, vv, attn_mask=mask4)
        o = o.view(B, KV, R, Qm, D).permute(0, 3, 1, 2, 4).reshape(B * Qm, H * D)
        return o[pad]
    a = kern(); b_ = ref()
    err = (a - b_).abs().max().item()
    tk, tr = [], []
    for _ in range(30):
        c = time.perf_counter(); kern(); tk.append(time.perf_counter() - c)
        c = time.perf_counter(); ref(); tr.append(time.perf_counter() - c)
    print(f"B={B} ctx={ctx} q={qlens[:3]}.. err={err:.2e} kernel={statistics.median(tk)*1e3:.3f}ms sdpa={statistics.median(tr)*1e3:.3f}ms x{statistics.median(tr)/statistics.median(tk):.1f}")
run(8, 300, [1]*8)
run(8, 300, [3] + [1]*7)
run(8, 300, [3]*8)
run(8, 300, [9]*8)
run(32, 100, [1]*32)
run(32, 400, [1]*32)
run(1, 300, [9])
run(4, 1000, [5]*4)
run(1, 3000, [1])
