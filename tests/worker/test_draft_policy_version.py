"""RunChunkRequest.policy_version reaches the draft server's RegisterGroup through the worker (the
gRPC servicer's job, the core's registration of every chunk, the embedded DraftClient), where it is
the group's history iteration (RegisterGroupRequest.policy_version, services/draft/README.md
"History iterations"). Without it the draft server numbered a group "the key's newest iteration +
1" at registration: two groups of one prompt key at one version (a prompt sampled twice in a batch,
a batch split into two submissions), each registered after the other completed, were two
iterations, and with the default 2 kept the previous version's responses were pushed out.

Real worker cores on the shared reference engine served over gRPC on loopback, real DraftClients
(their background ticks stopped: flush() drives them) and a real draft server on loopback."""

from __future__ import annotations

import queue
import time
from collections.abc import Iterator

import grpc
from seer.v1 import common_pb2, draft_pb2, draft_pb2_grpc, worker_pb2, worker_pb2_grpc

from services.common.errors import InvalidArgument
from services.common.grpcutil import channel
from services.common.server import RunningServer, ServiceConfig, start_server
from services.worker.chunks import ChunkJob
from services.worker.core import Worker, _Active
from services.worker.draft_client import DraftClient
from services.worker.engine import SamplingParams
from services.worker.engines.reference.engine import ReferenceEngine
from services.worker.server import add_servicer
from tests.draft.draft_helpers import DraftServer, manual

KEY = "prompt-k"
PROMPT = [1, 2, 3, 4]


def _chunk(group_id: str, version: int, seed: int) -> worker_pb2.RunChunkRequest:
    """The one request of a one-response group of KEY, whole in one chunk (it finishes: LENGTH)."""
    return worker_pb2.RunChunkRequest(
        request_id=f"{group_id}/0", batch_id=group_id.split("/")[0], group_id=group_id, prompt_key=KEY,
        prompt_token_ids=PROMPT, max_new_tokens=3, max_tokens=3,
        sampling=common_pb2.SamplingParams(temperature=1.0, seed=seed, ignore_eos=True),
        policy_version=version, group_size=1, dispatch_epoch=1, submit_seq=seed)


def _run(stub: worker_pb2_grpc.WorkerServiceStub, req: worker_pb2.RunChunkRequest) -> tuple[int, ...]:
    tokens: list[int] = []
    done: worker_pb2.ChunkDone | None = None
    stream: Iterator[worker_pb2.RunChunkResponse] = stub.RunChunk(req, timeout=60)
    for ev in stream:
        if ev.HasField("tokens"):
            tokens += ev.tokens.token_ids
        if ev.HasField("done"):
            done = ev.done
    assert done is not None and done.finish_reason == common_pb2.FINISH_REASON_LENGTH
    return tuple(tokens)


def _serve_groups(engine: ReferenceEngine, version: int, draft: DraftClient,
                  chunks: list[worker_pb2.RunChunkRequest]) -> list[tuple[int, ...]]:
    """A worker serving `version` runs each chunk in turn over gRPC; its draft client sends each
    group's registration and finishing append before the next chunk (so every group completes on
    the draft server, and becomes history, before the next one registers)."""
    worker = Worker(engine, worker_id=f"w-v{version}", policy_version=version, draft=draft,
                    speculation=False).start()
    running: RunningServer = start_server("worker", ServiceConfig(port=0, grace_seconds=1.0), add_servicer(worker),
                                          on_stop=worker.close)
    ch: grpc.Channel = channel(running.address)
    out: list[tuple[int, ...]] = []
    try:
        stub = worker_pb2_grpc.WorkerServiceStub(ch)
        for req in chunks:
            out.append(_run(stub, req))
            draft.flush()
    finally:
        ch.close()
        running.stop(1.0)
    return out


def test_groups_of_one_key_at_one_version_keep_the_earlier_versions_history(
        ref_engine: ReferenceEngine, draft_server: DraftServer) -> None:
    old, new = manual(draft_server.address), manual(draft_server.address)
    try:
        # Version 0: one group of the key. Version 1 (after a weight switch): two groups of the
        # same key, each registered after the other completed (a batch split into two submissions).
        [v0] = _serve_groups(ref_engine, 0, old, [_chunk("a/0", 0, 11)])
        v1 = _serve_groups(ref_engine, 1, new, [_chunk("b/0", 1, 12), _chunk("c/0", 1, 13)])
        store = draft_server.store
        # Two versions, two history iterations: version 1's groups merged into one, and version 0's
        # response is still kept (numbered 0, 1, 2 without the version, it was pushed out).
        iterations = store._history._keys[KEY]
        assert sorted(iterations) == [0, 1]
        assert [tuple(r) for r in iterations[0].responses] == [v0]
        assert sorted(tuple(r) for r in iterations[1].responses) == sorted(v1)
        for gid, version in (("a/0", 0), ("b/0", 1), ("c/0", 1)):
            assert store._groups[gid].history_iteration == version, gid  # as RunChunkRequest carried it
        # Through the service as well: a new group of the key drafts from all three responses.
        ch = channel(draft_server.address)
        try:
            stub = draft_pb2_grpc.DraftServiceStub(ch)
            resp = stub.RegisterGroup(draft_pb2.RegisterGroupRequest(
                group_id="d/0", prompt_key=KEY, prompt_token_ids=PROMPT, group_size=1, policy_version=2),
                timeout=10)
            assert resp.history_responses == 3
            assert stub.GetDraftStats(draft_pb2.GetDraftStatsRequest(), timeout=10).evicted_history == 0
        finally:
            ch.close()
    finally:
        old.close()
        new.close()


