"""SEER's per-step draft counts through SGLang 0.5.23's OWN streaming code, lifted from the pinned
wheel: the customized_info part of _GenerationStreamAccumulator.accept (output_streamer.py), and
TokenizerManager._accumulate_request_meta_info / _slice_streaming_output_meta_info
(tokenizer_manager.py). The SeerDraftWorker runs in the scheduler stand-in of
test_sglang_worker_order (SGLang's step order), one output is streamed after every batch, and the
adapter's stream_delta reads them, cumulative and incremental.

Found by review (b1346aa): record_step filed one value per verify step, not one per token, so the
list was shorter than output_ids; SGLang slices it by token position, and with
incremental_streaming_output the counts of every chunk but the first were lost."""

from __future__ import annotations

import ast
import copy
import typing
from collections.abc import Callable
from typing import Any

import pytest
from test_sglang_api import SRT, TM, Wheel, wheel_path
from test_sglang_worker_order import DEPTH, A, _Req, _Scheduler, worker  # noqa: F401

from services.worker.engines.sglang.engine import stream_delta

STREAMER = f"{SRT}.managers.scheduler_components.output_streamer"


class _Accumulator:
    """The fields of _GenerationStreamAccumulator the lifted block reads and writes."""

    def __init__(self) -> None:
        self.output_ids: list[list[int]] = []
        self.customized_info: dict[str, list[Any]] = {}

    def is_request_level_customized_info_key(self, key: str) -> bool:
        return False  # OutputStreamer's answer (output_streamer.py:252-254): token-sliced


class _ReqState:
    """The ReqState fields the tokenizer manager's accumulation uses."""

    def __init__(self) -> None:
        self.customized_info_accumulated: dict[str, list[Any]] = {}
        self.customized_info_reported_keys: set[str] = set()


def _lift(whl: Wheel) -> tuple[Callable[..., None], Callable[..., None], Callable[..., None]]:
    """(accept_customized(self, req, send_token_offset, output_ids_), accumulate, slice), SGLang's
    own statements compiled here."""
    accept = whl.method(STREAMER, "_GenerationStreamAccumulator", "accept")
    start = next(i for i, st in enumerate(accept.body)
                 if ast.unparse(st) == "current_output_len = len(self.output_ids[-1])")
    body = accept.body[start:]
    assert any("req.customized_info.items()" in ast.unparse(st) for st in body)
    fn = ast.parse("def accept_customized(self, req, send_token_offset, output_ids_):\n    pass").body[0]
    assert isinstance(fn, ast.FunctionDef)
    fn.body = copy.deepcopy(body)  # whl's trees are cached: never mutate them
    ns: dict[str, Any] = {}
    exec(compile(ast.fix_missing_locations(ast.Module([fn], [])), STREAMER, "exec"), {}, ns)
    tm_globals: dict[str, Any] = {**vars(typing), "ReqState": _ReqState, "_INCREMENTAL_STREAMING_META_INFO_KEYS": ()}
    node = copy.deepcopy(whl.method(TM, "TokenizerManager", "_accumulate_request_meta_info"))
    node.decorator_list = []
    exec(compile(ast.fix_missing_locations(ast.Module([node], [])), TM, "exec"), tm_globals, ns)
    sliced = next(n for n in whl.tree(TM).body
                  if isinstance(n, ast.FunctionDef) and n.name == "_slice_streaming_output_meta_info")
    exec(compile(ast.Module([copy.deepcopy(sliced)], []), TM, "exec"), tm_globals, ns)
    return ns["accept_customized"], ns["_accumulate_request_meta_info"], ns["_slice_streaming_output_meta_info"]


class _Stream:
    """SGLang's path from a Req to the adapter: the streamer's slice (output_ids_through_stop from
    send_token_offset), the tokenizer manager's accumulation (and incremental slicing), then
    stream_delta. Sums what stream_delta reports."""

    def __init__(self, whl: Wheel, req: _Req, incremental: bool) -> None:
        self.accept, self.accumulate, self.slice = _lift(whl)
        self.req, self.incremental = req, incremental
        self.state = _ReqState()
        self.req.send_token_offset = 0  # type: ignore[attr-defined]
        self.sent: list[int] = []
        self.last_output_offset = 0
        self.reported = 0
        self.accepted = self.proposed = 0
        self.tokens: list[int] = []

    def send(self) -> None:
        req = self.req
        off = req.send_token_offset  # type: ignore[attr-defined]
        through_stop = req.output_ids_through_stop
        acc = _Accumulator()
        acc.output_ids.append(through_stop[off:])
        req.send_token_offset = len(through_stop)  # type: ignore[attr-defined]
        self.accept(acc, req, off, through_stop)
        meta: dict[str, Any] = {}
        for key, per_req in acc.customized_info.items():  # update_request_meta_info, index 0
            self.accumulate(meta, self.state, key, per_req[0])
        new = acc.output_ids[0]
        self.sent += new
        meta["completion_tokens"] = len(self.sent)
        meta["output_token_logprobs"] = [(-0.5, t, None) for t in (new if self.incremental else self.sent)]
        meta["finish_reason"] = {"type": "length"} if req.finished() else None
        if self.incremental:
            self.slice(meta, self.last_output_offset, self.state.customized_info_accumulated.keys())
            self.last_output_offset = len(self.sent)
        d = stream_delta({"output_ids": list(new if self.incremental else self.sent), "meta_info": meta},
                         self.reported)
        self.reported = d.total
        self.tokens += d.token_ids
        self.accepted += d.accepted
        self.proposed += d.proposed


@pytest.fixture(scope="module")
def whl() -> Wheel:
    return Wheel(wheel_path())


@pytest.mark.parametrize("incremental", [False, True], ids=["cumulative", "incremental"])
def test_every_steps_draft_counts_reach_the_adapter(whl: Wheel, worker: Any, incremental: bool) -> None:  # noqa: F811
    s = _Scheduler(worker)
    a = _Req(A, max_new_tokens=12)
    stream = _Stream(whl, a, incremental)
    s.prefill(a)
    stream.send()  # the prefill's token goes out before any verify step filed a value
    pattern = [2, 0, 3, 1, 3]  # the last step overshoots max_new_tokens: finished inside it
    for k in pattern:
        s.decode({A: k})
        stream.send()
        if a.finished():
            break
    assert a.finished() and stream.tokens == a.output_ids_through_stop
    # Each step: a chain of DEPTH real drafts proposed, its first k accepted (the fake's truth).
    assert (stream.accepted, stream.proposed) == (sum(pattern), DEPTH * len(pattern))
