"""ReferenceEngine: the Engine facade over block manager, scheduler, model runner and verifier.

Between steps the engine holds no half-done work: a step schedules (admits waiting requests, whose
prefill joins the decode of the running ones), runs one forward pass with every request's draft tree,
verifies, appends the emitted tokens, registers newly full pages in the prefix cache and frees the
pages of finished requests (they stay cached for the next chunk or a sibling). Bad input raises
ValueError naming the field before any state changes, so other requests keep running. A step that
throws before its results are committed (the forward pass, verification) changes nothing: the
requests it admitted wait again and their pages, registered before the KV was written, are
unregistered (issue 2); one that throws while committing aborts the step's requests.
"""

from __future__ import annotations

import secrets
import time
from collections import deque
from collections.abc import Mapping
from collections.abc import Sequence as Seq
from pathlib import Path

import numpy as np
import torch

from services.common import memtune
from services.common.log import get_logger, kv
from services.common.pagehash import chain_hashes
from services.worker.engine import (
    Draft,
    Engine,
    EngineStats,
    FinishReason,
    GenerateRequest,
    KVLayout,
    KVPages,
    StepOutput,
)
from services.worker.engines.reference.block_manager import BlockManager
from services.worker.engines.reference.config import EngineConfig
from services.worker.engines.reference.model import LlamaModel
from services.worker.engines.reference.model_runner import DraftTree, ModelRunner
from services.worker.engines.reference.sampler import sample_rows, target_probs, token_logprobs, uniform
from services.worker.engines.reference.scheduler import Scheduler
from services.worker.engines.reference.sequence import SeqStatus, Sequence
from services.worker.engines.reference.verifier import Verifier
from services.worker.model.config import ModelConfig
from services.worker.model.loader import load_state_dict

log = get_logger(__name__)

_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}
_RATE_WINDOW_S = 10.0
# ModelConfig fields that define the network (LoadWeights refuses weights that differ in one).
_ARCHITECTURE_FIELDS = (
    "model_type", "vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads",
    "head_dim", "rms_norm_eps", "rope_theta", "max_position_embeddings", "tie_word_embeddings",
    "attention_bias", "sliding_window",
)


