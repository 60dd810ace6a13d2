"""Target distributions and counter-based randomness.

Distribution: for a sampling request the target p at a position is softmax(logits / temperature)
restricted to the top-k tokens, then to the smallest set of most likely tokens whose mass reaches
top_p, renormalized. Greedy (temperature 0) takes the argmax of the raw logits.

Logprobs (what StepOutput.logprobs holds) are NOT taken from that processed distribution: for a
sampling request log_softmax(logits / temperature)[token] over the full vocabulary, before top-k and
top-p; for greedy the raw log_softmax(logits)[token]; computed in float32 (token_logprobs), with or
without speculation (an accepted draft token, a correction or bonus token: the logits row it was
chosen at). This is what SGLang returns by default (its sampler takes log(softmax(logits / T))
before top-k/top-p) and what RL trainers recompute for importance ratios (veRL, OpenRLHF actors:
log_softmax(logits / T), no truncation), so a trainer's ratio is 1 where the policies agree. A token
is only ever drawn from the processed distribution, where this logprob is finite.

Randomness is counter based: the uniform for (seed, output position, stream) is a fixed hash, so the
token at position t depends only on the seed, t and the context: a run cut into chunks or resumed on
another worker samples exactly what an uninterrupted run samples, with or without drafts (the
verifier draws every position with the same stream-0 numbers; verifier.py). Exactly: given the same
logits. The logits change in the last bits with the batch's shapes (a draft tree's rows vs plain
decoding, other requests in the step), and a draw that lands that close to a CDF boundary picks a
neighbour: still a sample of that step's distribution (unbiased), not a bit-for-bit replay. The
inverse CDF walks tokens in id order, so at top_p 1.0 every low-probability token is a boundary a
few 1e-7 wide: in float32 on the CPU a session-28 review found 1-8 of 256 T = 1.0 draws within
1e-7-1e-5 of one, and one of 8 requests x 96 tokens (T 1.0, top_p 1.0, no drafts) diverged at
token 86 both batched and resumed in chunks (0 of 256 near a boundary at T 0.7 / top_p 0.95, where
the tail is cut). So long T = 1.0 responses are not guaranteed to replay exactly when batched,
chunked or drafted differently; in bfloat16/float16 divergence is common. A Gumbel-max draw with
per-(seed, position, token) noise would flip only on near-ties of the top two scores (about 1e-6
of draws) but costs V hashed uniforms per row per step: not done.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from services.worker.engine import SamplingParams

_MASK64 = (1 << 64) - 1
NUCLEUS_HEAD = 256  # tokens examined by the top-p fast path before falling back to a full sort


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def uniform(seed: int, position: int, stream: int = 0) -> float:
    """A uniform in [0, 1) that depends only on (seed, position, stream)."""
    h = _splitmix64(_splitmix64(_splitmix64(seed & _MASK64) ^ position) ^ (stream * 0x632BE59BD9B4E019 & _MASK64))
    return (h >> 11) * (1.0 / (1 << 53))


def target_probs(logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """logits [N, V] float32, one SamplingParams per row (none greedy) -> probs [N, V]."""
    temps = torch.tensor([p.temperature for p in params], dtype=logits.dtype, device=logits.device)
    x = logits / temps[:, None]
    top_k = [p.top_k for p in params]
    if any(0 < k < x.shape[-1] for k in top_k):
        kmax = max(k for k in top_k if k > 0)
        kth = torch.topk(x, min(kmax, x.shape[-1]), dim=-1).values  # [N, kmax] descending
        ks = torch.tensor([k if 0 < k < x.shape[-1] else 0 for k in top_k], device=x.device)
        thresh = kth.gather(1, (ks.clamp(min=1) - 1)[:, None])  # [N, 1] value of the k-th largest
        thresh = torch.where(ks[:, None] > 0, thresh, torch.full_like(thresh, -float("inf")))
        x = x.masked_fill(x < thresh, -float("inf"))
    probs = torch.softmax(x, dim=-1)
    # Only the rows that ask for a nucleus go through it: a top_p 1.0 row's float32 cumsum reaches
    # 1.0 before the vocabulary ends, so the cut dropped its tail and its tokens and logprobs
    # depended on whether another request of the step used top_p (and it was fully sorted: 30x).
    rows = [i for i, p in enumerate(params) if p.top_p < 1.0]
    if rows:
        # [R, 1]; at least the smallest normal float: a top_p that float32 rounds to 0 dropped
        # every token, the most likely one too (0/0: NaN probabilities).
        tps = torch.tensor([params[i].top_p for i in rows], dtype=probs.dtype, device=probs.device)[:, None]
        tps = tps.clamp(min=torch.finfo(probs.dtype).tiny)
        if len(rows) == len(params):
            probs = _nucleus(probs, tps)
        else:
            idx = torch.tensor(rows, device=probs.device)
            probs = probs.index_copy(0, idx, _nucleus(probs.index_select(0, idx), tps))
    return probs


def _nucleus(probs: torch.Tensor, tps: torch.Tensor, head: int = NUCLEUS_HEAD) -> torch.Tensor:
    """Keeps, per row, the most likely tokens while the mass before each is < top_p (the most
    likely token always stays), renormalized. probs [N, V], tps [N, 1] -> [N, V].

    A full sort of the vocabulary costs more than a decode step on CPU, so rows whose nucleus fits
    in the `head` most likely tokens (the usual case) use topk; only the others are fully sorted.
    Both paths select the same set."""
    k = min(head, probs.shape[-1])
    tv, ti = probs.topk(k, dim=-1)  # [N, k] descending
    cum = tv.cumsum(-1)
    out = torch.zeros_like(probs).scatter_(-1, ti, tv.masked_fill((cum - tv) >= tps, 0.0))
    full = (cum[:, -1:] < tps)[:, 0].nonzero()[:, 0]  # rows whose nucleus is larger than the head
    if len(full):
        sp, si = probs[full].sort(dim=-1, descending=True)
        c = sp.cumsum(-1)
        out[full] = torch.zeros_like(sp).scatter_(-1, si, sp.masked_fill((c - sp) >= tps[full], 0.0))
    return out / out.sum(-1, keepdim=True)


def token_logprobs(logits: torch.Tensor, rows: Sequence[int], tokens: Sequence[int],
                   temperatures: Sequence[float]) -> list[float]:
    """log_softmax(logits[rows[i]] / temperatures[i])[tokens[i]] over the full vocabulary, in float32
    (temperature 1.0 for greedy: the raw log-softmax). logits [N, V]; one entry per emitted token.
    Only the emitted tokens' rows are normalized, in one batched log_softmax: one device sync."""
    if not rows:
        return []
    x = logits[list(rows)].float()  # a copy: the division below does not touch the step's logits
    if any(t != 1.0 for t in temperatures):
        x /= torch.tensor(list(temperatures), dtype=x.dtype, device=x.device)[:, None]
    idx = torch.tensor(list(tokens), dtype=torch.long, device=x.device)[:, None]
    return torch.log_softmax(x, dim=-1).gather(1, idx)[:, 0].tolist()


def sample_rows(probs: torch.Tensor, us: Sequence[float]) -> list[int]:
    """Inverse-CDF sampling: row i -> the token where the CDF first exceeds us[i]. [N, V] -> N."""
    cdf = probs.cumsum(-1)
    u = torch.tensor(us, dtype=cdf.dtype, device=cdf.device)[:, None] * cdf[:, -1:]
    idx = torch.searchsorted(cdf, u, right=True).clamp_(max=probs.shape[-1] - 1)
    out = idx[:, 0].tolist()
    # Never return a zero-probability token (a CDF plateau hit by float rounding at the edge).
    bad = (probs.gather(1, idx)[:, 0] <= 0).nonzero()[:, 0].tolist()
    for i in bad:
        out[i] = int(torch.nonzero(probs[i] > 0)[-1])
    return out
