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

Randomness is counter based: the number for (seed, output position, stream) is a fixed hash, so
the token at position t depends only on the seed, t and the context: a run cut into chunks or
resumed on another worker samples exactly what an uninterrupted run samples, with or without drafts
(the verifier draws every position with the same stream-0 key; verifier.py). Given the same logits
that is exact; the logits change in their last bits with the batch's shapes (a draft tree's rows,
other requests of the step, a resumed chunk's prefill), and a draw moves only if that changes which
of its two best Gumbel-max scores wins (sample_rows), about as rare as the difference itself. With
the inverse CDF used until session 28, tests/engine/test_replay.py's run (4 requests x 96 tokens,
T 1.0 / top_p 1.0) had 1 of the 4 draw another token at position 86 when resumed in chunks
(batched, all 4 matched in that run). Separately, a reviewer's run of 12 requests diverged in 2, 1
and 1 of 12 batched, chunked and drafted at T 1.0, and in 2, 4 and 7 of 12 at T 1.3. In bfloat16 /
float16 the logits differ by far more, and replays can still diverge.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
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
    """One exact draw per row of probs [N, V] (rows need not be normalized), keyed by us[i] (the
    counter-based uniform of the row's (seed, position, stream): its 53 bits name the row's noise).

    Two-level Gumbel-max: the vocabulary is cut into blocks of BLOCK token ids; a block is chosen
    by argmax(log mass_b + G_b), then a token inside it by argmax(log p_t + G_t), every G an
    independent Gumbel(0, 1) from a hash of (row key, level, block or token id). Exact: the first
    argmax picks block b with probability mass_b / sum(mass), the second token t with p_t / mass_b
    (Gumbel-max), so t comes with probability p_t / sum(p).

    Why not the inverse CDF (it was, until session 28): its boundaries are every token's cumulative
    probability in id order, at top_p 1.0 a few 1e-7 apart in the low-probability tail, and the
    last-bit logit differences between batch shapes (a draft tree's rows, other requests of the
    step, a resumed chunk's prefill) moved draws across them: a review found 1-8 of 256 T = 1.0
    draws within 1e-7-1e-5 of one, and replays diverged (the module docstring's two runs: 1 of 4
    requests resumed in chunks in test_replay's; 2/1/1 of 12 batched/chunked/drafted in a
    reviewer's at T 1.0).
    Here a draw moves only when the two best scores of a level lie within such a difference of
    each other, which a Gumbel gap makes about as rare as the difference itself (~1e-7 per level).
    Blocks keep it cheap: N x (V / BLOCK + BLOCK) hashed numbers, not N x V. One property of flat
    Gumbel-max does not carry over when V > BLOCK: redrawing with the same key after zeroing the
    drawn token is not a draw without replacement (the block race is rerun), so no rule may rely
    on it."""
    keys = _row_keys([int(u * _TWO53) for u in us])  # uniform(...) is m / 2^53: m is exact
    if probs.device.type == "cpu":
        # NumPy: a draw is ~20 small array operations, each ~1 us in NumPy and ~5-10 us in torch
        # (the verifier draws rows a few at a time). The same integers and the same rule as the
        # torch path below, which keeps a GPU's rows on the GPU; their logs may differ in the last
        # bit (a different draw only on a 1e-14 near-tie).
        cpu = probs.detach()
        if cpu.dtype not in (torch.float32, torch.float64):  # NumPy has no bfloat16
            cpu = cpu.float()
        return _draw_np(cpu.numpy(), np.asarray(keys, dtype=np.uint64))
    return _draw_torch(probs, torch.tensor(keys, dtype=torch.int64, device=probs.device))


BLOCK = 256  # token ids per first-level block of sample_rows
_TWO53 = float(1 << 53)
_TWO52 = float(1 << 52)
_M32 = 0xFFFFFFFF


def _row_keys(keys: Sequence[int]) -> list[tuple[int, int, int, int, int, int]]:
    """Three 32-bit words per row for each level of sample_rows' noise (level 1 in 0-2, 2 in 3-5)."""
    out = []
    for k in keys:
        a, c = _splitmix64((k << 2) | 1), _splitmix64((k << 2) | 2)
        b, d = _splitmix64(a), _splitmix64(c)
        out.append((a & _M32, a >> 32, b & _M32, c & _M32, c >> 32, d & _M32))
    return out


