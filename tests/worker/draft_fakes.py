"""Test doubles of the worker core's collaborators (services/worker/ports.py): one recording draft
source that tests subclass (override propose) or read (its calls), a chain drafter for the fake
engine's model, and a planner with a fixed draft length.

RecordingDraft is the only place the DraftSource method signatures are spelled out in the tests:
the worker core's DraftSource and the SGLang bridge's DraftSink (services/worker/engines/sglang/
plugin.py) both take it (append's `truncate` and register_attempt's default TTL are the sink's; a
DraftSource caller never passes them)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from services.worker.engine import Draft


@dataclass(frozen=True, slots=True)
class DraftCall:
    """One call a RecordingDraft took, with what the tests check of it (0 / () / False: not given)."""

    method: str  # "register_attempt", "resume", "append", "end" or "release_group"
    group_id: str
    request_id: str = ""
    epoch: int = 0
    submit_seq: int = 0
    offset: int = 0
    token_ids: tuple[int, ...] = ()  # append: the tokens; resume: the committed output
    finished: bool = False


_NAMED = ("resume", "append", "end")  # the calls that name a chunk's attempt (epoch, submission)


class RecordingDraft:
    """A DraftSource (and DraftSink) with nothing to draft from: records every call but propose
    and has_group, proposes nothing (subclass and override propose) and keeps every group."""

    def __init__(self) -> None:
        self.calls: list[DraftCall] = []

    def register_attempt(self, group_id: str, prompt_key: str, prompt_token_ids: Sequence[int], group_size: int,
                         ttl_seconds: int = 3600, *, request_id: str = "", epoch: int = 0,
                         submit_seq: int = 0, policy_version: int | None = None) -> None:
        self.calls.append(DraftCall("register_attempt", group_id, request_id, epoch, submit_seq))

    def append(self, group_id: str, request_id: str, offset: int, token_ids: Sequence[int],
               finished: bool = False, truncate: bool = False, *, epoch: int = 0, submit_seq: int = 0) -> None:
        self.calls.append(DraftCall("append", group_id, request_id, epoch, submit_seq, offset,
                                    tuple(int(t) for t in token_ids), finished))

    def propose(self, group_id: str, request_id: str, context: Sequence[int], max_len: int,
                width: int = 1) -> Draft | None:
        return None

    def resume(self, group_id: str, request_id: str, output_token_ids: Sequence[int], epoch: int = 0, *,
               submit_seq: int = 0) -> None:
        # Proposals of these doubles never depend on what was appended or resumed.
        self.calls.append(DraftCall("resume", group_id, request_id, epoch, submit_seq,
                                    token_ids=tuple(int(t) for t in output_token_ids)))

    def end(self, group_id: str, request_id: str, *, epoch: int = 0, submit_seq: int = 0) -> None:
        self.calls.append(DraftCall("end", group_id, request_id, epoch, submit_seq))

    def release_group(self, group_id: str) -> None:
        self.calls.append(DraftCall("release_group", group_id))

    def has_group(self, group_id: str) -> bool:
        return True

    def close(self) -> None:
        pass

    # ---- views of the calls ----------------------------------------------------------------------

    def of(self, method: str) -> list[DraftCall]:
        """The calls of one method, in order."""
        return [c for c in self.calls if c.method == method]

    def named(self) -> list[tuple[str, str, int, int]]:
        """(method, request id, epoch, submit_seq) of every resume, append and end, in order: the
        attempt each call names."""
        return [(c.method, c.request_id, c.epoch, c.submit_seq) for c in self.calls if c.method in _NAMED]


class ChainDraft(RecordingDraft):
    """Proposes the fake engine model's continuation (each token the previous + 1, mod 100), every
    token right (all accepted) except the one at draft position `wrong_at`."""

    def __init__(self, wrong_at: int | None = None) -> None:
        super().__init__()
        self.wrong_at = wrong_at

    def propose(self, group_id: str, request_id: str, context: Sequence[int], max_len: int,
                width: int = 1) -> Draft | None:
        toks, last = [], context[-1]
        for i in range(max_len):
            last = (last + 1) % 100
            toks.append(last if i != self.wrong_at else 0)
        return Draft.chain(toks)


class FixedPlanner:
    """Drafts `n` tokens per request (twice that for a probe); records what it observes."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.observed: list[tuple[list[int], list[int]]] = []

    def observe(self, proposed: Sequence[int], accepted: Sequence[int]) -> None:
        self.observed.append((list(proposed), list(accepted)))

    def plan(self, requests: Sequence[tuple[str, bool]]) -> dict[str, int]:
        return {rid: (self.n * 2 if probe else self.n) for rid, probe in requests}
