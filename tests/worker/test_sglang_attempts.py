"""The SGLang adapter over a stand-in for SGLang 0.5.23 (the pinned release). It keeps the
attempts of one request id apart: after an abort, the old generate task still queues what it had
(tokens produced before the abort reached SGLang, then SGLang's final "abort"); a retry of the same
id on the same worker (a failed or deadline-aborted chunk re-dispatched there: group affinity) must
not receive them. Keyed by request id, the new attempt got the old one's tokens (corrupted output)
or its abort (a spurious failure). Found by review.

SGLang needs CUDA, so its Engine and tokenizer manager are small stand-ins here, built from the
pinned release's source (tests/worker/test_sglang_api.py checks the same names against its wheel):
- the request objects take only their real fields (io_struct.py:177 GenerateReqInput; 1927
  PauseGenerationReqInput, mode "abort" | "retract" | "in_place"; 1949 ContinueGenerationReqInput;
  1970 UpdateWeightFromDiskReqInput), so a misspelt or removed keyword fails here;
- TokenizerManager.pause_generation(obj) / continue_generation(obj) / update_weights_from_disk(obj,
  request) (tokenizer_manager.py:2267-2290); a duplicate live rid is refused (3836);
- a streamed output is {"output_ids": cumulative ids, "meta_info": ...} (tokenizer_manager.py:
  2674-2708, skip_tokenizer_init); output_token_logprobs only with return_logprob, one entry per
  token (under speculation too, batch_result_processor.py:1161-1170) unless the stand-in is told
  to leave them out; spec_verify_ct / spec_num_correct_drafts / spec_num_proposed_drafts only in
  the final output (tokenizer_manager.py:2742-2756);
- logprob_start_len: -1 = output logprobs only; beyond the input the scheduler aborts the request
  (scheduler.py:3260-3280);
- the scheduler aborts an input of max_req_input_len tokens or more (managers/utils.py:272) and
  clips max_new_tokens to max_req_len - input - 1 (scheduler.py:2710-2716), max_req_len =
  max_req_input_len + 5 (tp_worker.py:568-572); max_req_input_len is in its init info (:1946);
- an abort reaches the scheduler a moment later and hits every request whose rid starts with the
  aborted one (scheduler.py:5688, 5798); the scheduler holds a request a moment after its stream
  ended (an aborted running request runs one more decode pass, scheduler.py:5798-5812);
- update_weights_from_disk returns (success, message, num_paused_requests)
  (tokenizer_manager.py:2288-2320); with flush_cache (the default) a scheduler still holding a
  request refuses the flush AFTER loading: (False, "Weights were updated, but ...")
  (weight_updater.py:120-160); flush_cache(timeout_s) waits for the scheduler to be idle up to
  timeout_s (flush_wrapper.py:22-60, tokenizer_control_mixin.py:325).
The adapter itself is built through its real constructor (sglang.Engine(**server_args) on its loop
thread), with the stand-in in sys.modules["sglang"] for the test's duration."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
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
from services.worker.engine import FinishReason, GenerateRequest, SamplingParams, StepOutput
from services.worker.engines.sglang import engine as sg
from services.worker.engines.sglang import plugin

GREEDY = SamplingParams(temperature=0.0, ignore_eos=True)


@dataclasses.dataclass(kw_only=True)
class GenerateReqInput:
    """The fields of SGLang's GenerateReqInput the adapter may set (a subset: io_struct.py:177)."""

    rid: str | None = None
    input_ids: list[int] | None = None
    sampling_params: dict[str, Any] | None = None
    return_logprob: bool | None = None
    logprob_start_len: int | None = None
    stream: bool = False
    extra_key: str | None = None


@dataclasses.dataclass(kw_only=True)
class PauseGenerationReqInput:
    mode: str = "abort"

    def __post_init__(self) -> None:
        assert self.mode in ("abort", "retract", "in_place"), self.mode


@dataclasses.dataclass(kw_only=True)
class ContinueGenerationReqInput:
    torch_empty_cache: bool = True


@dataclasses.dataclass(kw_only=True)
class UpdateWeightFromDiskReqInput:
    model_path: str
    load_format: str | None = None
    abort_all_requests: bool = False
    weight_version: str | None = None
    torch_empty_cache: bool = False
    keep_pause: bool = False
    flush_cache: bool = True  # io_struct.py:1990


@dataclasses.dataclass(kw_only=True)
class FlushCacheReqOutput:
    success: bool
    message: str = ""


NOT_FLUSHED = ("Weights were updated, but the cache was not flushed because requests are still running or "
               "queued. Retract or finish them, then call /flush_cache.")


