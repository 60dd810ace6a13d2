"""The text of a weight switch that failed on workers: one line a user reads once.

Each worker's error is a peer status as links.translate renders it ("INVALID_ARGUMENT: source:
/ckpt/config.json not found ..."), and every worker usually fails alike. Joined as a dict's repr, a
bad source read "from it: {'worker-1': 'INVALID_ARGUMENT: source: ...', 'worker-0': <the same>}"
inside the scheduler's own "source: ..." and the buffer's "INVALID_ARGUMENT: source: ...": the code
and field three times over. Here identical errors are told once with the workers that met them,
without the code and field the enclosing error already carries. Pure (no grpc)."""

from __future__ import annotations

import re
from collections.abc import Mapping

# Enough to see every way the workers failed in a usual suite; the rest are counted (a status's
# details travel in a trailer, which gRPC bounds to a few KiB).
MAX_NAMED_ERRORS = 8
MAX_NAMED_WORKERS = 8
# Each error's text is cut to this many characters: the count caps alone left the size unbounded (a
# long source path in every error), and details past gRPC's 8 KiB metadata limit turned a refusal
# into UNAVAILABLE "received metadata size exceeds soft/hard limit" at the buffer (the outcome
# unknown: submissions held). 8 errors x (400 + 8 worker ids) stays well under it.
MAX_ERROR_CHARS = 400

_CODE = re.compile(r"[A-Z][A-Z_]*: ")


def strip_carried(text: str, code: str, field: str | None) -> str:
    """`text` without the leading "CODE: " and then "field: " that an error re-wrapping it (with
    that code and field) says itself; a different code or field stays, it tells something."""
    m = _CODE.match(text)
    if m and m.group(0)[:-2] == code:
        text = text[m.end():]
    elif m:
        return text  # another code: its field is that status's, not the wrapper's
    if field and text.startswith(f"{field}: "):
        text = text[len(field) + 2:]
    return text


def clip(text: str, limit: int = MAX_ERROR_CHARS) -> str:
    """`text` cut to `limit` characters, the cut said (" ... (N more characters)")."""
    return text if len(text) <= limit else f"{text[:limit]} ... ({len(text) - limit} more characters)"


def _workers(ids: list[str]) -> str:
    rest = len(ids) - MAX_NAMED_WORKERS
    return ", ".join(ids[:MAX_NAMED_WORKERS]) + (f" and {rest} more" if rest > 0 else "")


def worker_errors_text(errors: Mapping[str, str], code: str, field: str | None) -> str:
    """Each distinct error once, with the workers (sorted) that met it: "<error> (worker-0,
    worker-1); <other error> (worker-2)", the code and field the enclosing error (`code`, `field`)
    carries stripped from each (strip_carried). Bounded: MAX_NAMED_ERRORS distinct errors and
    MAX_NAMED_WORKERS workers each, the rest counted."""
    by_text: dict[str, list[str]] = {}
    for worker_id in sorted(errors):
        by_text.setdefault(clip(strip_carried(errors[worker_id], code, field)), []).append(worker_id)
    parts = [f"{text} ({_workers(ids)})" for text, ids in list(by_text.items())[:MAX_NAMED_ERRORS]]
    rest = len(by_text) - MAX_NAMED_ERRORS
    if rest > 0:
        parts.append(f"{rest} other error(s) ({sum(len(ids) for ids in list(by_text.values())[MAX_NAMED_ERRORS:])} "
                     "worker(s))")
    return "; ".join(parts)