class ReferenceEngine(Engine):
    def __init__(self, model_dir: Path | str, config: EngineConfig | None = None,
                 verifier: Verifier | None = None) -> None:
        self.config = cfg = config or EngineConfig()
        cfg.validate()
        if cfg.num_threads:
            torch.set_num_threads(cfg.num_threads)
        if cfg.tune_malloc:
            memtune.tune_malloc()
        self.model_dir = Path(model_dir)
        self.model_config = mc = ModelConfig.from_dir(self.model_dir)
        if mc.num_heads % mc.num_kv_heads:
            raise ValueError("num_key_value_heads: must divide num_attention_heads")
        self._version = cfg.model_version
        self._layout = KVLayout(
            dtype=_DTYPE_NAMES[cfg.dtype], page_size=cfg.page_size, num_layers=mc.num_layers,
            num_kv_heads=mc.num_kv_heads, head_dim=mc.head_dim,
        )
        num_pages = cfg.num_pages or max(1, cfg.kv_memory_bytes // self._layout.page_bytes)
        self.device = torch.device(cfg.device)
        self.model = LlamaModel(mc, self.device, cfg.dtype, mc.max_position_embeddings)
        self.model.load(load_state_dict(self.model_dir))
        self.blocks = BlockManager(num_pages, cfg.page_size, self._version)
        self.scheduler = Scheduler(cfg, self.blocks)
        self.runner = ModelRunner(self.model, num_pages, cfg.page_size)
        self.verifier = verifier or Verifier()
        # Draw every draft-tree row's token in one batched call before the walks (_verify_trees):
        # on a GPU, where each read from Python is a sync; on the CPU, reading in place is cheaper.
        self.batched_tree_draws = self.device.type != "cpu"
        self._eos = mc.eos_token_ids
        # Counters for stats().
        self._accepted_pos: list[int] = []
        self._proposed_pos: list[int] = []
        self._prefill_tokens = 0
        self._cached_tokens = 0
        self._imported_tokens = 0
        self._generated = 0
        self._steps = 0
        self._rate: deque[tuple[float, float, int]] = deque()  # (end time, step seconds, tokens)

    @classmethod
    def from_dir(
        cls,
        model_dir: Path | str,
        *,
        device: str = "cpu",
        dtype: torch.dtype = torch.float32,
        page_size: int = 16,
        num_pages: int | None = None,
        kv_memory_bytes: int | None = None,
        max_batch_size: int = 256,
        model_version: str = "v0",
        num_threads: int | None = None,
        verifier: Verifier | None = None,
        tune_malloc: bool = True,
    ) -> ReferenceEngine:
        kw = {} if kv_memory_bytes is None else {"kv_memory_bytes": kv_memory_bytes}
        cfg = EngineConfig(device=device, dtype=dtype, page_size=page_size, num_pages=num_pages,
                           max_batch_size=max_batch_size, model_version=model_version,
                           num_threads=num_threads, tune_malloc=tune_malloc, **kw)  # type: ignore[arg-type]
        return cls(model_dir, cfg, verifier)

    # ---- properties -----------------------------------------------------------------------------
    @property
    def vocab_size(self) -> int:
        return self.model_config.vocab_size

    @property
    def max_context(self) -> int:
        return self.model_config.max_position_embeddings

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        return self._eos

    @property
    def model_version(self) -> str:
        return self._version

    @property
    def kv_layout(self) -> KVLayout:
        return self._layout

    @property
    def broken(self) -> str | None:
        # Never broken by a load: load_weights reads and checks the whole checkpoint before
        # model.load swaps any tensor in, so a failed load leaves the served weights as they were.
        return None

    # ---- requests -------------------------------------------------------------------------------
    def _check_ids(self, ids: Seq[int], field: str) -> None:
        if not ids:
            return
        arr = np.asarray(ids, dtype=np.int64)
        bad = np.nonzero((arr < 0) | (arr >= self.vocab_size))[0]
        if len(bad):
            i = int(bad[0])
            raise ValueError(f"{field}[{i}]: token id {int(arr[i])} is outside the vocabulary [0, {self.vocab_size})")

    def add_request(self, req: GenerateRequest) -> None:
        if not req.request_id:
            raise ValueError("request_id: must not be empty")
        if req.request_id in self.scheduler.by_id:
            raise ValueError(f"request_id: {req.request_id!r} is already live")
        if not req.prompt_token_ids:
            raise ValueError("prompt_token_ids: must not be empty")
        self._check_ids(req.prompt_token_ids, "prompt_token_ids")
        self._check_ids(req.output_token_ids, "output_token_ids")
        try:
            req.sampling.validate(self.vocab_size)
        except ValueError as e:
            raise ValueError(f"sampling.{e}") from None
        if req.max_new_tokens <= 0:
            raise ValueError(f"max_new_tokens: must be > 0, got {req.max_new_tokens}")
        prefix = len(req.prompt_token_ids) + len(req.output_token_ids)
        if prefix >= self.max_context:
            # The prefix alone leaves no room for a token: naming max_new_tokens would send the
            # caller to the wrong field.
            field = "prompt_token_ids" if not req.output_token_ids else "output_token_ids"
            raise ValueError(f"{field}: prompt + output = {prefix} tokens leaves no room in the context "
                             f"length {self.max_context}")
        total = prefix + req.max_new_tokens
        if total > self.max_context:
            raise ValueError(
                f"max_new_tokens: prefix + max_new_tokens = {total} is past the context length {self.max_context}"
            )
        if self.blocks.pages_for(total) > self.blocks.num_pages:
            raise ValueError(
                f"max_new_tokens: the request needs {self.blocks.pages_for(total)} KV pages, "
                f"the cache has {self.blocks.num_pages}"
            )
        seed = req.sampling.seed if req.sampling.seed is not None else secrets.randbits(63)
        self.scheduler.add(Sequence.from_request(req, seed, self._eos))

    def abort(self, request_id: str) -> bool:
        return self.scheduler.abort(request_id) is not None

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def request_tokens(self, request_id: str) -> tuple[int, ...]:
        seq = self.scheduler.by_id.get(request_id)
        if seq is None:
            raise KeyError(request_id)
        return tuple(seq.token_ids)

    # ---- step -----------------------------------------------------------------------------------
    def _trees(self, seqs: list[Sequence], drafts: Mapping[str, Draft] | None) -> list[DraftTree | None]:
        """Each scheduled request's draft, trimmed to what the request can still emit (drafts are
        optional, trimming is safe). Validated once, by step(), before anything was scheduled."""
        trees: list[DraftTree | None] = []
        for seq in seqs:
            d = drafts.get(seq.request_id) if drafts else None
            if d is None or not d.tokens:
                trees.append(None)
                continue
            n = min(len(d.tokens), seq.remaining, self.config.max_draft_tokens)
            trees.append(DraftTree.build(list(d.tokens[:n]), list(d.parents[:n])) if n > 0 else None)
        return trees

    def step(self, drafts: Mapping[str, Draft] | None = None) -> list[StepOutput]:
        if drafts:
            # The one validation of the step's drafts (_trees relies on it), before anything
            # changes, for every request known here, scheduled this step or not: bad input is an
            # error whenever it is given. (The worker core drops a bad draft alone before calling
            # this; a direct caller gets the ValueError naming the draft.)
            for rid, d in drafts.items():
                if rid in self.scheduler.by_id:
                    try:
                        d.validate(self.vocab_size)
                    except ValueError as e:
                        raise ValueError(f"drafts[{rid!r}].{e}") from None
        t0 = time.perf_counter()
        seqs, admitted = self.scheduler.schedule()
        if not seqs:
            return []
        try:
            trees = self._trees(seqs, drafts)
            logits, root_rows = self.runner.run(seqs, trees)  # [N, V]
            results = self._verify(seqs, trees, logits, root_rows)
        except BaseException as e:
            # Nothing is committed until _apply: roll back this step's admissions, whose pages were
            # registered in the prefix cache before the forward pass that fills them (so a sibling
            # in the same step shares them); left registered, a later request would reuse garbage
            # KV. Running requests keep their state: the next step recomputes the same KV slots.
            self.scheduler.unadmit(admitted)
            e.add_note(
                f"engine step failed: {len(seqs) - len(admitted)} running requests unchanged, "
                f"{len(admitted)} newly admitted put back to waiting; the next step retries them"
            )
            log.warning("engine step failed; rolled back its admissions",
                        extra=kv(running=len(seqs) - len(admitted), admitted=len(admitted),
                                          error=repr(e)))
            raise
        self._prefill_tokens += sum(len(s) - s.num_computed for s in admitted)
        self._cached_tokens += sum(s.num_cached_at_admit for s in admitted)
        outputs: list[StepOutput] = []
        emitted = 0
        try:
            for seq, tree, (tokens, path, lps) in zip(seqs, trees, results, strict=True):
                out = self._apply(seq, tree, tokens, path, lps)
                emitted += len(out.token_ids)
                outputs.append(out)
        except BaseException as e:
            # Some requests have advanced, but their tokens would never reach the caller: a retry
            # would silently drop them. Abort every request of the step instead (an engine bug,
            # not an input error: never a ValueError that a caller might retry). Their registered
            # pages hold KV the forward pass did write, so they stay cached.
            for seq in seqs:
                if seq.status == SeqStatus.RUNNING:
                    self.scheduler.abort(seq.request_id)
            log.error("engine step failed while committing; its requests were aborted",
                      extra=kv(requests=len(seqs), error=repr(e)))
            if not isinstance(e, Exception):
                raise  # KeyboardInterrupt, SystemExit: as they are
            raise RuntimeError(
                f"engine step failed while committing its results ({e!r}); its {len(seqs)} requests were aborted"
            ) from e
        self._steps += 1
        self._generated += emitted
        now = time.perf_counter()
        self._rate.append((now, now - t0, emitted))
        while self._rate and self._rate[0][0] < now - _RATE_WINDOW_S:
            self._rate.popleft()
        return outputs

    def _verify(self, seqs: list[Sequence], trees: list[DraftTree | None], logits: torch.Tensor,
                root_rows: list[int]) -> list[tuple[list[int], list[int], list[float]]]:
        """Per sequence: (emitted tokens, accepted draft node path, logprob of each token).

        The tokens come from the processed target (target_probs: temperature, top-k, top-p); the
        logprobs do not: every emitted token's logprob is log_softmax(logits / T)[token] over the full
        vocabulary (T = 1 for greedy), read from the logits row it was chosen at, plain or drafted
        alike (sampler.token_logprobs), in one computation for the whole step."""
        n_rows = [1 + (len(t) if t is not None else 0) for t in trees]
        greedy_rows = [r for s, r0, n in zip(seqs, root_rows, n_rows, strict=True) if s.sampling.greedy
                       for r in range(r0, r0 + n)]
        samp_rows = [r for s, r0, n in zip(seqs, root_rows, n_rows, strict=True) if not s.sampling.greedy
                     for r in range(r0, r0 + n)]
        argmax: list[int] = []
        if greedy_rows:
            argmax = logits[greedy_rows].argmax(-1).tolist()
        probs: torch.Tensor | None = None
        if samp_rows:
            params = [s.sampling for s, n in zip(seqs, n_rows, strict=True) if not s.sampling.greedy
                      for _ in range(n)]
            probs = target_probs(logits[samp_rows], params)  # [Ns, V]
        # Plain sampling (no tree) is batched: one draw per request (sampler.sample_rows).
        plain = [i for i, (s, t) in enumerate(zip(seqs, trees, strict=True)) if not s.sampling.greedy and t is None]
        # Per sequence: (tokens, path, the logits row of each token).
        chosen: list[tuple[list[int], list[int], list[int]]] = [([], [], [])] * len(seqs)
        g_off = s_off = 0
        s_offsets: dict[int, int] = {}
        for i, (s, n) in enumerate(zip(seqs, n_rows, strict=True)):
            if s.sampling.greedy:
                tree = trees[i]
                rows_argmax = argmax[g_off : g_off + n]
                toks: list[int]
                path: list[int]
                rows: list[int]
                if tree is None:
                    toks, path, rows = [rows_argmax[0]], [], [0]
                else:
                    toks, path, rows = self.verifier.verify_greedy(tree, rows_argmax)
                chosen[i] = (toks, path, [greedy_rows[g_off + r] for r in rows])
                g_off += n
            else:
                s_offsets[i] = s_off
                s_off += n
        if plain:
            assert probs is not None
            sub = probs[[s_offsets[i] for i in plain]]
            toks = sample_rows(sub, [uniform(seqs[i].seed, seqs[i].next_output_position, 0) for i in plain])
            for i, t in zip(plain, toks, strict=True):
                chosen[i] = ([t], [], [samp_rows[s_offsets[i]]])
        drafted = [(i, tr, off) for i, off in s_offsets.items() if (tr := trees[i]) is not None]
        if drafted:
            assert probs is not None
            for i, (toks, path, rows) in self._verify_trees(seqs, drafted, probs).items():
                chosen[i] = (toks, path, [samp_rows[s_offsets[i] + r] for r in rows])
        # The logprobs of every emitted token in one computation: one device sync per step, not one
        # per token (on a GPU each sync costs a round trip).
        temps = [1.0 if s.sampling.greedy else s.sampling.temperature
                 for s, (_t, _p, rows) in zip(seqs, chosen, strict=True) for _ in rows]
        flat = token_logprobs(logits, [r for _t, _p, rows in chosen for r in rows],
                              [t for toks, _p, _r in chosen for t in toks], temps)
        results: list[tuple[list[int], list[int], list[float]]] = []
        k = 0
        for toks, path, _rows in chosen:
            results.append((toks, path, flat[k : k + len(toks)]))
            k += len(toks)
        return results

    def _verify_trees(self, seqs: list[Sequence], drafted: list[tuple[int, DraftTree, int]], probs: torch.Tensor
                      ) -> dict[int, tuple[list[int], list[int], list[int]]]:
        """The sampled requests with a draft tree, (index in seqs, tree, first row of its 1 + n rows
        in probs) -> per request (emitted tokens, accepted path, tree row 0..n each token was drawn
        at). The verifier walks each tree node by node in Python.

        On the CPU it reads `probs` in place and draws a row's token only when the walk reaches it
        (most walks stop at the root). On a GPU every read from Python is a device sync, and the
        walk used to take every tree's rows to the host ([rows, V] float32: 14 MB for 8 requests
        with 8-token drafts, in every drafted step): there the plain-sampling token of every row is
        drawn on the device in one batched call and only those ids come back. The caller computes
        the logprobs of the emitted tokens, in one gather with the step's other tokens."""
        batched = self.batched_tree_draws
        rows_p = probs  # batched: [sum(1 + n), V], the trees' rows packed in `drafted` order
        drawn: list[int] = []
        if batched:
            rows_p = probs[[r for _i, tree, off in drafted for r in range(off, off + 1 + len(tree))]]
            us = [u for i, tree, _off in drafted
                  for u in self.verifier.row_uniforms(tree, seqs[i].seed, seqs[i].next_output_position)]
            drawn = self.verifier.draw_rows(rows_p, us)
        out: dict[int, tuple[list[int], list[int], list[int]]] = {}
        packed = 0
        for i, tree, off in drafted:
            n = 1 + len(tree)
            base = packed if batched else off
            out[i] = self.verifier.verify_sampling(
                tree, rows_p[base : base + n], seqs[i].seed, seqs[i].next_output_position,
                drawn=drawn[base : base + n] if batched else None)
            packed += n
        return out

    def _apply(self, seq: Sequence, tree: DraftTree | None, tokens: list[int], path: list[int],
               lps: list[float]) -> StepOutput:
        # Truncate at the call's limit and at the first stop token (it is included).
        k = min(len(tokens), seq.remaining)
        finish: FinishReason | None = None
        for j in range(k):
            if tokens[j] in seq.stop_ids:
                k = j + 1
                finish = FinishReason.STOP
                break
        tokens, lps = tokens[:k], lps[:k]
        accepted = min(len(path), k)
        n_draft = len(tree) if tree is not None else 0
        if tree is not None:
            # Emitted tokens but the last need KV: they are accepted draft nodes path[:k-1].
            if k > 1:
                self.runner.commit_accepted(seq, tree, path[: k - 1])
            depth = max(tree.depth)
            while len(self._proposed_pos) < depth:
                self._proposed_pos.append(0)
                self._accepted_pos.append(0)
            for d in range(depth):
                self._proposed_pos[d] += 1
            for d in range(accepted):
                self._accepted_pos[d] += 1
        seq.token_ids.extend(tokens)
        seq.num_generated += k
        seq.num_computed = len(seq) - 1
        self.blocks.on_computed(seq)
        if finish is None and seq.remaining <= 0:
            finish = FinishReason.LENGTH
        if finish is not None:
            seq.finish_reason = finish
            self.scheduler.finish(seq)
        return StepOutput(
            request_id=seq.request_id, token_ids=tokens, logprobs=lps, finished=finish is not None,
            finish_reason=finish, num_draft_tokens=n_draft, num_accepted=accepted,
        )

    # ---- KV export / import ---------------------------------------------------------------------
    def cached_prefix_tokens(self, token_ids: Seq[int]) -> int:
        return len(self.blocks.cached_pages(self.blocks.hashes(token_ids))) * self.blocks.page_size

    def export_kv(self, token_ids: Seq[int], start_page: int = 0) -> KVPages:
        if start_page < 0:
            raise ValueError(f"start_page: must be >= 0, got {start_page}")
        hashes = self.blocks.hashes(token_ids)
        pages = self.blocks.cached_pages(hashes)
        n = len(pages)
        first = min(start_page, n)
        # Tail first, so page 0 ends most recent: touched head first, page 0 became the chain's
        # least recent page and one eviction stranded the rest (release() orders them the same).
        for p in reversed(pages):
            self.blocks.touch(p)
        return KVPages(
            model_version=self._version,
            layout=self._layout,
            token_ids=tuple(int(t) for t in token_ids[: n * self.blocks.page_size]),
            page_hashes=tuple(hashes[first:n]),
            pages=tuple(self.runner.read_pages(pages[first:])),  # only the bytes that are sent
            first_page=first,
        )

    def import_kv(self, pages: KVPages) -> int:
        if pages.model_version != self._version:
            raise ValueError(f"model_version: pages are of {pages.model_version!r}, the engine runs {self._version!r}")
        for name in ("dtype", "page_size", "num_layers", "num_kv_heads", "head_dim", "layout"):
            if getattr(pages.layout, name) != getattr(self._layout, name):
                raise ValueError(
                    f"layout.{name}: {getattr(pages.layout, name)!r} != engine's {getattr(self._layout, name)!r}"
                )
        ps = self.blocks.page_size
        first = pages.first_page
        if first < 0:
            raise ValueError(f"first_page: must be >= 0, got {first}")
        if len(pages.token_ids) != pages.end_page * ps:
            raise ValueError(
                f"token_ids: {len(pages.token_ids)} tokens do not fill pages [0, {pages.end_page}) "
                f"(first_page {first} + {len(pages.page_hashes)} pages)"
            )
        if len(pages.pages) != len(pages.page_hashes):
            raise ValueError(f"pages: {len(pages.pages)} buffers for {len(pages.page_hashes)} hashes")
        self._check_ids(pages.token_ids, "token_ids")
        expect = chain_hashes(pages.token_ids, ps, self._version)
        for i, (h, e) in enumerate(zip(pages.page_hashes, expect[first:], strict=True)):
            if h != e:
                raise ValueError(f"page_hashes[{i}]: does not match the chained hash of the tokens")
        for i, buf in enumerate(pages.pages):
            if len(buf) != self._layout.page_bytes:
                raise ValueError(f"pages[{i}]: {len(buf)} bytes, expected {self._layout.page_bytes}")
        # A continuation (first_page > 0) extends a chain this engine holds: without the pages
        # before it the imported ones could never be reached (a cached prefix starts at page 0).
        held = self.blocks.cached_pages(expect[:first])
        if len(held) < first:
            raise ValueError(
                f"first_page: {first}, but only pages [0, {len(held)}) of the prefix are cached in this engine"
            )
        # Pinned while importing: inserting pages evicts cached ones, and evicting the chain's own
        # earlier pages would strand the rest.
        pinned = list(held)
        try:
            self.blocks.pin(held)
            for h, buf in zip(pages.page_hashes, pages.pages, strict=True):
                page = self.blocks.hash_to_page.get(h)
                if page is None:
                    page = self.blocks.insert_cached(h)
                    if page is None:
                        break  # cache full of pages in use: keep the prefix imported so far
                    try:
                        self.runner.write_page(page, buf)
                    except BaseException:
                        self.blocks.drop_cached(page)  # never leave a hash on a page without its KV
                        raise
                    self._imported_tokens += ps
                self.blocks.pin([page])
                pinned.append(page)
        finally:
            self.blocks.release(pinned)
        return self.cached_prefix_tokens(pages.token_ids)

    # ---- weights --------------------------------------------------------------------------------
    def load_weights(self, path: str | None, version: str) -> None:
        if not version:
            raise ValueError("version: must not be empty")
        if self.scheduler.has_unfinished():
            raise RuntimeError(
                f"load_weights: {len(self.scheduler.running)} running and {len(self.scheduler.waiting)} "
                "waiting requests; drain (or abort) them first"
            )
        src = Path(path) if path else self.model_dir
        new_cfg = ModelConfig.from_dir(src)
        # New weights for the same network: every setting the forward pass reads must match (the
        # model keeps the served ones; a checkpoint with another rope_theta or window would run
        # with the old values, silently). EOS/BOS ids stay the served model's.
        for name in _ARCHITECTURE_FIELDS:
            if getattr(new_cfg, name) != getattr(self.model_config, name):
                raise ValueError(f"path: {src / 'config.json'} describes another architecture: {name} "
                                 f"{getattr(new_cfg, name)!r}, served {getattr(self.model_config, name)!r}")
        try:
            state = load_state_dict(src)
        except (OSError, ValueError):
            raise
        except Exception as e:  # e.g. safetensors' own error for a corrupt file: a bad source, not a crash
            raise ValueError(f"path: {src}: unreadable weights ({type(e).__name__}: {e})") from e
        self.model.load(state)
        self.model_dir = src
        # Old pages are never reused: hashes include the version, and the cache is emptied.
        self.blocks.reset(version)
        self._version = version
        log.info("weights loaded", extra=kv(path=str(src), model_version=version))

    # ---- stats ----------------------------------------------------------------------------------
    def stats(self) -> EngineStats:
        busy = sum(dt for _, dt, _ in self._rate)
        toks = sum(n for _, _, n in self._rate)
        return EngineStats(
            total_pages=self.blocks.num_pages,
            free_pages=self.blocks.num_free,
            page_size=self.blocks.page_size,
            running=len(self.scheduler.running),
            waiting=len(self.scheduler.waiting),
            tokens_per_second=toks / busy if busy > 0 else 0.0,
            model_version=self._version,
            accepted_per_position=list(self._accepted_pos),
            proposed_per_position=list(self._proposed_pos),
            prefill_tokens=self._prefill_tokens,
            cached_tokens=self._cached_tokens,
            imported_tokens=self._imported_tokens,
            generated_tokens=self._generated,
            steps=self._steps,
            max_batch_size=self.config.max_batch_size,
            max_context=self.max_context,
        )

    # ---- convenience ----------------------------------------------------------------------------
    def generate(self, requests: Seq[GenerateRequest]) -> dict[str, StepOutput]:
        """Runs requests to completion (no drafts); per request all tokens/logprobs of the call."""
        for r in requests:
            self.add_request(r)
        acc: dict[str, StepOutput] = {r.request_id: StepOutput(r.request_id, [], []) for r in requests}
        while self.has_unfinished():
            for o in self.step():
                a = acc[o.request_id]
                a.token_ids.extend(o.token_ids)
                a.logprobs.extend(o.logprobs)
                a.finished, a.finish_reason = o.finished, o.finish_reason
        return acc
