"""One simulated inference instance: continuous batching with a jump-ahead event model.

Between events nothing changes but contexts growing, so the time of the next event (a request's
chunk ending, or the KV filling up for the baseline engine) is computed analytically: with a
per-step time T(j) = T0 + dT * j (contexts grow by `rate` tokens per step), k steps take
T0 * k + dT * k^2 / 2. Per-request state is vectorised in numpy arrays (swap-remove slots).

The baseline engine behaves like vLLM under veRL: it queues whatever it is given, admits while KV
has room (with a watermark), and when KV runs out preempts the most recently admitted request by
recompute (its KV is dropped; it re-prefills its generated tokens when re-admitted). Its prompt is
not prefilled again once any request of the same prompt was admitted on the instance: the same
prefix-cache rule the chunked policies get in cluster.py (vLLM's and SGLang's prefix caching keep
the shared prompt; the generated tokens of a preempted request are its own and are recomputed).
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass

import numpy as np

from .model import InstanceModel
from .timeline import Timeline

_EPS = 1e-6


@dataclass
class Slot:
    rid: str
    new_tokens: int  # tokens this chunk will produce (min(max_new, remaining true length))
    finished: bool  # the chunk ends the response
    prompt_len: int
    generated: int  # tokens generated before this chunk
    accept: float  # accepted tokens per step when speculating
    # Requests of the same prompt share this key: the baseline engine's prefix cache (see _admit).
    prompt_key: str = ""
    # Admission sequence number on its instance (set by _start): the slots list is reordered by
    # swap-remove, so the newest request is found by this, never by its position.
    admitted: int = -1


class Instance:
    def __init__(
        self, iid: str, model: InstanceModel, timeline: Timeline, *, speculative: bool, engine_admission: bool
    ) -> None:
        self.iid = iid
        self.m = model
        self.timeline = timeline
        self.speculative = speculative
        # engine_admission: the instance queues and preempts itself (baseline); otherwise the
        # scheduler's admission control guarantees every chunk it sends fits.
        self.engine_admission = engine_admission
        cap = model.max_batch
        self.slots: list[Slot] = []
        self.ctx = np.zeros(cap)  # [B] context tokens (prompt + generated so far)
        self.left = np.zeros(cap)  # [B] tokens until the chunk ends
        self.acc = np.zeros(cap)  # [B] accepted tokens per step when speculating
        self.waiting: deque[Slot] = deque()
        self.t = 0.0
        self.stall_until = 0.0
        self.version = 0
        self.spec_now = False
        self.preemptions = 0
        self.prefill_tokens = 0
        self.fetch_tokens = 0
        self.admissions = 0  # slots started so far: the next Slot.admitted
        self.prompts_cached: set[str] = set()  # prompt keys the baseline engine has prefilled here

    @property
    def batch(self) -> int:
        return len(self.slots)

    # ---- state changes --------------------------------------------------------------------

    def add(self, slot: Slot, now: float, prefill_tokens: int, fetch_tokens: int) -> None:
        self.advance(now)
        if self.engine_admission:
            self.waiting.append(slot)
            self._admit(now)
        else:
            self._start(slot, now, prefill_tokens, fetch_tokens)
        self.version += 1

    def _start(self, slot: Slot, now: float, prefill_tokens: int, fetch_tokens: int) -> None:
        i = len(self.slots)
        if i >= self.ctx.shape[0]:
            raise RuntimeError(f"{self.iid}: batch over max_batch {self.m.max_batch}")
        slot.admitted = self.admissions
        self.admissions += 1
        self.slots.append(slot)
        self.ctx[i] = slot.prompt_len + slot.generated
        self.left[i] = slot.new_tokens
        self.acc[i] = slot.accept
        stall = prefill_tokens / self.m.prefill_tps + fetch_tokens / self.m.fetch_tps
        self.prefill_tokens += prefill_tokens
        self.fetch_tokens += fetch_tokens
        self.stall_until = max(self.stall_until, now) + stall
        self._respeculate()

    def _remove(self, i: int) -> Slot:
        last = len(self.slots) - 1
        slot = self.slots[i]
        if i != last:
            self.slots[i] = self.slots[last]
            self.ctx[i], self.left[i], self.acc[i] = self.ctx[last], self.left[last], self.acc[last]
        self.slots.pop()
        return slot

    def _admit(self, now: float) -> None:
        """Baseline engine admission: FIFO while a batch slot and KV (plus a watermark) are free."""
        watermark = 0.01 * self.m.kv_tokens
        used = float(self.ctx[: self.batch].sum())
        while self.waiting and self.batch < self.m.max_batch:
            s = self.waiting[0]
            need = s.prompt_len + s.generated
            if used + need + watermark > self.m.kv_tokens and self.batch > 0:
                break
            self.waiting.popleft()
            used += need
            # Prefix cache: a sibling (or this request before its preemption) already prefilled
            # the prompt here, so only the generated tokens are recomputed.
            cached = s.prompt_len if s.prompt_key and s.prompt_key in self.prompts_cached else 0
            if s.prompt_key:
                self.prompts_cached.add(s.prompt_key)
            self._start(s, now, prefill_tokens=need - cached, fetch_tokens=0)

    def _respeculate(self) -> None:
        b = self.batch
        if not self.speculative or b == 0:
            self.spec_now = False
            return
        self.spec_now = self.m.speculate(b, float(self.ctx[:b].sum()), float(self.acc[:b].mean()))

    # ---- time -----------------------------------------------------------------------------

    def _segment(self) -> tuple[np.ndarray, float, float]:
        """(rate [B] tokens per step, T0 seconds, dT seconds per step) of the current state."""
        b = self.batch
        rate = self.acc[:b] if self.spec_now else np.ones(b)
        t0 = self.m.step_time(b, float(self.ctx[:b].sum()), self.m.gamma if self.spec_now else 0)
        return rate, t0, self.m.c * float(rate.sum())

    def advance(self, t: float) -> None:
        b = self.batch
        start = max(self.t, self.stall_until)
        if b == 0 or t <= start:
            self.t = max(self.t, t)
            return
        rate, t0, dt = self._segment()
        span = t - start
        # Steps j with t0 * j + dt * j^2 / 2 = span.
        j = span / t0 if dt <= 0 else (-t0 + math.sqrt(t0 * t0 + 2 * dt * span)) / dt
        self.ctx[:b] += rate * j
        self.left[:b] -= rate * j
        self.timeline.add_tokens(start, t, float(rate.sum()) * j)
        self.t = t

    def next_event(self) -> float | None:
        b = self.batch
        if b == 0:
            return None
        rate, t0, dt = self._segment()
        k = float(np.min(np.maximum(self.left[:b], 0.0) / rate))
        if self.engine_admission:
            free = self.m.kv_tokens - float(self.ctx[:b].sum())
            k = min(k, max(free, 0.0) / float(rate.sum()))
        start = max(self.t, self.stall_until)
        return start + t0 * k + dt * k * k / 2

    def on_event(self, now: float) -> list[Slot]:
        """Advance to `now`; return the slots whose chunk ended (and handle KV exhaustion)."""
        self.advance(now)
        b = self.batch
        # Descending order keeps swap-remove correct: every index above i is already gone.
        idx = np.nonzero(self.left[:b] <= 1e-4)[0][::-1]
        done = [self._remove(int(i)) for i in idx]
        if self.engine_admission:
            while self.batch > 1 and float(self.ctx[: self.batch].sum()) >= self.m.kv_tokens - _EPS:
                self._preempt()
            self._admit(now)
        self._respeculate()
        self.version += 1
        return done

    def _preempt(self) -> None:
        """Recompute preemption of the most recently admitted request (vLLM's default victim)."""
        # Not slots[-1]: swap-remove of a finished slot moves the last slot into its place.
        i = max(range(self.batch), key=lambda k: self.slots[k].admitted)
        produced = round(float(self.slots[i].new_tokens - self.left[i]))
        s = self._remove(i)
        produced = max(0, min(produced, s.new_tokens - 1))
        s.generated += produced
        s.new_tokens -= produced
        self.waiting.appendleft(s)
        self.preemptions += 1
