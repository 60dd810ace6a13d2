"""argparse types shared by the `seer` commands. A bad value is refused while the command line is
parsed, by its flag ("seer up: error: argument --timeout: must be a positive number of seconds, got
nan", exit status 2), before a model is loaded or a suite started, and never by the name of the
library argument it ends up in (the client's retry_seconds, a batch's groups[0].group_size)."""

from __future__ import annotations

import argparse
from collections.abc import Callable


def positive_seconds(text: str) -> float:
    """A timeout in seconds: > 0 (infinity allowed: no deadline). NaN is refused: every deadline
    comparison with it is False, so it would never time out."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a positive number of seconds, got {text!r}") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be a positive number of seconds, got {value}")
    return value


def positive_int(text: str) -> int:
    """A count that must be at least 1 (workers, samples per prompt, tokens)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an integer of at least 1, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def int_list(minimum: int | None = None) -> Callable[[str], tuple[int, ...]]:
    """An argparse type: a comma-separated list of integers, sorted, each once (`--cpus 3,1`,
    `--batch-sizes 1,2,4`). argparse names the flag in the error ("argument --cpus: ..."), instead
    of a ValueError traceback from int() after the flags were parsed. minimum: the smallest value
    allowed (None = any)."""

    def parse(text: str) -> tuple[int, ...]:
        try:
            values = tuple(sorted({int(x) for x in text.split(",") if x.strip()}))
        except ValueError:
            raise argparse.ArgumentTypeError(f"need comma-separated integers, got {text!r}") from None
        if minimum is not None and any(v < minimum for v in values):
            raise argparse.ArgumentTypeError(f"each must be at least {minimum}, got {text!r}")
        return values

    return parse
