"""SGLang's SEER plugin and the draft client (services.worker.engines.sglang.plugin.DraftBridge).

SGLang sees one request per attempt of a chunk (its own id, `<request>#<n>`) whose input is the
prompt plus the committed output and whose output_ids start at 0. The draft index holds one
response per Seer request at response positions. Found in review (session 17): the plugin keyed the
mirror by SGLang's id at attempt-relative offsets, so every chunk after a request's first was
dropped as an overlap (a warning per step), a retried id carried the old attempt's append count,
the group was registered with the chunk's whole input as its prompt and with no prompt key and a
group size of 1 (whichever registration reached the server first won: no history, an early
completion), and the plugin's client wrote the same responses to the server as the worker's.

The bridge runs without SGLang, over a real (local) DraftClient; the follower client the plugin
uses is tested against a real draft server in tests/draft/test_client.py."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from services.worker.draft_client import DraftClient
from services.worker.engines.sglang.plugin import DraftBridge, RequestMeta, custom_params, request_meta

PROMPT = (1, 2, 3)


def _meta(offset: int, request_id: str = "r") -> RequestMeta:
    return request_meta(custom_params("g", "key", 2, False, request_id=request_id, output_offset=offset))


class _Recorder:
    """Records the bridge's calls (the glue under test); delegates to a local DraftClient."""

    def __init__(self) -> None:
        self.client = DraftClient(None)
        self.calls: list[tuple[Any, ...]] = []
        self.epochs: list[tuple[str, str, int]] = []  # (call, request id, dispatch epoch)
        self.submissions: list[tuple[str, int]] = []  # (request id, submit_seq) per registration
        self.versions: list[tuple[str, int | None]] = []  # (request id, policy_version) per registration

    def register_attempt(self, group_id: str, prompt_key: str, prompt_token_ids: Sequence[int], group_size: int,
                         ttl_seconds: int = 3600, *, request_id: str = "", epoch: int = 0,
                         submit_seq: int = 0, policy_version: int | None = None) -> None:
        self.calls.append(("register", group_id, prompt_key, tuple(prompt_token_ids), group_size))
        self.epochs.append(("register", request_id, epoch))
        self.submissions.append((request_id, submit_seq))
        self.versions.append((request_id, policy_version))
        self.client.register_attempt(group_id, prompt_key, prompt_token_ids, group_size, ttl_seconds,
                                     request_id=request_id, epoch=epoch, submit_seq=submit_seq,
                                     policy_version=policy_version)

    def resume(self, group_id: str, request_id: str, output_token_ids: Sequence[int], epoch: int = 0, *,
               submit_seq: int = 0) -> None:
        self.calls.append(("resume", request_id, tuple(output_token_ids)))
        self.epochs.append(("resume", request_id, epoch))
        self.client.resume(group_id, request_id, output_token_ids, epoch, submit_seq=submit_seq)

    def append(self, group_id: str, request_id: str, offset: int, token_ids: Sequence[int],
               finished: bool = False, truncate: bool = False, *, epoch: int = 0, submit_seq: int = 0) -> None:
        self.calls.append(("append", request_id, offset, tuple(token_ids)))
        self.client.append(group_id, request_id, offset, token_ids, finished, truncate, epoch=epoch,
                           submit_seq=submit_seq)

    def end(self, group_id: str, request_id: str, *, epoch: int = 0, submit_seq: int = 0) -> None:
        self.calls.append(("end", request_id))
        self.client.end(group_id, request_id, epoch=epoch, submit_seq=submit_seq)

    def propose(self, group_id: str, request_id: str, context: Sequence[int], max_len: int, width: int = 1) -> Any:
        self.calls.append(("propose", request_id, tuple(context)))
        return self.client.propose(group_id, request_id, context, max_len, width)


def test_custom_params_round_trip() -> None:
    assert _meta(7) == RequestMeta("g", "key", 2, False, "r", 7, 0)
    assert request_meta(None) == RequestMeta()
    assert request_meta({"seer_group_id": "g", "seer_output_offset": -3}).output_offset == 0


