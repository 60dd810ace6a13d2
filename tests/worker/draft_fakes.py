"""Test doubles of the worker core's collaborators (services/worker/ports.py): a DraftSource that
drafts nothing (subclass it and override propose) and a planner with a fixed draft length."""

from __future__ import annotations

from collections.abc import Sequence

from services.worker.engine import Draft


class NullDraft:
    """A DraftSource with nothing to draft from: every call but propose is accepted and ignored."""

    def register_attempt(self, group_id: str, prompt_key: str, prompt_token_ids: Sequence[int], group_size: int,
                         ttl_seconds: int, *, request_id: str = "", epoch: int = 0, submit_seq: int = 0) -> None:
        pass

    def append(self, group_id: str, request_id: str, offset: int, token_ids: Sequence[int],
               finished: bool = False, *, epoch: int = 0, submit_seq: int = 0) -> None:
        pass

    def propose(self, group_id: str, request_id: str, context: Sequence[int], max_len: int,
                width: int = 1) -> Draft | None:
        return None

    def resume(self, group_id: str, request_id: str, output_token_ids: Sequence[int], epoch: int = 0, *,
               submit_seq: int = 0) -> None:
        pass  # proposals of these doubles do not depend on appended tokens

    def end(self, group_id: str, request_id: str, *, epoch: int = 0, submit_seq: int = 0) -> None:
        pass

    def release_group(self, group_id: str) -> None:
        pass

    def has_group(self, group_id: str) -> bool:
        return True

    def close(self) -> None:
        pass


class FixedPlanner:
    """Drafts `n` tokens per request (twice that for a probe); records what it observes."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.observed: list[tuple[list[int], list[int]]] = []

    def observe(self, proposed: Sequence[int], accepted: Sequence[int]) -> None:
        self.observed.append((list(proposed), list(accepted)))

    def plan(self, requests: Sequence[tuple[str, bool]]) -> dict[str, int]:
        return {rid: (self.n * 2 if probe else self.n) for rid, probe in requests}
