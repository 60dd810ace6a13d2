"""Sampling limits every service agrees on (the buffer refuses at submission what workers cannot run)."""

from __future__ import annotations

import struct

# Smallest positive sampling temperature: below ~1e-38 float32 logits / temperature overflow (NaN
# probabilities, garbage tokens), and anything this small is greedy in effect (temperature 0).
# The bound as a float32 holds it (the proto fields are float32): compared with the literal 1e-5, a
# request sending exactly 1e-5 over gRPC (it arrives as 9.99999974738e-06) was refused.
MIN_TEMPERATURE = struct.unpack("<f", struct.pack("<f", 1e-5))[0]
# The highest log-probability a committed token may carry: a log-probability is <= 0, and the
# engines' float32 log-softmax can round a near-certain token a hair above it. The buffer refuses a
# commit over it; the scheduler counts a chunk over it as its worker's fault.
MAX_LOGPROB = 1e-4