def test_chunks_and_attempts_extend_one_response_at_response_positions() -> None:
    rec = _Recorder()
    bridge = DraftBridge(rec, ttl_seconds=60)
    # Chunk 1, attempt r#1: output 10, 11, finished as a chunk (not the response).
    bridge.verified("r#1", _meta(0), PROMPT, [10], False)
    bridge.verified("r#1", _meta(0), PROMPT, [10, 11], False)
    bridge.forget("r#1")  # the chunk ended: SGLang no longer runs r#1
    # Chunk 2 (resumed here): its input holds the committed output.
    bridge.verified("r#2", _meta(2), (*PROMPT, 10, 11), [12, 13], False)
    assert rec.client.own_length("g", "r") == 4
    # Chunk 3's first attempt streams 14, 15 and is aborted; the retry samples 20.
    bridge.verified("r#3", _meta(4), (*PROMPT, 10, 11, 12, 13), [14, 15], False)
    bridge.verified("r#4", _meta(4), (*PROMPT, 10, 11, 12, 13), [20], True)
    assert rec.client.own_length("g", "r") == 5
    d = rec.client.propose("g", "other", [*PROMPT, 10, 11, 12], 4)
    assert d is not None and d.tokens == (13, 20)  # not 14, 15: the abandoned attempt's tokens are gone
    appends = [c for c in rec.calls if c[0] == "append"]
    assert appends == [("append", "r", 0, (10,)), ("append", "r", 1, (11,)), ("append", "r", 2, (12, 13)),
                       ("append", "r", 4, (14, 15)), ("append", "r", 4, (20,))]
    # Registered with the prompt alone, the real key and size, whatever chunk was seen first.
    assert {c for c in rec.calls if c[0] == "register"} == {("register", "g", "key", PROMPT, 2)}
    assert [c for c in rec.calls if c[0] == "resume"] == [
        ("resume", "r", ()), ("resume", "r", (10, 11)), ("resume", "r", (10, 11, 12, 13)),
        ("resume", "r", (10, 11, 12, 13))]
    assert len(bridge) == 2  # r#2 (its chunk ended) and r#3 (aborted), until they are forgotten
    bridge.forget("r#2")
    bridge.forget("r#3")
    assert len(bridge) == 0 and ("end", "r") in rec.calls


def test_proposals_are_for_the_seer_request_with_the_whole_context() -> None:
    rec = _Recorder()
    bridge = DraftBridge(rec)
    bridge.propose("r#7", _meta(2), (*PROMPT, 10, 11), [12], 4, 1)
    assert rec.calls[-1] == ("propose", "r", (*PROMPT, 10, 11, 12))


def test_the_plugins_registrations_carry_the_group_size_as_sent_and_the_dispatch_epoch() -> None:
    """M (review 3): a group of unknown size (0) reached the plugin as 1 (the engine and
    request_meta both turned 0 into 1) and the follower's RegisterGroup set that size on the draft
    server: the group completed at its first finished response. And the follower registered with
    epoch 0, so the server could not tell this run's attempt from an old run under a reused id."""
    rec = _Recorder()
    bridge = DraftBridge(rec)
    meta = request_meta(custom_params("g", "key", 0, False, request_id="r", output_offset=0, epoch=7))
    bridge.verified("3#r", meta, PROMPT, [10], False)
    assert [c for c in rec.calls if c[0] == "register"] == [("register", "g", "key", PROMPT, 0)]
    assert rec.epochs == [("register", "r", 7), ("resume", "r", 7)]


def test_the_plugins_registrations_carry_the_submission() -> None:
    """The follower registered with submit_seq 0 (the plugin's metadata had none): the draft server
    judged SGLang-served groups by epochs alone, and a new run after the scheduler's clock went back
    was refused as the old run's. The submission round-trips through custom_params to the
    registration and the mirror keeps it per request."""
    rec = _Recorder()
    bridge = DraftBridge(rec)
    params = custom_params("g", "key", 2, False, request_id="r", output_offset=0, epoch=7, submit_seq=42)
    assert params["seer_submit_seq"] == 42
    meta = request_meta(params)
    assert (meta.epoch, meta.submit_seq) == (7, 42)
    assert request_meta(custom_params("g", "key", 2, False)).submit_seq == 0  # unknown: 0
    assert request_meta({"seer_group_id": "g", "seer_submit_seq": -1}).submit_seq == 0
    bridge.verified("3#r", meta, PROMPT, [10], False)
    assert rec.submissions == [("r", 42)]
    m = rec.client._groups["g"]
    assert m.submit_seq == 42 and m.seqs == {"r": 42}


def test_the_plugins_registrations_carry_the_policy_version() -> None:
    """The follower registered without a policy version: its RegisterGroup may reach the draft
    server before the worker's, and a group's first version is its history iteration there, so an
    unversioned first registration numbered the group newest + 1 (groups of one prompt key at one
    version did not merge). The version round-trips through custom_params (0 is a version; absent
    or negative is unknown) to the registration and the mirror."""
    params = custom_params("g", "key", 2, False, request_id="r", epoch=7, submit_seq=42, policy_version=0)
    assert params["seer_policy_version"] == 0
    assert request_meta(params).policy_version == 0
    assert "seer_policy_version" not in custom_params("g", "key", 2, False)
    assert request_meta(custom_params("g", "key", 2, False)).policy_version is None
    assert request_meta({"seer_group_id": "g", "seer_policy_version": -1}).policy_version is None
    rec = _Recorder()
    bridge = DraftBridge(rec)
    meta = request_meta(custom_params("g", "key", 2, False, request_id="r", epoch=7, submit_seq=42,
                                      policy_version=3))
    bridge.verified("3#r", meta, PROMPT, [10], False)
    assert rec.versions == [("r", 3)]
    assert rec.client._groups["g"].registration().policy_version == 3
