"""The SGLang adapter keeps the attempts of one request id apart. After an abort, the old generate
task still queues what it had (tokens produced before the abort reached SGLang, then SGLang's
final "abort"); a retry of the same id on the same worker (a failed or deadline-aborted chunk
re-dispatched there: group affinity) must not receive them. Keyed by request id, the new attempt
got the old one's tokens (corrupted output) or its abort (a spurious failure). Found by review.

SGLang needs CUDA, so its tokenizer manager is a small stand-in here that streams as SGLang's does
(cumulative completion_tokens and output_token_logprobs, a finish_reason at the end), and the one
SGLang import the adapter makes is stubbed for the test's duration."""

from __future__ import annotations

import asyncio
import queue
import sys
import threading
import time
import types
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from services.worker.core import ChunkJob, DoneEvent, TokensEvent, Worker
from services.worker.engine import GenerateRequest, SamplingParams
from services.worker.engines.sglang import engine as sg

GREEDY = SamplingParams(temperature=0.0, ignore_eos=True)


class _GenerateReqInput:
    def __init__(self, **kw: Any) -> None:
        self.__dict__.update(kw)


@pytest.fixture(autouse=True)
def _sglang_io_struct(monkeypatch: pytest.MonkeyPatch) -> None:
    io_struct = types.ModuleType("sglang.srt.managers.io_struct")
    for name in ("GenerateReqInput", "PauseGenerationReqInput", "ContinueGenerationReqInput",
                 "UpdateWeightFromDiskReqInput"):
        setattr(io_struct, name, _GenerateReqInput)
    for name in ("sglang", "sglang.srt", "sglang.srt.managers"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    monkeypatch.setitem(sys.modules, "sglang.srt.managers.io_struct", io_struct)


class _TokenizerManager:
    """Streams one token per 20 ms; attempt 1 of a Seer request counts on from its last token,
    later ones emit 50, 51, ...; abort_request ends the stream with an "abort" output a moment
    later. Like SGLang's TokenizerManager (_init_req_state), it refuses an id it still holds: until
    that id's stream has ended, also after an abort."""

    def __init__(self, abort_reaches: bool = True) -> None:
        self.cut_after: int | None = None  # end streams after this many tokens, with no finish reason
        self.aborted: set[str] = set()
        self.attempts: dict[str, int] = {}
        self.held: set[str] = set()
        self.abort_reaches = abort_reaches
        self.params: dict[str, dict[str, Any]] = {}  # SGLang id -> the custom_params it came with
        self.requests: list[Any] = []  # every GenerateReqInput, in order
        self.loaded = ""

    async def generate_request(self, obj: Any, _request: Any) -> AsyncIterator[dict[str, Any]]:
        rid = obj.rid
        if rid in self.held:
            raise ValueError(f"Duplicate request ID detected: {rid}")
        self.held.add(rid)
        self.params[rid] = dict(obj.sampling_params.get("custom_params") or {})
        self.requests.append(obj)
        try:
            seer_id = (obj.sampling_params.get("custom_params") or {}).get("seer_request_id", rid)
            attempt = self.attempts[seer_id] = self.attempts.get(seer_id, 0) + 1
            last, entries = obj.input_ids[-1], []
            for n in range(1, obj.sampling_params["max_new_tokens"] + 1):
                await asyncio.sleep(0.02)
                if rid in self.aborted:
                    self.aborted.discard(rid)
                    await asyncio.sleep(0.02)
                    yield {"meta_info": {"completion_tokens": n - 1, "output_token_logprobs": entries,
                                         "finish_reason": {"type": "abort"}}}
                    return
                if n - 1 == self.cut_after:
                    return
                last = last + 1 if attempt == 1 else 49 + n
                entries = [*entries, (-0.1, last, None)]
                done = n == obj.sampling_params["max_new_tokens"]
                yield {"meta_info": {"completion_tokens": n, "output_token_logprobs": entries,
                                     "finish_reason": {"type": "length"} if done else None}}
        finally:
            self.held.discard(rid)

    def abort_request(self, rid: str) -> None:
        if self.abort_reaches:
            self.aborted.add(rid)

    async def pause_generation(self, _obj: Any) -> None:
        pass

    async def continue_generation(self, _obj: Any) -> None:
        pass

    async def update_weights_from_disk(self, obj: Any, _request: Any) -> tuple[bool, str]:
        self.loaded = obj.model_path
        return True, "ok"


@pytest.fixture
def engine() -> Iterator[sg.SGLangEngine]:
    """The adapter around the stand-in (its constructor would start SGLang)."""
    e = sg.SGLangEngine.__new__(sg.SGLangEngine)
    e._mc = SimpleNamespace(vocab_size=100, max_position_embeddings=512, eos_token_ids=(99,),  # type: ignore[assignment]
                            num_layers=1, num_kv_heads=1, head_dim=2)
    e._model_dir = Path("/nonexistent")  # type: ignore[attr-defined]
    e._version, e._family = "m@v0", "m"
    e._page_size, e._dtype, e._max_batch, e._total_pages = 4, "float32", 8, 64
    e._t0 = time.monotonic()
    e._out = queue.SimpleQueue()
    e._live = {}
    e._lock = threading.Lock()
    e._stats = {"prefill": 0, "cached": 0, "generated": 0, "steps": 0}
    e._loop = asyncio.new_event_loop()
    e._thread = threading.Thread(target=e._loop.run_forever, daemon=True)
    e._thread.start()
    e._sgl = SimpleNamespace(tokenizer_manager=_TokenizerManager())
    yield e
    e._loop.call_soon_threadsafe(e._loop.stop)
    e._thread.join(5)


def test_a_retried_id_gets_only_its_own_tokens(engine: sg.SGLangEngine) -> None:
    engine._sgl.tokenizer_manager.abort_reaches = False  # the old stream's tokens all get queued
    req = GenerateRequest(request_id="r", prompt_token_ids=(1, 2, 3), max_new_tokens=3, sampling=GREEDY)
    engine.add_request(req)
    time.sleep(0.15)  # attempt 1 queued 4, 5, 6; nobody stepped
    assert engine.abort("r")
    engine.add_request(req)  # attempt 2 of the same id
    deadline, toks = time.monotonic() + 5, []
    while time.monotonic() < deadline and len(toks) < 3:
        toks += [t for o in engine.step() for t in o.token_ids]
    assert toks == [50, 51, 52]


def test_a_chunk_retried_on_the_same_worker_is_not_failed_by_the_old_abort(engine: sg.SGLangEngine) -> None:
    w = Worker(engine, speculation=False).start()
    job = ChunkJob(request_id="b/0/0", prompt_token_ids=(1, 2, 3), max_new_tokens=40, max_tokens=80,
                   sampling=GREEDY, policy_version=0, group_id="b/0")
    try:
        h = w.submit(job)
        assert isinstance(next(h.events()), TokensEvent)
        assert w.abort("b/0/0")  # the scheduler's abort (a chunk deadline, say)
        time.sleep(0.3)  # the worker is idle: nobody steps, SGLang's "abort" waits in the queue
        events = list(w.submit(job).events())
        assert isinstance(events[-1], DoneEvent), events[-1]
        assert [t for e in events if isinstance(e, TokensEvent) for t in e.token_ids] == list(range(50, 90))
    finally:
        w.close()


def test_a_retry_runs_while_sglang_still_holds_the_aborted_attempt(engine: sg.SGLangEngine) -> None:
    """SGLang holds an aborted id until its scheduler's abort output comes back and refuses it
    meanwhile; a retry of the request right after the abort (the worker retries a failed chunk on
    the same engine at once) must still run. With the request id as SGLang's id it came back
    ABORTED at once (found by review, session 17: checked against SGLang's TokenizerManager)."""
    req = GenerateRequest(request_id="r", prompt_token_ids=(1, 2, 3), max_new_tokens=3, sampling=GREEDY)
    engine.add_request(req)
    time.sleep(0.05)
    assert engine.abort("r")
    engine.add_request(req)  # at once: the first attempt's stream has not ended yet
    deadline, outs = time.monotonic() + 5, []
    while time.monotonic() < deadline and not any(o.finished for o in outs):
        outs += engine.step()
    assert [t for o in outs for t in o.token_ids] == [50, 51, 52]
    assert outs[-1].finish_reason is not None and outs[-1].finish_reason.name == "LENGTH"


def test_the_worker_tells_the_plugin_which_chunk_is_its_groups_probe(engine: sg.SGLangEngine) -> None:
    """The SEER plugin plans draft lengths inside SGLang and favours probes (Seer section 4.2), as
    the worker's own planner does; it was always told False (session 17's note)."""
    w = Worker(engine, speculation=False).start()
    try:
        for rid, probe in (("b/0/0", True), ("b/0/1", False)):
            job = ChunkJob(request_id=rid, prompt_token_ids=(1, 2, 3), max_new_tokens=2, max_tokens=2,
                           sampling=GREEDY, policy_version=0, group_id="b/0", group_size=2, prompt_key="k",
                           is_probe=probe)
            assert isinstance(list(w.submit(job).events())[-1], DoneEvent)
        params = {p["seer_request_id"]: p for p in engine._sgl.tokenizer_manager.params.values()}
        assert {rid: p["seer_is_probe"] for rid, p in params.items()} == {"b/0/0": True, "b/0/1": False}
        assert {p["seer_prompt_key"] for p in params.values()} == {"k"}
    finally:
        w.close()


def test_weights_from_another_source_get_their_own_pages(engine: sg.SGLangEngine, tmp_path: Path) -> None:
    """HiCache salts page keys with the request's extra key and the L3 backend files pages under
    the version file's namespace. Both carried only the policy version after a LoadWeights (the
    family stayed the starting weights'), so weights reloaded as the same version from another
    checkpoint were served the old weights' pages (found by review, session 18)."""
    from services.worker.core import version_name
    from services.worker.engines.sglang import pages

    start = version_name(3, "m", "aaa")
    engine._version, engine._family = start, sg._family_of(start)
    engine._version_file = pages.VersionFile(str(tmp_path / "v"))
    engine._version_file.write(3, engine._family)

    def extra_key_of_a_request(rid: str) -> str:
        engine.add_request(GenerateRequest(request_id=rid, prompt_token_ids=(1, 2), max_new_tokens=1,
                                           sampling=GREEDY))
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and not any(o.finished for o in engine.step()):
            pass
        seen = [o for o in engine._sgl.tokenizer_manager.requests if o.sampling_params["custom_params"][
            "seer_request_id"] == rid]
        return str(seen[-1].extra_key)

    before = extra_key_of_a_request("a")
    engine.load_weights(str(tmp_path), version_name(3, "m", "bbb"))  # the same version, other weights
    after = extra_key_of_a_request("b")
    assert before == pages.extra_key("m-aaa", 3) and after == pages.extra_key("m-bbb", 3)
    version, family = engine._version_file.read_both(0, "m-aaa")
    assert (version, family) == (3, "m-bbb")
    assert pages.namespace(family, version) != pages.namespace("m-aaa", 3)


def test_a_stream_that_ends_without_a_finish_reason_ends_the_request(engine: sg.SGLangEngine) -> None:
    engine._sgl.tokenizer_manager.cut_after = 2
    engine.add_request(GenerateRequest(request_id="r", prompt_token_ids=(1, 2, 3), max_new_tokens=5, sampling=GREEDY))
    deadline, outs = time.monotonic() + 5, []
    while time.monotonic() < deadline and not any(o.finished for o in outs):
        outs += engine.step()
    assert [t for o in outs for t in o.token_ids] == [4, 5]
    assert outs[-1].finish_reason is not None and outs[-1].finish_reason.name == "ABORTED"
    assert not engine.has_unfinished()