def _draw_np(probs: np.ndarray, keys: np.ndarray) -> list[int]:
    """sample_rows on the CPU. probs [N, V] float, keys [N, 6] uint64 -> N token ids."""
    n, v = probs.shape
    nb = -(-v // BLOCK)
    p = probs if nb * BLOCK == v else np.pad(probs, ((0, 0), (0, nb * BLOCK - v)))
    blocks = p.reshape(n, nb, BLOCK)  # [N, nb, BLOCK]
    rows = np.arange(n)
    if nb == 1:  # one block: its choice is certain, no noise needed for it
        b = np.zeros(n, dtype=np.int64)
    else:
        with np.errstate(divide="ignore"):  # log 0 = -inf: a block without mass is never chosen
            mass = np.log(blocks.sum(-1, dtype=np.float64))
        b = (mass + _gumbel_np(keys[:, 0:3], np.arange(nb, dtype=np.uint64)[None, :])).argmax(-1)
    ids = b[:, None] * BLOCK + np.arange(BLOCK)[None, :]  # [N, BLOCK]
    with np.errstate(divide="ignore"):
        logp = np.log(blocks[rows, b].astype(np.float64))
    t = (logp + _gumbel_np(keys[:, 3:6], ids.astype(np.uint64))).argmax(-1)
    return [int(x) for x in ids[rows, t]]


def _mix32_np(x: np.ndarray) -> np.ndarray:
    """_mix32 in uint64 NumPy (products wrap mod 2^64: their low 32 bits are the same)."""
    m = np.uint64(_M32)
    x = x ^ (x >> np.uint64(16))
    x = (x * np.uint64(0x7FEB352D)) & m
    x = x ^ (x >> np.uint64(15))
    x = (x * np.uint64(0x846CA68B)) & m
    return x ^ (x >> np.uint64(16))


def _gumbel_np(keys: np.ndarray, ids: np.ndarray) -> np.ndarray:
    """_gumbel in NumPy: keys [N, 3] uint64, ids [N or 1, K] uint64 -> [N, K] float64."""
    h1 = _mix32_np(_mix32_np(ids ^ keys[:, 0:1]) ^ keys[:, 1:2])
    h2 = _mix32_np(h1 ^ keys[:, 2:3])
    # 52 bits + 0.5: exact in float64 and strictly inside (0, 1) (53 bits + 0.5 rounds the
    # largest value up to 1.0: an infinite G, and -inf + inf = NaN would win an argmax).
    u = (((h1 << np.uint64(20)) | (h2 >> np.uint64(12))).astype(np.float64) + 0.5) / _TWO52
    return -np.log(-np.log(u))


def _draw_torch(probs: torch.Tensor, keys: torch.Tensor) -> list[int]:
    """sample_rows on a GPU: the same rule as _draw_np in int64 torch. keys [N, 6] int64."""
    n, v = probs.shape
    nb = -(-v // BLOCK)
    p = probs if nb * BLOCK == v else torch.nn.functional.pad(probs, (0, nb * BLOCK - v))
    blocks = p.reshape(n, nb, BLOCK)  # [N, nb, BLOCK]
    dev = probs.device
    if nb == 1:
        b = torch.zeros(n, dtype=torch.int64, device=dev)
    else:
        ids_b = torch.arange(nb, dtype=torch.int64, device=dev)[None, :].expand(n, nb)  # [N, nb]
        b = (blocks.sum(-1, dtype=torch.float64).log() + _gumbel(keys[:, 0:3], ids_b)).argmax(-1)  # [N]
    inner = blocks.gather(1, b[:, None, None].expand(n, 1, BLOCK))[:, 0]  # [N, BLOCK]
    ids_t = b[:, None] * BLOCK + torch.arange(BLOCK, dtype=torch.int64, device=dev)[None, :]  # [N, BLOCK]
    score_t = inner.double().log() + _gumbel(keys[:, 3:6], ids_t)
    return (ids_t.gather(1, score_t.argmax(-1, keepdim=True))[:, 0]).tolist()


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """(x * c) mod 2^32 for x in [0, 2^32), in int64 without overflow (the halves of c are < 2^16,
    so no product passes 2^48): the same bits on every device."""
    lo, hi = c & 0xFFFF, c >> 16
    return (x * lo + (((x * hi) & 0xFFFF) << 16)) & _M32


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A bijective 32-bit integer hash (lowbias32, C. Wellons) over int64 tensors holding 32 bits."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def _gumbel(keys: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Gumbel(0, 1) noise [N, K] float64 for ids [N, K] (int64, < 2^32) under row keys [N, 3]:
    a 52-bit uniform from two chained hashes, then -log(-log u)."""
    h1 = _mix32(_mix32(ids ^ keys[:, 0:1]) ^ keys[:, 1:2])
    h2 = _mix32(h1 ^ keys[:, 2:3])
    u = (((h1 << 20) | (h2 >> 12)).double() + 0.5) / _TWO52  # strictly (0, 1): see _gumbel_np
    return -torch.log(-torch.log(u))