class _TokenizerManager:
    """Streams one token per 20 ms (spec_tokens per output when speculating); attempt 1 of a Seer
    request counts on from its last token, later ones emit 50, 51, ...; abort_request ends the
    stream with an "abort" output a moment later. Like SGLang's TokenizerManager, it refuses an id
    it still holds: until that id's stream has ended, also after an abort."""

    def __init__(self, abort_reaches: bool = True, max_req_input_len: int = 1 << 20) -> None:
        self.max_req_input_len = max_req_input_len
        self.scheduler: set[str] = set()  # rids SGLang's scheduler still holds
        self.linger = 0.05  # how long it holds one after its stream ended
        self.abort_delay = 0.03  # an AbortReq's way to the scheduler
        self.flushes: list[bool] = []  # flush_cache results, in order
        self.cut_after: int | None = None  # end streams after this many tokens, with no finish reason
        self.aborted: set[str] = set()
        self.attempts: dict[str, int] = {}
        self.held: set[str] = set()
        self.cancelled: set[str] = set()  # rids whose generate_request was cancelled while running
        self.yielded: dict[str, int] = {}  # rid -> outputs streamed
        self.abort_reaches = abort_reaches
        self.params: dict[str, dict[str, Any]] = {}  # SGLang id -> the custom_params it came with
        self.requests: list[GenerateReqInput] = []  # every GenerateReqInput, in order
        self.loaded = ""
        self.calls: list[Any] = []  # pause / continue objects, in order
        self.spec_tokens = 1  # tokens per streamed output (> 1: accepted drafts)
        self.real_drafts = 2  # draft tokens the plugin proposed per verify step (of 4 block slots)
        self.waiting = 0  # SGLang's waiting queue, as its load snapshot says
        self.load_reads = 0  # load_snapshot_reader.read_all calls
        self.read_threads: set[int] = set()  # the threads they ran on
        self.load_snapshot_reader = self  # TokenizerManager's reader (tokenizer_manager.py:693)
        self.loads_published = True  # False: no snapshot yet (get_loads answers [])
        self.logprobs = True  # False: a release that gives no per-token logprobs under speculation

    async def generate_request(self, obj: GenerateReqInput, request: Any = None) -> AsyncIterator[dict[str, Any]]:
        assert isinstance(obj, GenerateReqInput) and obj.input_ids and obj.sampling_params is not None
        rid = str(obj.rid)
        if rid in self.held:
            raise ValueError(f"Duplicate request ID detected: {rid}")
        self.held.add(rid)
        self.scheduler.add(rid)
        self.params[rid] = dict(obj.sampling_params.get("custom_params") or {})
        self.requests.append(obj)
        try:
            start = -1 if obj.logprob_start_len is None else obj.logprob_start_len
            if start > len(obj.input_ids) or len(obj.input_ids) >= self.max_req_input_len:
                # scheduler.py:3275, managers/utils.py:272: aborted before it runs
                yield {"output_ids": [], "meta_info": {"completion_tokens": 0, "finish_reason": {"type": "abort"}}}
                return
            seer_id = (obj.sampling_params.get("custom_params") or {}).get("seer_request_id", rid)
            attempt = self.attempts[seer_id] = self.attempts.get(seer_id, 0) + 1
            last, verify = obj.input_ids[-1], 0
            ids: list[int] = []
            entries: list[Any] = []  # (logprob, token id, text), as output_token_logprobs
            drafts: list[Any] = []  # what the SEER plugin files per verify step (plugin.record_step)
            # Clipped without a word (scheduler.py:2710-2716); max_req_len = max_req_input_len + 5.
            limit = max(0, min(obj.sampling_params["max_new_tokens"],
                               self.max_req_input_len + 5 - len(obj.input_ids) - 1))
            while len(ids) < limit:
                await asyncio.sleep(0.02)
                if rid in self.aborted:
                    self.aborted.discard(rid)
                    await asyncio.sleep(0.02)
                    yield {"output_ids": ids, "meta_info": self._meta(obj, ids, entries, {"type": "abort"}, 0)}
                    return
                if len(ids) == self.cut_after:
                    return
                verify += 1
                step = min(self.spec_tokens, limit - len(ids))
                # The plugin's real draft (self.real_drafts tokens, the rest of the 4-slot block
                # padding), of which the step's tokens but the bonus one were accepted.
                drafts += [(self.real_drafts, step - 1)] + [None] * (step - 1)
                for _ in range(step):
                    last = last + 1 if attempt == 1 else 50 + len(ids)
                    ids = [*ids, last]
                    if self.logprobs or self.spec_tokens == 1:
                        entries = [*entries, (-0.1, last, None)]
                done = len(ids) == limit
                self.yielded[rid] = self.yielded.get(rid, 0) + 1
                yield {"output_ids": ids,
                       "meta_info": self._meta(obj, ids, entries, {"type": "length"} if done else None, verify,
                                               drafts)}
        except asyncio.CancelledError:
            # SGLang aborts a dispatched request whose handler is cancelled
            # (_release_req_states_on_failure, tokenizer_manager.py:958-967).
            self.cancelled.add(rid)
            raise
        finally:
            self.held.discard(rid)
            asyncio.get_running_loop().call_later(self.linger, self.scheduler.discard, rid)

    def _meta(self, obj: GenerateReqInput, ids: list[int], entries: list[Any], finish: Any,
              verify: int, drafts: list[Any] | None = None) -> dict[str, Any]:
        meta: dict[str, Any] = {"completion_tokens": len(ids), "finish_reason": finish}
        if obj.return_logprob:
            meta["output_token_logprobs"] = entries
        if self.spec_tokens > 1 and drafts:
            # customized_info accumulated into meta_info on every output (tokenizer_manager.py:2818).
            meta[plugin.DRAFT_INFO_KEY] = list(drafts)
        if finish is not None and self.spec_tokens > 1:
            # SGLang's own counts: proposed is its block capacity (4 slots), padding included.
            meta.update(spec_verify_ct=verify, spec_num_correct_drafts=len(ids) - verify,
                        spec_num_proposed_drafts=verify * 4)
        return meta

    def abort_request(self, rid: str = "", abort_all: bool = False) -> None:
        # SGLang returns without effect for an rid it does not hold yet (tokenizer_manager.py:
        # 2246-2253): the rid is registered only when generate_request first runs (:926).
        if self.abort_reaches and rid in self.held:
            asyncio.get_running_loop().call_later(self.abort_delay, self._scheduler_abort, rid)

    def _scheduler_abort(self, rid: str) -> None:
        # By prefix, as SGLang's scheduler matches (req.rid.startswith(recv_req.rid)).
        self.aborted |= {h for h in self.held if h.startswith(rid)}

    def read_all(self) -> list[Any]:
        # load_snapshot.py:605-607 (what get_loads returns, tokenizer_control_mixin.py:1027): one
        # LoadSnapshot per DP rank, [] before any is published; a blocking flock inside.
        self.load_reads += 1
        self.read_threads.add(threading.get_ident())
        return [SimpleNamespace(num_running_reqs=0, num_waiting_reqs=self.waiting)] if self.loads_published else []

    async def pause_generation(self, obj: PauseGenerationReqInput) -> None:
        assert isinstance(obj, PauseGenerationReqInput)
        self.calls.append(obj)

    async def continue_generation(self, obj: ContinueGenerationReqInput) -> None:
        assert isinstance(obj, ContinueGenerationReqInput)
        self.calls.append(obj)

    async def update_weights_from_disk(self, obj: UpdateWeightFromDiskReqInput,
                                       request: Any = None) -> tuple[bool, str, int]:
        assert isinstance(obj, UpdateWeightFromDiskReqInput)
        self.calls.append(obj)
        self.loaded = obj.model_path  # the weights are in before the flush is tried
        if obj.flush_cache and self.scheduler:
            return False, NOT_FLUSHED, 0
        return True, "Succeeded to update model weights.", 0

    async def flush_cache(self, timeout_s: float | None = None) -> FlushCacheReqOutput:
        deadline = time.monotonic() + float(timeout_s or 0.0)
        while self.scheduler and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        out = FlushCacheReqOutput(success=not self.scheduler)
        self.calls.append(out)
        self.flushes.append(out.success)
        return out


