"""Draft trees in SGLang's NGRAM verification format (pure: no sglang, no torch).

SGLang's NGRAM worker verifies, per request, a fixed-size block of `num_draft_tokens` (N) tokens:

    tokens[0]      the request's last verified token (the tree root)
    tokens[1:]     draft nodes in breadth-first order, then padding
    mask[i, j]     True iff node j is node i itself or one of its ancestors (N x N, row-major)

Padding nodes carry token 0 and hang off the root, so they are ordinary candidates and
verification stays lossless whatever they hold; but token 0 is a real token the model may sample,
and SGLang then counts the padding node as an accepted draft: `accepted_drafts` counts only the
accepted path through the block's real nodes (the plugin keeps each request's Block for that).

Seer's Draft (services.worker.engine.Draft) lists nodes with parent indices (-1 = root) in any
parents-first order; `to_block` re-orders them breadth-first (a BFS prefix is closed under
ancestors, so truncating to N - 1 nodes keeps a valid tree) and `pack_blocks` packs a batch (the
plugin's path). `to_sglang`, `pack_batch` (the same arrays straight from Drafts) and their inverse
`from_sglang` are for tests and debugging: no production code calls them.

A draft node whose token is outside the model's vocabulary (`vocab_size`) is dropped with its
subtree: SGLang embeds the block's tokens on the GPU, where an out-of-range id is a device-side
assert that takes the whole engine (every request of the batch) down. Drafts are optional, so a
bad one only loses its speculation (the worker core drops an invalid draft for its request
before any engine sees it; this guards the plugin's own path from the draft server).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from typing import NamedTuple

import numpy as np

from services.worker.engine import Draft

PAD_TOKEN = 0


def bfs_order(parents: Sequence[int], keep: Sequence[bool] | None = None) -> list[int]:
    """Node indices in breadth-first order; siblings keep their order in the draft. keep[i] False
    leaves node i and its subtree out."""
    children: dict[int, list[int]] = {}
    for i, p in enumerate(parents):
        if keep is None or keep[i]:
            children.setdefault(p, []).append(i)
    order: list[int] = []
    queue = deque(children.get(-1, []))
    while queue:
        i = queue.popleft()
        order.append(i)
        queue.extend(children.get(i, []))
    return order


class Block(NamedTuple):
    """One request's verify block before it becomes SGLang's arrays: what the plugin keeps to tell
    an accepted draft node from an accepted padding node (SGLang reports only how many tokens a
    step accepted, and a padding node's token 0 is a real token the model may sample)."""

    tokens: list[int]  # [N]: the root (last verified token), the draft nodes breadth-first, padding
    parents: list[int]  # block index of each node's parent; -1 only for the root
    real: int  # how many of tokens[1:] are draft nodes (tokens[1 : real + 1]); the rest is padding


def to_block(draft: Draft | None, last_token: int, num_draft_tokens: int, vocab_size: int | None = None) -> Block:
    """The block of one request (see to_sglang); draft None = no speculation (all padding)."""
    n = num_draft_tokens
    if n < 1:
        raise ValueError(f"num_draft_tokens: must be >= 1, got {n}")
    tokens = [int(last_token)]
    prevs = [-1]
    if draft is not None and draft.tokens:
        keep = None if vocab_size is None else [0 <= int(t) < vocab_size for t in draft.tokens]
        order = bfs_order(draft.parents, keep)[: n - 1]
        pos = {node: k + 1 for k, node in enumerate(order)}  # draft index -> block index
        for node in order:
            p = draft.parents[node]
            tokens.append(int(draft.tokens[node]))
            prevs.append(0 if p < 0 else pos[p])
    real = len(tokens) - 1
    while len(tokens) < n:
        tokens.append(PAD_TOKEN)
        prevs.append(0)
    return Block(tokens, prevs, real)


def block_depth(block: Block) -> int:
    """How many levels of draft nodes a block holds (0 without any): what the step proposed, as
    verified. Its real nodes only: to_block may have dropped out-of-vocabulary nodes (with their
    subtrees) or cut the draft at num_draft_tokens - 1 nodes, and padding sits under the root."""
    depth = [0] * (block.real + 1)  # block index -> depth; the root is 0, parents precede children
    for j in range(1, block.real + 1):
        depth[j] = depth[block.parents[j]] + 1
    return max(depth)


def block_mask(block: Block) -> np.ndarray:
    """The ancestor mask [N, N] of a block: mask[i] = mask[parent(i)] + self, built in order
    because parents precede children."""
    n = len(block.tokens)
    mask = np.zeros((n, n), dtype=bool)
    for i, p in enumerate(block.parents):
        if p >= 0:
            mask[i, : p + 1] = mask[p, : p + 1]
        mask[i, i] = True
    return mask


def to_sglang(draft: Draft | None, last_token: int, num_draft_tokens: int,
              vocab_size: int | None = None) -> tuple[list[int], np.ndarray]:
    """(tokens [N], mask [N, N] bool) for one request; draft None = no speculation (all padding).
    Tests and debugging (the plugin builds Blocks, to_block). With vocab_size, nodes whose token
    is outside [0, vocab_size) are dropped with their subtrees."""
    block = to_block(draft, last_token, num_draft_tokens, vocab_size)
    return block.tokens, block_mask(block)


def accepted_drafts(block: Block, accepted_tokens: Sequence[int]) -> int:
    """How many of a verify step's accepted draft tokens (in path order from the root: the first
    accept_lens - 1 tokens SGLang commits for the request) are draft nodes, not padding. SGLang's
    tree verify follows, from the root, a child whose token is the sampled one; a padding node
    (token 0, a leaf under the root) matches whenever the model samples token 0. The path is
    walked through draft nodes only, so a match that only a padding node explains ends the count
    (a draft node with the same token as a padding sibling is the draft's own match)."""
    node = count = 0
    for t in accepted_tokens:
        nxt = next((j for j in range(1, block.real + 1)
                    if block.parents[j] == node and block.tokens[j] == int(t)), None)
        if nxt is None:
            break
        node, count = nxt, count + 1
    return count


def from_sglang(tokens: Sequence[int], mask: np.ndarray, num_real: int | None = None) -> tuple[int, Draft]:
    """Inverse of to_sglang: (last verified token, Draft). The parent of node i is its deepest
    strict ancestor in the mask. num_real drops trailing padding (default: keep every node)."""
    n = len(tokens)
    m = np.asarray(mask, dtype=bool).reshape(n, n)
    count = n - 1 if num_real is None else num_real
    out_tokens: list[int] = []
    parents: list[int] = []
    for i in range(1, count + 1):
        ancestors = [j for j in range(i) if m[i, j]]
        parent = max(ancestors, key=lambda j: int(m[j].sum())) if ancestors else 0
        out_tokens.append(int(tokens[i]))
        parents.append(parent - 1)  # block index -> draft index; the root (0) -> -1
    return int(tokens[0]), Draft(tuple(out_tokens), tuple(parents))


def pack_batch(
    drafts: Sequence[Draft | None], last_tokens: Sequence[int], num_draft_tokens: int,
    vocab_size: int | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """The batch arrays SGLang's verify step takes: tokens [B * N] int64, mask [B * N * N] bool
    (draft nodes outside [0, vocab_size) dropped, see to_sglang). Tests and debugging (the plugin
    packs the Blocks it keeps, pack_blocks)."""
    if len(drafts) != len(last_tokens):
        raise ValueError(f"last_tokens: {len(last_tokens)} entries for {len(drafts)} drafts")
    return pack_blocks([to_block(d, last, num_draft_tokens, vocab_size)
                        for d, last in zip(drafts, last_tokens, strict=True)], num_draft_tokens)


def pack_blocks(blocks: Sequence[Block], num_draft_tokens: int) -> tuple[np.ndarray, np.ndarray]:
    """pack_batch for blocks already built (the plugin keeps them to count accepted drafts)."""
    n = num_draft_tokens
    tokens = np.empty(len(blocks) * n, dtype=np.int64)
    mask = np.empty(len(blocks) * n * n, dtype=bool)
    for b, block in enumerate(blocks):
        if len(block.tokens) != n:
            raise ValueError(f"blocks[{b}]: {len(block.tokens)} tokens, num_draft_tokens is {n}")
        tokens[b * n : (b + 1) * n] = block.tokens
        mask[b * n * n : (b + 1) * n * n] = block_mask(block).reshape(-1)
    return tokens, mask
