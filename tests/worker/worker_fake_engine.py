"""A tiny deterministic Engine for unit tests of the worker's glue (finish reasons, draft plumbing,
abort, drain). Its "model" continues any sequence with (last token + 1) % vocab and stops at EOS;
drafts are verified by exact match, so acceptance is checkable. The real-engine tests live next to
it (test_worker_engine.py)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field

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
from services.worker.ports import PutResult


@dataclass
class _Seq:
    req: GenerateRequest
    tokens: list[int]
    produced: int = 0
    out: list[int] = field(default_factory=list)


class FakeEngine(Engine):
    def __init__(self, vocab: int = 100, eos: int = 99, max_context: int = 512, version: str = "v0") -> None:
        self._vocab = vocab
        self._eos = eos
        self._max_context = max_context
        self._version = version
        self._seqs: dict[str, _Seq] = {}
        self._cache: set[bytes] = set()
        self.steps = 0
        self.step_gate: threading.Event | None = None  # tests hold steps with it
        self.step_delay = 0.0  # seconds per step (a slow engine, without blocking forever)
        self.loaded: list[tuple[str | None, str]] = []
        self.seen_drafts: list[dict[str, Draft]] = []
        self.exports: list[tuple[int, int]] = []  # (first_page, end_page) of every export_kv
        self.fail_steps = 0  # the next this many steps raise RuntimeError (before changing anything)

    @property
    def vocab_size(self) -> int:
        return self._vocab

    @property
    def max_context(self) -> int:
        return self._max_context

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        return (self._eos,)

    @property
    def model_version(self) -> str:
        return self._version

    @property
    def kv_layout(self) -> KVLayout:
        return KVLayout("float32", 4, 1, 1, 2)

    @property
    def broken(self) -> str | None:
        return None

    def add_request(self, req: GenerateRequest) -> None:
        req.sampling.validate(self._vocab)
        if req.request_id in self._seqs:
            raise ValueError(f"request_id: {req.request_id} is already running")
        self._seqs[req.request_id] = _Seq(req, list(req.prompt_token_ids + req.output_token_ids))

    def _next(self, last: int) -> int:
        return (last + 1) % self._vocab

    def step(self, drafts: Mapping[str, Draft] | None = None) -> list[StepOutput]:
        if self.step_gate is not None:
            self.step_gate.wait(5)
        if self.step_delay:
            time.sleep(self.step_delay)
        if self.fail_steps > 0:
            self.fail_steps -= 1
            raise RuntimeError("injected step failure")
        drafts = dict(drafts or {})
        # Every draft checked before anything changes: Engine.step's contract is that a refused
        # step (ValueError) leaves every request as it was.
        for rid, checked in drafts.items():
            if rid in self._seqs:
                checked.validate(self._vocab)
        self.steps += 1
        self.seen_drafts.append(drafts)
        outs: list[StepOutput] = []
        for rid, s in list(self._seqs.items()):
            d = drafts.get(rid)
            toks: list[int] = []
            accepted = 0
            want = self._next(s.tokens[-1])
            if d is not None:
                # Chains only: accept while the draft matches the deterministic continuation.
                for t in d.tokens:
                    if t != want or s.produced + len(toks) + 1 >= s.req.max_new_tokens or want == self._eos:
                        break
                    toks.append(t)
                    accepted += 1
                    want = self._next(t)
            toks.append(want)  # the bonus token
            finished, reason = False, None
            for i, t in enumerate(toks):
                if t == self._eos and not s.req.sampling.ignore_eos:
                    toks, finished, reason = toks[: i + 1], True, FinishReason.STOP
                    break
            s.tokens += toks
            s.produced += len(toks)
            if not finished and s.produced >= s.req.max_new_tokens:
                finished, reason = True, FinishReason.LENGTH
            outs.append(StepOutput(rid, toks, [-0.5] * len(toks), finished, reason,
                                   num_draft_tokens=len(d.tokens) if d else 0, num_accepted=accepted))
            if finished:
                self._cache.update(chain_hashes(s.tokens[:-1], 4, self._version))
                del self._seqs[rid]
        return outs

    def abort(self, request_id: str) -> bool:
        return self._seqs.pop(request_id, None) is not None

    def has_unfinished(self) -> bool:
        return bool(self._seqs)

    def request_tokens(self, request_id: str) -> tuple[int, ...]:
        return tuple(self._seqs[request_id].tokens)

    def export_kv(self, token_ids: Sequence[int], start_page: int = 0) -> KVPages:
        hashes = chain_hashes(token_ids, 4, self._version)
        n = 0
        while n < len(hashes) and hashes[n] in self._cache:
            n += 1
        first = min(start_page, n)
        layout = self.kv_layout
        self.exports.append((first, n))
        return KVPages(self._version, layout, tuple(token_ids[: 4 * n]), tuple(hashes[first:n]),
                       tuple(bytes(layout.page_bytes) for _ in range(n - first)), first_page=first)

    def import_kv(self, pages: KVPages) -> int:
        if pages.model_version != self._version:
            raise ValueError("model_version: mismatch")
        before = chain_hashes(pages.token_ids, 4, self._version)[: pages.first_page]
        if not all(h in self._cache for h in before):
            raise ValueError(f"first_page: {pages.first_page}, but the pages before it are not cached")
        self._cache.update(pages.page_hashes)
        return len(pages.token_ids)

    def cached_prefix_tokens(self, token_ids: Sequence[int]) -> int:
        n = 0
        for h in chain_hashes(token_ids, 4, self._version):
            if h not in self._cache:
                break
            n += 1
        return 4 * n

    def load_weights(self, path: str | None, version: str) -> None:
        self.loaded.append((path, version))
        self._version = version

    def stats(self) -> EngineStats:
        return EngineStats(total_pages=64, free_pages=64, page_size=4, running=len(self._seqs), waiting=0,
                           tokens_per_second=0.0, model_version=self._version, max_batch_size=8,
                           max_context=self._max_context)


class FakePool:
    """In-memory KV pool for glue tests (the KVClient surface the worker core uses): stores what it
    is sent and returns a PutResult; `fail_next` makes the next offload raise, `drop_next` drop it
    (the client's queue was full), `partial_next = k` store only its first k pages (a replica that
    holds the rest is down)."""

    def __init__(self) -> None:
        self.stored: dict[bytes, bytes] = {}
        self.offloaded: list[tuple[KVPages, str]] = []
        self.sent: list[tuple[str, int, int]] = []  # (request id, first page, end page)
        self.released: list[tuple[str, str]] = []
        self.fail_next = self.drop_next = False
        self.partial_next: int | None = None

    def offload_async(self, pages: KVPages, request_id: str) -> Future[PutResult]:
        f: Future[PutResult] = Future()
        if self.fail_next:
            self.fail_next = False
            f.set_exception(RuntimeError("replica down"))
            return f
        if self.drop_next:
            self.drop_next = False
            f.set_result(PutResult(first_unstored=0, dropped=True))
            return f
        self.offloaded.append((pages, request_id))
        self.sent.append((request_id, pages.first_page, pages.end_page))
        k, self.partial_next = (len(pages.pages) if self.partial_next is None else self.partial_next), None
        hashes, data = pages.page_hashes[:k], pages.pages[:k]
        new = sum(h not in self.stored for h in hashes)
        # A copy of each page, as a store holds: the engine's exported views may be reused.
        self.stored.update((h, bytes(page)) for h, page in zip(hashes, data, strict=True))
        f.set_result(PutResult(stored=new, claimed=k - new, first_unstored=k if k < len(pages.pages) else None))
        return f

    def fetch_prefix(self, token_ids: Sequence[int], model_version: str, layout: KVLayout, *,
                     min_tokens: int = 0, cancelled: Callable[[], bool] | None = None) -> KVPages | None:
        hs = chain_hashes(token_ids, layout.page_size, model_version)
        n = 0
        while n < len(hs) and hs[n] in self.stored:
            n += 1
        if n * layout.page_size <= min_tokens:
            return None
        return KVPages(model_version, layout, tuple(token_ids[: n * layout.page_size]), tuple(hs[:n]),
                       tuple(self.stored[h] for h in hs[:n]))

    def release(self, model_version: str, request_id: str) -> None:
        self.released.append((model_version, request_id))

    def close(self) -> None:
        pass
