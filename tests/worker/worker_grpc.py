"""Reading a RunChunk stream in the worker's gRPC tests (the `served` fixture is in conftest.py)."""

from __future__ import annotations

from typing import Any

from seer.v1 import worker_pb2


def collect(stream: Any) -> tuple[list[int], list[float], worker_pb2.ChunkDone]:
    """(tokens, logprobs, ChunkDone) of a RunChunk stream; no tokens may follow the done event."""
    toks: list[int] = []
    lps: list[float] = []
    done = None
    for msg in stream:
        if msg.WhichOneof("event") == "tokens":
            assert done is None, "tokens after done"
            toks += msg.tokens.token_ids
            lps += msg.tokens.logprobs
        else:
            done = msg.done
    assert done is not None
    return toks, lps, done


def tokens_and_done(stream: Any) -> tuple[list[int], worker_pb2.ChunkDone]:
    toks, _lps, done = collect(stream)
    return toks, done
