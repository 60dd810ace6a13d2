"""Turns the scheduled sequences (+ their draft trees) into one ForwardBatch and runs the model.

Per request the step feeds its uncomputed tail (the whole uncached prefix in a prefill step, the
last sampled token in a decode step) followed by the draft nodes. Draft node m is written to the
cache slot of position len + m (scratch space inside the request's own pages) at rotary position
len - 1 + depth(m); after verification the accepted path is copied to its real positions.
Logits are returned for the last tail token (the root of the draft tree) and for every draft node.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import numpy as np
import torch

from services.worker.engines.reference.kernels.attention import MAX_TREE, PagedQueries, use_paged_attention
from services.worker.engines.reference.model import AttnGroup, ForwardBatch, LlamaModel
from services.worker.engines.reference.sequence import Sequence

SHORT_QUERY = 32  # queries per request up to which a request attends in the decode group
MASK_ALIGN = 16  # key columns of an additive mask are padded to this (the efficient SDPA kernel's alignment)
# The paged kernel describes a query's draft-tree ancestors with one 64-bit mask: every short query
# group must fit it (a longer tree is a long query and takes the SDPA path).
assert SHORT_QUERY <= MAX_TREE, "SHORT_QUERY must not exceed the paged kernel's MAX_TREE"


@dataclass
class DraftTree:
    tokens: list[int]
    parents: list[int]  # -1 = the root (the last verified token)
    depth: list[int]  # 1 for children of the root
    children: list[list[int]]  # children of node m (in the given order)
    root_children: list[int]

    @classmethod
    def build(cls, tokens: list[int], parents: list[int]) -> DraftTree:
        depth: list[int] = []
        children: list[list[int]] = [[] for _ in tokens]
        root_children: list[int] = []
        for m, p in enumerate(parents):
            if p < 0:
                depth.append(1)
                root_children.append(m)
            else:
                depth.append(depth[p] + 1)
                children[p].append(m)
        return cls(list(tokens), list(parents), depth, children, root_children)

    def __len__(self) -> int:
        return len(self.tokens)

    def ancestor_mask(self) -> np.ndarray:
        """[n, n] bool: node i may attend to node j (j is i or an ancestor of i)."""
        n = len(self.tokens)
        m = np.zeros((n, n), dtype=bool)
        for i, p in enumerate(self.parents):
            m[i, i] = True
            if p >= 0:
                m[i] |= m[p]
        return m


class ModelRunner:
    def __init__(self, model: LlamaModel, num_pages: int, page_size: int) -> None:
        cfg = model.cfg
        self.model = model
        self.page_size = page_size
        # Zero-filled so padded key slots are finite (masked, but 0 * NaN would still poison SDPA).
        self.kv_cache = torch.zeros(
            (cfg.num_layers, 2, num_pages * page_size, cfg.num_kv_heads, cfg.head_dim),
            dtype=model.dtype,
            device=model.device,
        )
        self.window = cfg.sliding_window if cfg.sliding_window else None
        # SDPA with a bool mask converts it to an additive float mask (where) and pads its key
        # columns to MASK_ALIGN in every layer: on a GPU 4-5 kernel launches per layer, about a seventh
        # of a batch-32 step's host time (torch.profiler, H100, session 20). The runner builds that
        # mask once per step instead. The CPU's SDPA (prefill only) keeps the bool mask.
        self.additive_mask = model.device.type != "cpu"

    def page_view(self) -> torch.Tensor:
        """[layers, 2, pages, page_size, KV, D] view of the cache."""
        c = self.kv_cache
        return c.view(c.shape[0], 2, -1, self.page_size, c.shape[-2], c.shape[-1])

    def _slots(self, seq: Sequence, positions: np.ndarray) -> np.ndarray:
        ps = self.page_size
        return seq.block_array[positions // ps] * ps + positions % ps

    def run(self, seqs: list[Sequence], trees: list[DraftTree | None]) -> tuple[torch.Tensor, list[int]]:
        """(logits [N, vocab], row offset of each sequence's root in the logits)."""
        ids: list[np.ndarray] = []
        pos: list[np.ndarray] = []
        wslots: list[np.ndarray] = []
        q_lens: list[int] = []
        logit_rows: list[int] = []
        root_rows: list[int] = []
        t_off = 0
        for seq, tree in zip(seqs, trees, strict=True):
            L, c = len(seq), seq.num_computed
            n = len(tree) if tree is not None else 0
            tail_pos = np.arange(c, L, dtype=np.int64)
            toks = np.asarray(seq.token_ids[c:L], dtype=np.int64)
            if tree is not None and n:
                toks = np.concatenate([toks, np.asarray(tree.tokens, dtype=np.int64)])
                draft_pos = L - 1 + np.asarray(tree.depth, dtype=np.int64)
                p = np.concatenate([tail_pos, draft_pos])
                w = np.concatenate([self._slots(seq, tail_pos), self._slots(seq, np.arange(L, L + n))])
            else:
                p = tail_pos
                w = self._slots(seq, tail_pos)
            ids.append(toks)
            pos.append(p)
            wslots.append(w)
            q = (L - c) + n
            q_lens.append(q)
            root_rows.append(len(logit_rows))
            logit_rows.extend(range(t_off + (L - c) - 1, t_off + q))
            t_off += q
        # Short queries (decode + drafts) and long ones (prefill) attend in separate groups, so a
        # decode in a step that also prefills pads to its own size, not to the prompt length.
        short = [i for i, q in enumerate(q_lens) if q <= SHORT_QUERY]
        long_ = [i for i, q in enumerate(q_lens) if q > SHORT_QUERY]
        parts = [short, long_] if short and long_ else [list(range(len(seqs)))]
        starts = np.cumsum([0, *q_lens])
        model = self.model
        kernel = use_paged_attention(model.device, model.dtype, model.cfg.head_dim)
        groups = []
        for idx in parts:
            token_index = None
            if len(parts) > 1:
                token_index = torch.from_numpy(
                    np.concatenate([np.arange(starts[i], starts[i + 1], dtype=np.int64) for i in idx])).to(model.device)
            if kernel and all(q_lens[i] <= SHORT_QUERY for i in idx):
                groups.append(self._paged_group(idx, seqs, trees, token_index))
            else:
                groups.append(self._group(idx, seqs, trees, q_lens, token_index))
        dev = self.model.device
        fb = ForwardBatch(
            input_ids=torch.from_numpy(np.concatenate(ids)).to(dev),
            positions=torch.from_numpy(np.concatenate(pos)).to(dev),
            write_slots=torch.from_numpy(np.concatenate(wslots)).to(dev),
            logits_index=torch.from_numpy(np.asarray(logit_rows, dtype=np.int64)).to(dev),
            groups=groups,
        )
        return self.model.forward(fb, self.kv_cache), root_rows

    def _paged_group(self, idx: list[int], seqs: list[Sequence], trees: list[DraftTree | None],
                     token_index: torch.Tensor | None) -> AttnGroup:
        """The kernel's description of a short-query group: per request its key slots by position,
        per query the visible prefix [lo, hi) and, for draft nodes, the ancestor bits over the
        tree's keys (which follow the prefix at positions L, L + 1, ...)."""
        R = self.model.cfg.num_heads // self.model.cfg.num_kv_heads
        slots: list[np.ndarray] = []
        koff: list[int] = []
        qoff = [0]
        lo: list[np.ndarray] = []
        hi: list[np.ndarray] = []
        xmask: list[np.ndarray] = []
        k_total = max_rows = max_keys = 0
        for i in idx:
            seq, tree = seqs[i], trees[i]
            L, c = len(seq), seq.num_computed
            n = len(tree) if tree is not None else 0
            slots.append(self._slots(seq, np.arange(L + n, dtype=np.int64)))
            koff.append(k_total)
            k_total += L + n
            # The uncomputed tail (a decode's last token, or a few resumed tokens): causal.
            pos = np.arange(c, L, dtype=np.int64)
            q_hi = pos + 1
            bits = np.zeros(L - c, dtype=np.uint64)
            if tree is not None and n:
                pos = np.concatenate([pos, L - 1 + np.asarray(tree.depth, dtype=np.int64)])
                q_hi = np.concatenate([q_hi, np.full(n, L, dtype=np.int64)])
                anc = tree.ancestor_mask().astype(np.uint64)  # [n, n]: node i sees node j
                bits = np.concatenate([bits, (anc << np.arange(n, dtype=np.uint64)).sum(axis=1, dtype=np.uint64)])
            q_lo = np.maximum(pos - self.window + 1, 0) if self.window is not None else np.zeros_like(pos)
            lo.append(q_lo)
            hi.append(q_hi)
            xmask.append(bits)
            qoff.append(qoff[-1] + len(pos))
            max_rows = max(max_rows, len(pos) * R)
            max_keys = max(max_keys, max(int(q_hi.max()), L + n) - int(q_lo.min()))
        dev = self.model.device

        def t(a: np.ndarray) -> torch.Tensor:
            return torch.from_numpy(np.ascontiguousarray(a)).to(dev)

        pq = PagedQueries(
            slots=t(np.concatenate(slots)), koff=t(np.asarray(koff, dtype=np.int64)),
            qoff=t(np.asarray(qoff, dtype=np.int64)), lo=t(np.concatenate(lo)), hi=t(np.concatenate(hi)),
            xmask=t(np.concatenate(xmask).view(np.int64)), max_rows=max_rows, max_keys=max_keys,
        )
        return AttnGroup(token_index=token_index, paged=pq, gather_slots=None, pad_index=None, attn_mask=None,
                         batch=len(idx), q_max=0, k_max=0)

    def _group(self, idx: list[int], seqs: list[Sequence], trees: list[DraftTree | None], q_lens: list[int],
               token_index: torch.Tensor | None) -> AttnGroup:
        R = self.model.cfg.num_heads // self.model.cfg.num_kv_heads
        g_seqs = [seqs[i] for i in idx]
        g_trees = [trees[i] for i in idx]
        g_q = [q_lens[i] for i in idx]
        g_k = [len(s) + (len(t) if t is not None else 0) for s, t in zip(g_seqs, g_trees, strict=True)]
        B, Qm, Km = len(idx), max(g_q), max(g_k)
        mask = self._mask(g_seqs, g_trees, g_q, g_k, Qm, Km)
        if mask is not None and self.additive_mask and Km % MASK_ALIGN:
            # Extra key columns (slot 0, masked out) so SDPA need not pad the mask in every layer.
            Km = -(-Km // MASK_ALIGN) * MASK_ALIGN
            mask = np.pad(mask, ((0, 0), (0, 0), (0, Km - mask.shape[-1])))
        gather = np.zeros((B, Km), dtype=np.int64)
        for b, (seq, k) in enumerate(zip(g_seqs, g_k, strict=True)):
            gather[b, :k] = self._slots(seq, np.arange(k, dtype=np.int64))
        pad_index = None
        if any(q != Qm for q in g_q):
            pad_index = np.concatenate([b * Qm + np.arange(q, dtype=np.int64) for b, q in enumerate(g_q)])
        if mask is not None and R > 1:
            # Query rows are ordered (head-in-group, query): repeat the mask per head of a group.
            mask = np.broadcast_to(mask[:, None, :, :], (B, R, Qm, Km)).reshape(B, R * Qm, Km)
        dev = self.model.device

        def t(a: np.ndarray | None) -> torch.Tensor | None:
            return None if a is None else torch.from_numpy(np.ascontiguousarray(a)).to(dev)

        gs = t(gather.reshape(-1))
        assert gs is not None
        am = t(mask)
        if am is not None and self.additive_mask:
            # [B, R Qm, Km] bool -> additive: 0 where a query attends, -inf elsewhere (every query
            # sees at least one key, so no row is all -inf).
            am = torch.zeros(am.shape, dtype=self.model.dtype, device=dev).masked_fill_(~am, float("-inf"))
        return AttnGroup(
            token_index=token_index,
            paged=None,
            gather_slots=gs,
            pad_index=t(pad_index),
            attn_mask=None if am is None else am[:, None],
            batch=B,
            q_max=Qm,
            k_max=Km,
        )

    def _mask(self, seqs: list[Sequence], trees: list[DraftTree | None], q_lens: list[int],
              k_lens: list[int], Qm: int, Km: int) -> np.ndarray | None:
        """[B, Qm, Km] bool, or None when every query may see every key (uniform decode)."""
        has_tree = any(t is not None and len(t) for t in trees)
        if Qm == 1 and not has_tree and all(k == Km for k in k_lens) and self.window is None:
            return None
        B = len(seqs)
        # Highest key index each query may see (causal part); padded queries see key 0 only.
        limit = np.zeros((B, Qm), dtype=np.int64)
        for b, seq in enumerate(seqs):
            L, c = len(seq), seq.num_computed
            tail = L - c
            limit[b, :tail] = np.arange(c, L)
            limit[b, tail : q_lens[b]] = L - 1
        keys = np.arange(Km, dtype=np.int64)
        mask = keys[None, None, :] <= limit[:, :, None]
        if self.window is not None:
            # Sliding window (Mistral): bounded by each query's own position. A draft node at depth d
            # sits at position L-1+d, not L-1, so it must not see the d oldest keys plain decoding
            # would no longer see. (Within the tree, ancestors are closer than any window.)
            pos = limit.copy()
            for b, (seq, tree) in enumerate(zip(seqs, trees, strict=True)):
                if tree is not None and len(tree):
                    L, tail = len(seq), len(seq) - seq.num_computed
                    pos[b, tail : tail + len(tree)] = L - 1 + np.asarray(tree.depth, dtype=np.int64)
            mask &= keys[None, None, :] > pos[:, :, None] - self.window
        for b, (seq, tree) in enumerate(zip(seqs, trees, strict=True)):
            if tree is not None and len(tree):
                L, tail, n = len(seq), len(seq) - seq.num_computed, len(tree)
                mask[b, tail : tail + n, L : L + n] = tree.ancestor_mask()
        return mask

    def commit_accepted(self, seq: Sequence, tree: DraftTree, path: list[int]) -> None:
        """Moves the KV of accepted draft nodes `path` to positions len, len+1, ... of seq
        (called before the accepted tokens are appended)."""
        L = len(seq)
        src_pos = L + np.asarray(path, dtype=np.int64)
        dst_pos = L + np.arange(len(path), dtype=np.int64)
        if np.array_equal(src_pos, dst_pos):
            return  # a chain: already in place
        src = torch.from_numpy(self._slots(seq, src_pos)).to(self.model.device)
        dst = torch.from_numpy(self._slots(seq, dst_pos)).to(self.model.device)
        rows = self.kv_cache.index_select(2, src)  # gather first: src and dst may overlap
        self.kv_cache.index_copy_(2, dst, rows)

    def read_pages(self, pages: list[int]) -> list[memoryview]:
        """Bytes of each page in layout layer,kv,token,head,dim: a flat byte view of a fresh
        contiguous copy (the gather out of the strided cache is the only copy; `tobytes()` after
        it was a second one, on the decode path since export runs under the engine lock)."""
        view = self.page_view()
        out = []
        for p in pages:
            t = view[:, :, p].contiguous()  # [layers, 2, page, kv_heads, head_dim], a copy
            if t.dtype == torch.bfloat16:
                t = t.view(torch.int16)  # numpy has no bfloat16; the bytes are the same
            out.append(t.cpu().numpy().data.cast("B"))
        return out

    def write_page(self, page: int, data: bytes | memoryview) -> None:
        view = self.page_view()
        shape = view[:, :, page].shape
        dtype = torch.int16 if self.kv_cache.dtype == torch.bfloat16 else self.kv_cache.dtype
        with warnings.catch_warnings():
            # `data` is read-only (bytes, or a view into a received message) and torch warns that
            # its tensor could write to it; this one is only read, by the copy into the cache
            # below, so no defensive copy of the page is made first.
            warnings.filterwarnings("ignore", message="The given buffer is not writable")
            arr = torch.frombuffer(data, dtype=dtype)
        if self.kv_cache.dtype == torch.bfloat16:
            arr = arr.view(torch.bfloat16)
        view[:, :, page] = arr.view(shape).to(self.kv_cache.device)
