"""One request inside the engine: its tokens, its pages and its progress in the current call."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

import numpy as np

from services.worker.engine import FinishReason, GenerateRequest, SamplingParams


class SeqStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class Sequence:
    request_id: str
    group_id: str
    token_ids: list[int]  # prompt + earlier output + output of this call
    num_prompt_tokens: int  # the prompt proper (output positions are counted after it)
    num_prior_output: int  # output tokens from earlier calls (resume)
    max_new_tokens: int  # for this call
    sampling: SamplingParams
    seed: int
    stop_ids: frozenset[int]
    status: SeqStatus = SeqStatus.WAITING
    # Paged KV: block_table[i] holds tokens [i*page_size, (i+1)*page_size). Allocated for the whole
    # call at admission (prefix + max_new_tokens), so a running request never needs more pages.
    block_table: list[int] = field(default_factory=list)
    block_array: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    page_hashes: list[bytes] = field(default_factory=list)  # chained hashes of registered full pages
    num_computed: int = 0  # tokens whose KV is in the cache (always len(token_ids) - 1 after a step)
    num_cached_at_admit: int = 0
    num_generated: int = 0  # in this call
    finish_reason: FinishReason | None = None

    @classmethod
    def from_request(cls, req: GenerateRequest, seed: int, eos_ids: tuple[int, ...]) -> Sequence:
        stop = set(req.sampling.stop_token_ids)
        if not req.sampling.ignore_eos:
            stop.update(eos_ids)
        return cls(
            request_id=req.request_id,
            group_id=req.group_id,
            token_ids=[*req.prompt_token_ids, *req.output_token_ids],
            num_prompt_tokens=len(req.prompt_token_ids),
            num_prior_output=len(req.output_token_ids),
            max_new_tokens=req.max_new_tokens,
            sampling=req.sampling,
            seed=seed,
            stop_ids=frozenset(stop),
        )

    def __len__(self) -> int:
        return len(self.token_ids)

    @property
    def capacity(self) -> int:
        """Tokens the allocated pages can hold: the prefix at admission plus max_new_tokens."""
        return len(self.token_ids) - self.num_generated + self.max_new_tokens

    @property
    def remaining(self) -> int:
        return self.max_new_tokens - self.num_generated

    @property
    def next_output_position(self) -> int:
        """Output index of the next sampled token; the sampling RNG is keyed by it."""
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_this_call(self) -> list[int]:
        return self.token_ids[len(self.token_ids) - self.num_generated :]