def test_a_mirror_registers_its_runs_first_version_and_a_new_run_its_own(draft_server: DraftServer) -> None:
    """The version a group's registrations carry (DraftClient.register_attempt): the first attempt's
    of the run the mirror follows, also when a later chunk of that run comes at another version (a
    weight switch while the group ran) and when the group is re-created after the server lost it;
    a newer submission registering the id again carries its own."""
    c = manual(draft_server.address)
    try:
        c.register_attempt("g", KEY, PROMPT, 2, request_id="r0", epoch=1, submit_seq=5, policy_version=3)
        c.flush()
        c.register_attempt("g", KEY, PROMPT, 2, request_id="r1", epoch=2, submit_seq=5, policy_version=4)
        c.flush()
        assert draft_server.store._groups["g"].history_iteration == 3
        # The server restarts and loses the group: the mirror re-creates it at its run's version.
        draft_server.restart()
        c.flush()  # the Sync answers gone: the mirror starts over
        c.flush()  # and registers again
        assert draft_server.store._groups["g"].history_iteration == 3
        # Another run under the id (a resubmitted batch, after the weights moved on).
        c.register_attempt("g", KEY, PROMPT, 2, request_id="r0", epoch=3, submit_seq=6, policy_version=5)
        c.resume("g", "r0", [], 3, submit_seq=6)  # its chunk runs here (the mirror is kept for it)
        c.flush()
        c.flush()  # the Sync's reset to the new incarnation
        assert draft_server.store._groups["g"].history_iteration == 5
        assert c._groups["g"].policy_version == 5
        draft_server.restart()
        c.flush()
        c.flush()
        assert draft_server.store._groups["g"].history_iteration == 5
        # Without a version (an old caller): unset on the wire, the server numbers it itself.
        c.register_group("h", KEY, PROMPT, 2)
        c.flush()
        assert not draft_server.store._groups["h"].versioned
    finally:
        c.close()


def test_a_mirror_moved_to_a_run_it_has_no_attempt_of_does_not_stamp_it_with_the_old_runs_version(
        draft_server: DraftServer) -> None:
    """Worker A follows the old run (submission 5, version 3); worker B registers the id's new run
    (submission 6, version 5), and A's Sync moves A's mirror to it. A has no attempt of the new run,
    so its version is unknown there: A kept version 3, and when the server restarted, A could be
    first to re-create the group, stamped version 3 (the server keeps a group's first version; B's
    registration could not mend it)."""
    a, b = manual(draft_server.address), manual(draft_server.address)
    try:
        a.register_attempt("g", KEY, PROMPT, 2, request_id="r0", epoch=1, submit_seq=5, policy_version=3)
        a.resume("g", "r0", [], 1, submit_seq=5)
        a.flush()
        b.register_attempt("g", KEY, PROMPT, 2, request_id="r0", epoch=2, submit_seq=6, policy_version=5)
        b.resume("g", "r0", [], 2, submit_seq=6)
        b.flush()
        a.flush()
        a.flush()  # A's Sync: the reset to the new incarnation
        assert a._groups["g"].submit_seq == 6 and a._groups["g"].policy_version is None
        draft_server.restart()
        for _ in range(3):
            a.flush()  # A re-creates the group first, without a version (it had stamped 3)
        for _ in range(3):
            b.flush()
        g = draft_server.store._groups["g"]
        # Never the old run's version: the run's own (a registration that brought it), or none (the
        # store merges an unversioned group into the key's newest version at promotion).
        assert g.submit_seq == 6 and (g.history_iteration == 5 if g.versioned else g.history_iteration < 0)
    finally:
        a.close()
        b.close()


def test_a_negative_version_is_refused_naming_the_field() -> None:
    c = DraftClient(None)
    try:
        c.register_attempt("g", KEY, PROMPT, 2, policy_version=-1)
    except InvalidArgument as e:
        assert e.field == "policy_version"
    else:
        raise AssertionError("a negative policy_version was taken")
    finally:
        c.close()


def test_a_chunk_re_added_after_a_step_failure_keeps_its_version() -> None:
    """The engine request that continues a chunk (Worker._resume_request, after an isolated step
    failure) carries the chunk's policy version: an engine that registers the group itself (the
    SGLang plugin) sent none for it, and a group it re-created was numbered without one."""
    job = ChunkJob(request_id="r0", prompt_token_ids=(1, 2), max_new_tokens=8, max_tokens=8,
                   sampling=SamplingParams(), policy_version=7, group_id="g", prompt_key=KEY, submit_seq=3)
    act = _Active(job=job, events=queue.SimpleQueue(), started=time.monotonic(), tokens=[5, 6])
    req = Worker._resume_request(act)
    assert (req.policy_version, req.submit_seq, req.output_token_ids, req.max_new_tokens) == (7, 3, (5, 6), 6)
