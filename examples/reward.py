"""Verifiable reward for the arithmetic prompt set: 1.0 when the last number in the response equals
the reference answer, else 0.0. Pure and reward-agnostic of Seer (the client never calls it)."""

from __future__ import annotations

import re

_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")


def extract_last_number(text: str) -> float | None:
    """The last number in text ("1,234" -> 1234, "-3.5" -> -3.5), or None."""
    matches = _NUMBER.findall(text)
    if not matches:
        return None
    try:
        return float(matches[-1].replace(",", ""))
    except ValueError:
        return None


def reward(response_text: str, answer: str | float | int) -> float:
    got = extract_last_number(response_text)
    if got is None:
        return 0.0
    try:
        expected = float(str(answer).replace(",", ""))
    except ValueError:
        return 0.0
    return 1.0 if abs(got - expected) < 1e-6 else 0.0


if __name__ == "__main__":
    import sys

    print(reward(sys.argv[1], sys.argv[2]))
