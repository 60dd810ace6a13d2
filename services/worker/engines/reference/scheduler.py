"""Continuous batching: which requests run in the next step.

Requests join between steps: the waiting queue is admitted in FIFO order while the batch has room
and the KV cache has pages for the request's whole call (prefix + max_new_tokens). A request that
does not fit waits; nothing running is ever preempted (admission control, DESIGN.md section 4). A
step decodes every running request and prefills the newly admitted ones in the same forward pass.
"""

from __future__ import annotations

from collections import deque

from services.worker.engines.reference.block_manager import BlockManager
from services.worker.engines.reference.config import EngineConfig
from services.worker.engines.reference.sequence import SeqStatus, Sequence


class Scheduler:
    def __init__(self, config: EngineConfig, blocks: BlockManager) -> None:
        self.config = config
        self.blocks = blocks
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.by_id: dict[str, Sequence] = {}

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)
        self.by_id[seq.request_id] = seq

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> tuple[list[Sequence], list[Sequence]]:
        """(sequences of this step, the newly admitted ones among them).

        A step runs every running request plus the newly admitted ones (their prefill): new
        requests never stall the decoding of the others."""
        admitted: list[Sequence] = []
        budget = self.config.max_prefill_tokens
        while self.waiting and len(self.running) + len(admitted) < self.config.max_batch_size:
            seq = self.waiting[0]
            _, usable, _ = self.blocks.plan(seq)
            cost = len(seq) - usable * self.blocks.page_size
            if admitted and cost > budget:
                break
            if not self.blocks.can_allocate(seq):
                break  # FIFO: the head waits for pages; later requests do not overtake it
            self.waiting.popleft()
            self.blocks.allocate(seq)
            seq.status = SeqStatus.RUNNING
            admitted.append(seq)
            budget -= len(seq) - seq.num_computed
        self.running.extend(admitted)
        return list(self.running), admitted

    def unadmit(self, admitted: list[Sequence]) -> None:
        """Rolls back the admission of `admitted` (a step that failed before any of its KV was
        committed): their pages are freed and unregistered and they wait again, at the head of the
        queue in their original order. Requests running before the step are untouched: a failed
        step changed nothing of theirs that the next step does not recompute."""
        for seq in reversed(admitted):
            if seq in self.running:
                self.running.remove(seq)
            self.blocks.unallocate(seq)
            seq.status = SeqStatus.WAITING
            self.waiting.appendleft(seq)

    def finish(self, seq: Sequence) -> None:
        seq.status = SeqStatus.FINISHED
        self.blocks.free_seq(seq)
        self.running.remove(seq)
        self.by_id.pop(seq.request_id, None)

    def abort(self, request_id: str) -> Sequence | None:
        seq = self.by_id.pop(request_id, None)
        if seq is None:
            return None
        if seq.status == SeqStatus.WAITING:
            self.waiting.remove(seq)
        elif seq.status == SeqStatus.RUNNING:
            self.blocks.free_seq(seq)
            self.running.remove(seq)
        seq.status = SeqStatus.FINISHED
        return seq
