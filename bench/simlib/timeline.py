"""Time-binned cluster metrics of one simulated run (for the plots)."""

from __future__ import annotations

import numpy as np


class Timeline:
    def __init__(self, bin_seconds: float) -> None:
        self.bin = bin_seconds
        self.tokens = np.zeros(1024)

    def _grow(self, n: int) -> None:
        if n > self.tokens.shape[0]:
            bigger = np.zeros(max(n, 2 * self.tokens.shape[0]))
            bigger[: self.tokens.shape[0]] = self.tokens
            self.tokens = bigger

    def add_tokens(self, t0: float, t1: float, tokens: float) -> None:
        """Spread `tokens` uniformly over [t0, t1)."""
        if tokens <= 0 or t1 <= t0:
            return
        b0, b1 = int(t0 // self.bin), int(t1 // self.bin)
        self._grow(b1 + 1)
        if b0 == b1:
            self.tokens[b0] += tokens
            return
        rate = tokens / (t1 - t0)
        self.tokens[b0] += rate * ((b0 + 1) * self.bin - t0)
        self.tokens[b0 + 1 : b1] += rate * self.bin
        self.tokens[b1] += rate * (t1 - b1 * self.bin)

    def throughput(self, until: float) -> tuple[np.ndarray, np.ndarray]:
        """(bin start times, tokens/s) up to `until`."""
        n = int(until // self.bin) + 1
        self._grow(n)
        return np.arange(n) * self.bin, self.tokens[:n] / self.bin