class _SGLangEngine:
    """sglang.Engine(**kwargs): keeps its server args, a tokenizer manager and the scheduler's init
    info where 0.5.23 has it (entrypoints/engine.py:345)."""

    max_req_input_len = 1 << 20  # a test lowers it: SGLang's limit from its pool and context

    def __init__(self, **kwargs: Any) -> None:
        self.kwargs = kwargs
        self.thread = threading.current_thread()
        self.tokenizer_manager = _TokenizerManager(max_req_input_len=self.max_req_input_len)
        self._scheduler_init_result = SimpleNamespace(scheduler_infos=[
            {"max_total_num_tokens": 256, "max_req_input_len": self.max_req_input_len}])
        self.shut = False

    def shutdown(self) -> None:
        self.shut = True


@pytest.fixture
def model_dir(tmp_path: Path) -> Path:
    d = tmp_path / "model"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({
        "vocab_size": 100, "hidden_size": 4, "intermediate_size": 8, "num_hidden_layers": 1,
        "num_attention_heads": 2, "num_key_value_heads": 1, "max_position_embeddings": 512, "eos_token_id": 99}))
    return d


@pytest.fixture(autouse=True)
def _sglang(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    io_struct = types.ModuleType("sglang.srt.managers.io_struct")
    for c in (GenerateReqInput, PauseGenerationReqInput, ContinueGenerationReqInput, UpdateWeightFromDiskReqInput,
              FlushCacheReqOutput):
        setattr(io_struct, c.__name__, c)
    root = types.ModuleType("sglang")
    root.Engine = _SGLangEngine  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "sglang", root)
    for name in ("sglang.srt", "sglang.srt.managers"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    monkeypatch.setitem(sys.modules, "sglang.srt.managers.io_struct", io_struct)
    env = dict(os.environ)
    yield
    os.environ.clear()  # the adapter sets the plugin's variables for SGLang's processes
    os.environ.update(env)


def make_engine(model_dir: Path, tmp_path: Path, **server_args: Any) -> sg.SGLangEngine:
    args = {"model_path": str(model_dir), "page_size": 4, "dtype": "float32", "max_running_requests": 8,
            **server_args}
    return sg.SGLangEngine(args, model_dir=model_dir, model_version="m@v0", version_file=str(tmp_path / "version"))


@pytest.fixture
def engine(model_dir: Path, tmp_path: Path) -> Iterator[sg.SGLangEngine]:
    e = make_engine(model_dir, tmp_path)
    yield e
    e.shutdown()


def run(engine: sg.SGLangEngine, req: GenerateRequest) -> list[Any]:
    engine.add_request(req)
    deadline = time.monotonic() + 5
    outs: list[StepOutput] = []
    while time.monotonic() < deadline and not any(o.finished for o in outs):
        outs += engine.step()
    return outs


def test_a_retried_id_gets_only_its_own_tokens(engine: sg.SGLangEngine) -> None:
    engine._sgl.tokenizer_manager.abort_reaches = False  # the old stream's tokens all get queued
    req = GenerateRequest(request_id="r", prompt_token_ids=(1, 2, 3), max_new_tokens=3, sampling=GREEDY)
    engine.add_request(req)
    time.sleep(0.15)  # attempt 1 queued 4, 5, 6; nobody stepped
    assert engine.abort("r")
    engine.add_request(req)  # attempt 2 of the same id
    deadline = time.monotonic() + 5
    toks: list[int] = []
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
    deadline = time.monotonic() + 5
    outs: list[StepOutput] = []
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
    tm = engine._sgl.tokenizer_manager
    assert [type(c).__name__ for c in tm.calls] == ["PauseGenerationReqInput", "UpdateWeightFromDiskReqInput",
                                                    "FlushCacheReqOutput", "ContinueGenerationReqInput"]
    after = extra_key_of_a_request("b")
    assert before == pages.extra_key("m-aaa", 3) and after == pages.extra_key("m-bbb", 3)
    version, family = engine._version_file.read_both(0, "m-aaa")
    assert (version, family) == (3, "m-bbb")
    assert pages.namespace(family, version) != pages.namespace("m-aaa", 3)


def test_a_stream_that_ends_without_a_finish_reason_ends_the_request(engine: sg.SGLangEngine) -> None:
    engine._sgl.tokenizer_manager.cut_after = 2
    engine.add_request(GenerateRequest(request_id="r", prompt_token_ids=(1, 2, 3), max_new_tokens=5, sampling=GREEDY))
    deadline = time.monotonic() + 5
    outs: list[StepOutput] = []
    while time.monotonic() < deadline and not any(o.finished for o in outs):
        outs += engine.step()
    assert [t for o in outs for t in o.token_ids] == [4, 5]
    assert outs[-1].finish_reason is not None and outs[-1].finish_reason.name == "ABORTED"
    assert not engine.has_unfinished()


def test_requests_ask_for_output_logprobs_the_way_sglang_takes_them(engine: sg.SGLangEngine) -> None:
    """C3: logprob_start_len was len(prefix): at the input's length, which SGLang 0.5.4's scheduler
    aborted (every chunk came back ABORTED) and 0.5.23 takes only because it compares with '>'.
    -1 is SGLang's own spelling of "output tokens only" (scheduler.py:3260-3264)."""
    outs = run(engine, GenerateRequest(request_id="r", prompt_token_ids=(1, 2, 3), output_token_ids=(4,),
                                       max_new_tokens=2, sampling=GREEDY))
    sent = engine._sgl.tokenizer_manager.requests[-1]
    assert sent.return_logprob is True and sent.logprob_start_len == -1
    assert sent.input_ids == [1, 2, 3, 4] and sent.stream is True
    assert [t for o in outs for t in o.token_ids] == [5, 6] and outs[-1].finish_reason == FinishReason.LENGTH
    assert engine.stats().total_pages == 256 // 4  # the scheduler's init info, where 0.5.23 keeps it


def test_speculative_outputs_deliver_every_token_with_its_logprob(engine: sg.SGLangEngine) -> None:
    """H2: under speculation an output carries several tokens; they come from output_ids, each with
    its logprob, and the draft counts come with the final output."""
    engine._sgl.tokenizer_manager.spec_tokens = 3
    outs = run(engine, GenerateRequest(request_id="r", prompt_token_ids=(1, 2, 3), max_new_tokens=7, sampling=GREEDY))
    assert [t for o in outs for t in o.token_ids] == [4, 5, 6, 7, 8, 9, 10]
    assert [lp for o in outs for lp in o.logprobs] == [-0.1] * 7
    assert outs[-1].finish_reason == FinishReason.LENGTH
    # The plugin's real drafts (2 per verify step), not SGLang's block capacity (3 x 4, padding
    # included: spec_num_proposed_drafts, what HEAD reported).
    assert sum(o.num_accepted for o in outs) == 7 - 3 and sum(o.num_draft_tokens for o in outs) == 3 * 2


def test_tokens_without_logprobs_are_refused_not_truncated(engine: sg.SGLangEngine) -> None:
    """H2: SGLang 0.5.4 gave no per-token logprobs under speculation and the adapter took its tokens
    from those logprob entries: responses came back short or empty, and finished as if complete.
    A token without its logprob (RL trains on them) now ends the attempt ABORTED."""
    tm = engine._sgl.tokenizer_manager
    tm.spec_tokens, tm.logprobs = 3, False
    outs = run(engine, GenerateRequest(request_id="r", prompt_token_ids=(1, 2, 3), max_new_tokens=7, sampling=GREEDY))
    assert outs[-1].finish_reason == FinishReason.ABORTED
    assert all(len(o.token_ids) == len(o.logprobs) for o in outs)


@pytest.mark.parametrize("speculation", [True, False], ids=["speculation", "no-speculation"])
def test_the_seer_algorithm_is_registered_only_with_speculation(
        model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, speculation: bool) -> None:
    """C1: registering imported SGLang's speculative registry on every engine start (with 0.5.4 an
    ImportError: no engine at all) and in this process only (the scheduler, a spawned subprocess,
    never saw it). The entry point now registers in SGLang's processes when the environment says
    so, and the adapter registers here only when its server args name SEER. C2: sglang.Engine is
    built on the adapter's loop thread (0.5.23 installs signal handlers only on the main thread)."""
    registered: list[bool] = []
    monkeypatch.setattr(plugin, "register", lambda: registered.append(True))
    args = plugin.ngram_server_args(4, 1) | {"speculative_algorithm": plugin.ALGORITHM} if speculation else {}
    e = make_engine(model_dir, tmp_path, **args)
    try:
        assert registered == ([True] if speculation else [])
        assert os.environ[plugin.ENV_SPECULATION] == ("1" if speculation else "0")
        assert e._sgl.thread.name == "sglang-loop" and e._sgl.kwargs["page_size"] == 4
    finally:
        e.shutdown()
    assert e._sgl.shut


def test_the_entry_point_does_nothing_without_speculation(monkeypatch: pytest.MonkeyPatch) -> None:
    """SGLang calls the entry point in each of its processes whatever the server args: with
    speculation off it must not import SGLang's speculative modules (here: absent, an ImportError)."""
    monkeypatch.setattr(plugin, "_registered", None)
    monkeypatch.setenv(plugin.ENV_SPECULATION, "0")
    assert plugin.register() is None
    monkeypatch.setenv(plugin.ENV_SPECULATION, "1")
    with pytest.raises(ImportError):
        plugin.register()


def test_an_abort_right_after_add_request_stops_the_request(engine: sg.SGLangEngine) -> None:
    """M (review): add_request schedules the generate task on SGLang's loop and abort posted
    abort_request behind it; abort_request ran first, before the task had registered the rid with
    the tokenizer manager, and SGLang ignores an rid it does not know: the attempt ran on to
    max_new_tokens as a zombie (holding a batch slot and KV). The task is cancelled now: one not
    started never reaches SGLang, one running is cancelled inside generate_request (SGLang aborts it)."""
    tm = engine._sgl.tokenizer_manager
    req = GenerateRequest(request_id="r", prompt_token_ids=(1, 2, 3), max_new_tokens=10, sampling=GREEDY)
    busy = threading.Event()
    engine._loop.call_soon_threadsafe(lambda: busy.wait(1.0))  # both calls queue behind this
    engine.add_request(req)
    assert engine.abort("r")
    busy.set()
    time.sleep(0.3)  # ten tokens at 20 ms each had the zombie run
    assert tm.yielded == {} and tm.held == set() and tm.requests == []  # it never reached SGLang
    engine.add_request(req)  # a running attempt: cancelled inside SGLang's generate_request
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and not tm.held:
        time.sleep(0.005)
    (rid,) = tm.held
    assert engine.abort("r")
    time.sleep(0.1)
    assert tm.held == set() and tm.cancelled == {rid} and tm.yielded.get(rid, 0) < 10
    assert not engine.has_unfinished() and engine.step() == []


def test_weights_loaded_right_after_an_abort_switch_the_version(engine: sg.SGLangEngine, tmp_path: Path) -> None:
    """HIGH (review 3): SGLang's update_weights_from_disk flushes its cache by default, and the flush
    needs an idle scheduler; an attempt aborted just before still runs a decode pass there. SGLang
    then answered (False, "Weights were updated, but ... not flushed") with the new weights IN, and
    the adapter refused the load: version, extra key and version file stayed at the old weights
    while SGLang served the new ones. Now the update goes without SGLang's flush, the flush is
    asked for separately (deferred until idle), and the loaded weights switch everything."""
    tm = engine._sgl.tokenizer_manager
    engine.add_request(GenerateRequest(request_id="r", prompt_token_ids=(1, 2, 3), max_new_tokens=40, sampling=GREEDY))
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and not tm.held:
        time.sleep(0.005)
    assert engine.abort("r") and not engine.has_unfinished()
    assert tm.scheduler  # SGLang's scheduler still holds the aborted attempt
    new = tmp_path / "new-weights"
    engine.load_weights(str(new), "m@v1")
    assert tm.loaded == str(new)
    assert engine.model_version == "m@v1" and engine._version_file.read_both(0, "") == (1, "m")
    update = next(c for c in tm.calls if isinstance(c, UpdateWeightFromDiskReqInput))
    assert update.flush_cache is False and tm.flushes == [True]  # flushed once the scheduler was idle
    assert isinstance(tm.calls[-1], ContinueGenerationReqInput)


def test_loaded_weights_switch_the_version_even_when_the_flush_fails(
        engine: sg.SGLangEngine, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The flush is memory, not correctness (new requests carry the new extra key and namespace):
    refused or timed out, the weights are still in, so the version switches. SGLang's own
    "Weights were updated, but" refusal counts as loaded too."""
    tm = engine._sgl.tokenizer_manager
    tm.scheduler.add("someone-else")  # never idle
    monkeypatch.setattr(sg, "FLUSH_TIMEOUT_S", 0.05)
    engine.load_weights(str(tmp_path), "m@v2")
    assert tm.flushes == [False] and engine.model_version == "m@v2"
    assert isinstance(tm.calls[-1], ContinueGenerationReqInput)
    assert sg._update_succeeded((False, NOT_FLUSHED, 0)) and not sg._update_succeeded((False, "bad path", 0))


def test_the_context_is_what_sglangs_scheduler_serves_whole(
        model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """MEDIUM-HIGH (review 3): max_context was the model's max_position_embeddings (512 here), but
    SGLang aborts an input of max_req_input_len tokens or more and silently clips max_new_tokens to
    its max_req_len (both from its KV pool and context). A near-context chunk came back ABORTED
    (and again after every retry). max_context is now SGLang's max_req_input_len."""
    monkeypatch.setattr(_SGLangEngine, "max_req_input_len", 20)
    e = make_engine(model_dir, tmp_path)
    try:
        assert e.max_context == 20 and e.stats().max_context == 20
        with pytest.raises(ValueError, match="max_new_tokens"):  # refused up front, not ABORTED by SGLang
            e.add_request(GenerateRequest(request_id="big", prompt_token_ids=tuple(range(1, 21)), max_new_tokens=5,
                                          sampling=GREEDY))
        outs = run(e, GenerateRequest(request_id="r", prompt_token_ids=tuple(range(1, 16)), max_new_tokens=5,
                                      sampling=GREEDY))
        assert len([t for o in outs for t in o.token_ids]) == 5 and outs[-1].finish_reason == FinishReason.LENGTH
    finally:
        e.shutdown()


def test_the_plugin_gets_the_group_size_as_sent_and_the_dispatch_epoch(engine: sg.SGLangEngine) -> None:
    """MEDIUM (review 3): a group of unknown size (0) went to the plugin as 1 (core and the engine
    both applied max(size, 1)); the plugin's follower registered that size and the draft server
    completed the group at its first finished response. The plugin's registrations also carried no
    dispatch epoch."""
    w = Worker(engine, speculation=False).start()
    try:
        job = ChunkJob(request_id="b/0/0", prompt_token_ids=(1, 2, 3), max_new_tokens=2, max_tokens=2,
                       sampling=GREEDY, policy_version=0, group_id="b/0", group_size=0, prompt_key="k",
                       dispatch_epoch=7)
        assert isinstance(list(w.submit(job).events())[-1], DoneEvent)
        (params,) = engine._sgl.tokenizer_manager.params.values()
        assert params["seer_group_size"] == 0 and params["seer_dispatch_epoch"] == 7
        meta = plugin.request_meta(params)
        assert (meta.group_size, meta.epoch) == (0, 7)
    finally:
        w.close()


def test_the_plugin_gets_the_submission(engine: sg.SGLangEngine) -> None:
    """The plugin's metadata carried no submit_seq (neither did GenerateRequest): SGLang-served
    groups registered with 0 and the draft server judged them by epochs alone (a new run after the
    scheduler's clock went back was refused as the old run's). The job's submit_seq reaches
    custom_params through the worker core and the engine."""
    w = Worker(engine, speculation=False).start()
    try:
        job = ChunkJob(request_id="b/0/0", prompt_token_ids=(1, 2, 3), max_new_tokens=2, max_tokens=2,
                       sampling=GREEDY, policy_version=0, group_id="b/0", group_size=2, prompt_key="k",
                       dispatch_epoch=7, submit_seq=42)
        assert isinstance(list(w.submit(job).events())[-1], DoneEvent)
        (params,) = engine._sgl.tokenizer_manager.params.values()
        assert params["seer_submit_seq"] == 42
        assert plugin.request_meta(params).submit_seq == 42
    finally:
        w.close()


def test_an_abort_does_not_reach_a_retry_whose_sglang_id_it_prefixes(
        engine: sg.SGLangEngine, monkeypatch: pytest.MonkeyPatch) -> None:
    """LOW (review 3): SGLang's scheduler aborts every request whose rid starts with the aborted rid.
    With '<request>#<attempt>' ids the abort of attempt 'r#1' also hit the retry 'r#12' when it
    arrived first: the retry came back ABORTED. Attempt ids are prefix-free now."""
    monkeypatch.setattr(sg, "_ATTEMPTS", iter([1, 12]))
    tm = engine._sgl.tokenizer_manager
    req = GenerateRequest(request_id="r", prompt_token_ids=(1, 2, 3), max_new_tokens=4, sampling=GREEDY)
    engine.add_request(req)
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and not tm.held:
        time.sleep(0.005)
    assert engine.abort("r")
    engine.add_request(req)  # the retry reaches SGLang before the abort reaches its scheduler
    deadline = time.monotonic() + 5
    outs: list[StepOutput] = []
    while time.monotonic() < deadline and not any(o.finished for o in outs):
        outs += engine.step()
    assert outs and outs[-1].finish_reason == FinishReason.LENGTH
    assert [t for o in outs for t in o.token_ids] == [50, 51, 52, 53]
    assert sg.attempt_rid(1, "r") != "r#1" and not sg.attempt_rid(12, "r").startswith(sg.attempt_rid(1, "r"))


def test_a_load_that_times_out_leaves_sglang_paused_and_the_engine_broken(
        engine: sg.SGLangEngine, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """LOW (review 4): LOAD_TIMEOUT_S was 1200 s, past the scheduler's LoadWeights deadline (its
    drain_timeout, 300 s), and on timeout continue_generation still ran (a finally): SGLang resumed,
    possibly mid-load, serving unknown weights under the old version. Now the bound is below the
    caller's, SGLang stays paused and the engine answers every request ABORTED (the worker's
    canary then turns its health NOT_SERVING)."""
    assert sg.LOAD_TIMEOUT_S < 300.0
    tm = engine._sgl.tokenizer_manager
    gate = asyncio.Event()

    async def hung(obj: UpdateWeightFromDiskReqInput, request: Any = None) -> tuple[bool, str, int]:
        tm.calls.append(obj)
        await gate.wait()  # a scheduler stuck reading the checkpoint
        return True, "", 0

    monkeypatch.setattr(tm, "update_weights_from_disk", hung)
    monkeypatch.setattr(sg, "LOAD_TIMEOUT_S", 0.2)
    with pytest.raises(RuntimeError, match="did not finish loading"):
        engine.load_weights(str(tmp_path), "m@v1")
    time.sleep(0.1)  # the cancelled switch() has unwound on the loop
    assert not any(isinstance(c, ContinueGenerationReqInput) for c in tm.calls), tm.calls
    assert engine.model_version == "m@v0"
    outs = run(engine, GenerateRequest(request_id="r", prompt_token_ids=(1, 2), max_new_tokens=3, sampling=GREEDY))
    assert [(o.token_ids, o.finish_reason) for o in outs] == [([], FinishReason.ABORTED)]
    assert tm.requests == []  # never reached the paused SGLang
    with pytest.raises(RuntimeError, match="broken"):
        engine.load_weights(str(tmp_path), "m@v2")


def test_a_timeout_error_inside_the_load_is_not_reported_as_the_load_timing_out(
        engine: sg.SGLangEngine, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`except concurrent.futures.TimeoutError` around fut.result() also caught a TimeoutError
    raised by SGLang inside the switch (the same class since 3.11) and reported it as the wait
    running out, weights "unknown". It propagates now (an OSError: the worker's bad-source path),
    and SGLang is resumed as after any other failure."""
    tm = engine._sgl.tokenizer_manager

    async def fails(obj: UpdateWeightFromDiskReqInput, request: Any = None) -> tuple[bool, str, int]:
        raise TimeoutError("reading shard 3: timed out")

    monkeypatch.setattr(tm, "update_weights_from_disk", fails)
    with pytest.raises(TimeoutError, match="shard 3"):
        engine.load_weights(str(tmp_path), "m@v1")
    assert isinstance(tm.calls[-1], ContinueGenerationReqInput) and engine._broken is None


def test_waiting_comes_from_sglangs_load_snapshot_read_at_a_bounded_rate(engine: sg.SGLangEngine,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """stats().waiting was always 0: SGLang's queue length is only in its load snapshot
    (TokenizerManager.get_loads, num_waiting_reqs). stats() never waits for the read: it answers
    with the last value and starts at most one read per LOADS_INTERVAL_S on the loop."""
    tm = engine._sgl.tokenizer_manager
    # An interval no test run outlasts: each read below is started by resetting the engine's
    # last-read time (the interval passed), not by sleeping past a short one, which a slow
    # machine could overrun inside the burst.
    monkeypatch.setattr(sg, "LOADS_INTERVAL_S", 3600.0)
    for i in range(3):
        engine.add_request(GenerateRequest(request_id=f"r{i}", prompt_token_ids=(1, 2, 3), max_new_tokens=200,
                                           sampling=GREEDY))
    tm.waiting = 2
    first = engine.stats()
    assert (first.running, first.waiting) == (3, 0)  # nothing read yet: the read starts now

    def settled() -> Any:
        deadline = time.monotonic() + 2
        while time.monotonic() < deadline and engine._loads_busy:
            time.sleep(0.005)
        return engine.stats()

    s = settled()
    assert (s.running, s.waiting) == (1, 2)  # live requests are running or waiting, not both
    reads = tm.load_reads
    for _ in range(50):  # a burst of stats calls inside one interval: no further read
        engine.stats()
    assert tm.load_reads == reads
    # The reads took the snapshot's blocking file lock off the event loop's thread.
    assert tm.read_threads and engine._thread.ident not in tm.read_threads
    tm.waiting = 9  # more than the live set (the snapshot lags): clamped to it
    engine._loads_at = float("-inf")  # the interval passed
    engine.stats()
    s = settled()
    assert tm.load_reads == reads + 1 and (s.running, s.waiting) == (0, 3)
    tm.loads_published = False  # no snapshot (e.g. the scheduler restarted its slot): keep the last
    engine._loads_at = float("-inf")
    engine.stats()
    assert settled().waiting == 3
    for i in range(3):
        engine.abort(f"r{i}")
    assert engine.stats().waiting == 0  # clamped to the live set at once
    time.sleep(0.1)  # the cancelled generate tasks finish before the engine shuts down


def test_a_failing_load_read_keeps_the_last_waiting_count(engine: sg.SGLangEngine,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    tm = engine._sgl.tokenizer_manager
    monkeypatch.setattr(sg, "LOADS_INTERVAL_S", 0.0)

    def broken() -> list[Any]:
        raise OSError("load shm header mismatch")

    monkeypatch.setattr(tm, "read_all", broken)
    engine.add_request(GenerateRequest(request_id="r", prompt_token_ids=(1, 2, 3), max_new_tokens=200,
                                       sampling=GREEDY))
    for _ in range(5):
        s = engine.stats()
        time.sleep(0.02)
    assert (s.running, s.waiting) == (1, 0)
    # The last read may still be on the loop: its failure must clear the flag (or no read ever
    # starts again), so wait for it with a deadline rather than a fixed sleep.
    deadline = time.monotonic() + 2
    while engine._loads_busy and time.monotonic() < deadline:
        time.sleep(0.005)
    assert not engine._loads_busy
    engine.abort("r")


def _stopped_cleanly(engine: sg.SGLangEngine) -> None:
    engine._thread.join(2.0)
    assert not engine._thread.is_alive()
    # Nothing left pending on the loop: a task left there is destroyed at exit unfinished, and one
    # whose coroutine never started warns "coroutine ... was never awaited".
    assert asyncio.all_tasks(engine._loop) == set()
    assert engine._loop.is_closed()


def test_a_load_read_queued_at_shutdown_is_cancelled_not_left_unstarted(model_dir: Path, tmp_path: Path) -> None:
    """stats() queues a load read on SGLang's loop; shutdown stopped the loop right behind it, so
    the read's task was created and never run: every test run warned "coroutine
    SGLangEngine._read_loads was never awaited", and a worker exiting while its stats poll ran did
    the same. Shutdown now cancels what is on the loop, waits for it, and closes the loop."""
    e = make_engine(model_dir, tmp_path)
    busy = threading.Event()
    e._loop.call_soon_threadsafe(lambda: busy.wait(0.3))  # the read queues behind this
    e.stats()
    assert e._loads_busy
    e.shutdown()
    _stopped_cleanly(e)
    assert not e._loads_busy
    e.stats()  # after shutdown: answers with the last value, schedules nothing
    assert not e._loads_busy and asyncio.all_tasks(e._loop) == set()
    # A request after shutdown is answered ABORTED (as by a broken engine), not a generate coroutine
    # handed to the closed loop.
    e.add_request(GenerateRequest(request_id="late", prompt_token_ids=(1, 2, 3), max_new_tokens=2, sampling=GREEDY))
    (out,) = e.step()
    assert out.finish_reason == FinishReason.ABORTED and asyncio.all_tasks(e._loop) == set()
    e.shutdown()  # twice: SGLang's shutdown again, nothing on the closed loop


def test_a_load_read_in_flight_at_shutdown_is_cancelled(model_dir: Path, tmp_path: Path) -> None:
    """A read waiting on the snapshot's file lock (in its thread) when the worker shuts down: its
    task was left pending on the stopped loop."""
    e = make_engine(model_dir, tmp_path)
    tm = e._sgl.tokenizer_manager
    started, release = threading.Event(), threading.Event()

    def blocked() -> list[Any]:
        started.set()
        release.wait(2.0)
        return []

    tm.read_all = blocked
    try:
        e.stats()
        assert started.wait(2.0)
        e.shutdown()
        _stopped_cleanly(e)
        assert not e._loads_busy
    finally:
        release.set()
