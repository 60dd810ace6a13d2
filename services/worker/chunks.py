"""Chunk jobs (one dispatch of divided rollout) and the events a running chunk streams."""

from __future__ import annotations

import enum
from dataclasses import dataclass

from services.common.chunkstats import ChunkStats
from services.worker.engine import SamplingParams


class ChunkFinish(enum.Enum):
    STOP = "stop"  # a stop/EOS token: the response is complete
    LENGTH = "length"  # the request's total max_tokens reached: the response is complete
    CHUNK = "chunk"  # only this chunk's limit was reached: the request continues elsewhere
    ABORTED = "aborted"


@dataclass(frozen=True)
class ChunkJob:
    request_id: str
    prompt_token_ids: tuple[int, ...]
    max_new_tokens: int
    max_tokens: int  # total new-token limit of the request (0 = this chunk is the whole request)
    sampling: SamplingParams
    policy_version: int
    output_token_ids: tuple[int, ...] = ()
    batch_id: str = ""
    group_id: str = ""
    prompt_key: str = ""
    seq: int = 0
    is_probe: bool = False
    group_size: int = 1
    fetch_kv: bool = False
    dispatch_epoch: int = 0  # orders the request's attempts (RunChunkRequest.dispatch_epoch; 0 = unordered)
    # The buffer's submission of the batch (RunChunkRequest.submit_seq; 0 = unknown): registered with
    # the draft group, it tells a resubmitted batch id's new run from a retry of the old run.
    submit_seq: int = 0


@dataclass(frozen=True)
class TokensEvent:
    token_ids: list[int]
    logprobs: list[float]


@dataclass(frozen=True)
class DoneEvent:
    finish: ChunkFinish
    stats: ChunkStats
    policy_version: int


@dataclass(frozen=True)
class ErrorEvent:
    error: Exception


ChunkEvent = TokensEvent | DoneEvent | ErrorEvent
