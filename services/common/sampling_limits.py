"""Sampling limits every service agrees on (the buffer refuses at submission what workers cannot run)."""

from __future__ import annotations

# Smallest positive sampling temperature: below ~1e-38 float32 logits / temperature overflow (NaN
# probabilities, garbage tokens), and anything this small is greedy in effect (temperature 0).
MIN_TEMPERATURE = 1e-5
