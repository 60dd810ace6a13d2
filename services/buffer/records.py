"""The buffer's domain records (pure dataclasses) and their stored encoding.

Enum values equal the protobuf enum numbers of seer.v1 so the server converts them by value.
"""

from __future__ import annotations

import dataclasses
import enum
import struct
from array import array
from dataclasses import dataclass, field
from typing import Any

from services.buffer import codec
from services.common.chunkstats import ChunkStats


class FinishReason(enum.IntEnum):
    UNSPECIFIED = 0
    STOP = 1
    LENGTH = 2
    ABORTED = 3
    CHUNK = 4


class RequestState(enum.IntEnum):
    UNSPECIFIED = 0
    PENDING = 1
    RUNNING = 2
    FINISHED = 3
    CANCELLED = 4


class BatchState(enum.IntEnum):
    UNSPECIFIED = 0
    RUNNING = 1
    COMPLETED = 2
    CANCELLED = 3


@dataclass(frozen=True)
class Sampling:
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False

    def to_meta(self) -> dict[str, Any]:
        d = dict(self.__dict__)  # shallow: dataclasses.asdict deep-copies and dominates submit time
        d["stop_token_ids"] = list(self.stop_token_ids)
        return d

    @classmethod
    def from_meta(cls, d: dict[str, Any]) -> Sampling:
        return cls(**{**d, "stop_token_ids": tuple(d.get("stop_token_ids", ()))})


@dataclass(frozen=True)
class GroupSpec:
    """One prompt group as the trainer submitted it (before validation and tokenization)."""

    prompt_key: str = ""
    prompt_token_ids: tuple[int, ...] = ()
    prompt_text: str = ""
    group_size: int = 1
    max_tokens: int = 1
    sampling: Sampling = field(default_factory=Sampling)
    labels: tuple[tuple[str, str], ...] = ()  # sorted (key, value) pairs


@dataclass
class BatchRecord:
    batch_id: str
    content_hash: str
    policy_version: int
    created_at: float  # wall clock (survives restarts; latency is measured against it)
    num_groups: int
    num_requests: int
    state: BatchState = BatchState.RUNNING
    num_results: int = 0  # length of the results log == finished requests
    num_cancelled: int = 0
    generated_tokens: int = 0
    finished_at: float = 0.0  # wall clock when the batch became COMPLETED or CANCELLED (retention order)
    # The submitter's trace context (W3C keys), persisted so work items still carry it after a
    # restart; records written before it existed decode to {}.
    trace_context: dict[str, str] = field(default_factory=dict)
    # Submission order (1, 2, ...): a restart lists pending work in it, not in batch-id (key) order,
    # because the scheduler queues requests FIFO in the order it learns of them. 0 = a record
    # written before it existed (ordered by created_at, ahead of every numbered one).
    submit_seq: int = 0
    # The submitter's SubmitBatchRequest.submission_token ("" = none given, or a record written
    # before it existed): a CancelBatch carrying a token cancels only the batch stored with it.
    submission_token: str = ""

    @property
    def terminal(self) -> bool:
        return self.state != BatchState.RUNNING

    def copy(self) -> BatchRecord:
        return dataclasses.replace(self, trace_context=dict(self.trace_context))

    def encode(self) -> bytes:
        d = dict(self.__dict__)
        d["state"] = int(self.state)
        return codec.encode(d)

    @classmethod
    def decode(cls, data: bytes) -> BatchRecord:
        m, _ = codec.decode(data)
        m["state"] = BatchState(m["state"])
        return cls(**m)


@dataclass
class GroupRecord:
    batch_id: str
    group_index: int
    prompt_key: str
    prompt_token_ids: array[int]
    group_size: int
    max_tokens: int
    sampling: Sampling  # seed here is the group's base seed (given or drawn once and persisted)
    labels: dict[str, str]

    @property
    def group_id(self) -> str:
        return f"{self.batch_id}/{self.group_index}"

    def encode(self) -> bytes:
        meta = {
            "batch_id": self.batch_id, "group_index": self.group_index, "prompt_key": self.prompt_key,
            "group_size": self.group_size, "max_tokens": self.max_tokens,
            "sampling": self.sampling.to_meta(), "labels": self.labels,
        }
        return codec.encode(meta, {"prompt": self.prompt_token_ids})

    @classmethod
    def decode(cls, data: bytes) -> GroupRecord:
        m, a = codec.decode(data)
        return cls(
            batch_id=m["batch_id"], group_index=m["group_index"], prompt_key=m["prompt_key"],
            prompt_token_ids=a["prompt"], group_size=m["group_size"], max_tokens=m["max_tokens"],
            sampling=Sampling.from_meta(m["sampling"]), labels=m["labels"],
        )


@dataclass
class RequestRecord:
    batch_id: str
    group_index: int
    sample_index: int
    seed: int  # this request's own seed, derived from the group's base seed and sample_index
    state: RequestState = RequestState.PENDING
    next_seq: int = 0
    generated: int = 0
    finish_reason: FinishReason = FinishReason.UNSPECIFIED
    stats: ChunkStats = field(default_factory=ChunkStats)
    result_index: int = -1  # position in the batch's results log once finished

    @property
    def request_id(self) -> str:
        return f"{self.batch_id}/{self.group_index}/{self.sample_index}"

    @property
    def group_id(self) -> str:
        return f"{self.batch_id}/{self.group_index}"

    @property
    def active(self) -> bool:
        return self.state in (RequestState.PENDING, RequestState.RUNNING)

    def copy(self) -> RequestRecord:
        return dataclasses.replace(self, stats=self.stats.copy())

    # Request records are written on every commit and 65536 at a time on submit: a fixed struct
    # instead of JSON (about 20x cheaper to encode).
    _HEAD = struct.Struct("<3sHIIQBIIBi")
    _STATS = struct.Struct("<iiiiiidi")
    _MAGIC = b"RQ1"

    def encode(self) -> bytes:
        bid = self.batch_id.encode()
        st = self.stats
        return b"".join((
            self._HEAD.pack(self._MAGIC, len(bid), self.group_index, self.sample_index, self.seed, int(self.state),
                            self.next_seq, self.generated, int(self.finish_reason), self.result_index),
            bid,
            self._STATS.pack(st.prefill_tokens, st.cached_tokens, st.kv_loaded_tokens, st.draft_tokens,
                             st.accepted_tokens, st.steps, st.wall_seconds, st.kv_recomputed_pages),
        ))

    @classmethod
    def decode(cls, data: bytes) -> RequestRecord:
        magic, n, gi, si, seed, state, next_seq, generated, reason, result_index = cls._HEAD.unpack_from(data, 0)
        if magic != cls._MAGIC:
            raise ValueError("not a request record (bad magic)")
        pos = cls._HEAD.size
        bid = data[pos : pos + n].decode()
        stats = ChunkStats(*cls._STATS.unpack_from(data, pos + n))
        return cls(bid, gi, si, seed, RequestState(state), next_seq, generated, FinishReason(reason), stats,
                   result_index)


@dataclass
class ChunkRecord:
    """One committed chunk; kept so a retried commit can be compared bit for bit."""

    token_ids: array[int]
    logprobs: array[float]
    finish_reason: FinishReason
    worker_id: str = ""

    def same_content(self, other: ChunkRecord) -> bool:
        return (self.finish_reason == other.finish_reason and self.token_ids == other.token_ids
                and self.logprobs.tobytes() == other.logprobs.tobytes())

    def encode(self) -> bytes:
        meta = {"finish_reason": int(self.finish_reason), "worker_id": self.worker_id}
        return codec.encode(meta, {"t": self.token_ids, "l": self.logprobs})

    @classmethod
    def decode(cls, data: bytes) -> ChunkRecord:
        m, a = codec.decode(data)
        return cls(a["t"], a["l"], FinishReason(m["finish_reason"]), m.get("worker_id", ""))


@dataclass
class RolloutResult:
    request_id: str
    batch_id: str
    group_index: int
    sample_index: int
    prompt_key: str
    token_ids: array[int]
    logprobs: array[float]
    finish_reason: FinishReason
    policy_version: int
    stats: ChunkStats
    num_chunks: int
    latency_seconds: float
    labels: dict[str, str]
    text: str = ""
    # Cumulative token count at the end of each chunk, and the last chunk's finish reason as committed:
    # enough to recognize a retried commit of a finished request after its chunk records are dropped.
    chunk_ends: list[int] = field(default_factory=list)
    last_chunk_reason: FinishReason = FinishReason.UNSPECIFIED

    def chunk(self, seq: int) -> ChunkRecord:
        """Chunk `seq` as it was committed."""
        start = self.chunk_ends[seq - 1] if seq > 0 else 0
        end = self.chunk_ends[seq]
        reason = self.last_chunk_reason if seq == len(self.chunk_ends) - 1 else FinishReason.CHUNK
        return ChunkRecord(self.token_ids[start:end], self.logprobs[start:end], reason)

    def encode(self) -> bytes:
        meta = {
            "chunk_ends": self.chunk_ends, "last_chunk_reason": int(self.last_chunk_reason),
            "request_id": self.request_id, "batch_id": self.batch_id, "group_index": self.group_index,
            "sample_index": self.sample_index, "prompt_key": self.prompt_key,
            "finish_reason": int(self.finish_reason), "policy_version": self.policy_version,
            "stats": self.stats.to_meta(), "num_chunks": self.num_chunks,
            "latency_seconds": self.latency_seconds, "labels": self.labels, "text": self.text,
        }
        return codec.encode(meta, {"t": self.token_ids, "l": self.logprobs})

    @classmethod
    def decode(cls, data: bytes) -> RolloutResult:
        m, a = codec.decode(data)
        m["finish_reason"] = FinishReason(m["finish_reason"])
        m["last_chunk_reason"] = FinishReason(m.get("last_chunk_reason", 0))
        m["stats"] = ChunkStats.from_meta(m["stats"])
        return cls(token_ids=a["t"], logprobs=a["l"], **m)


@dataclass
class HistoryIteration:
    """The finished responses of one batch for one prompt key (RhymeRL history)."""

    batch_id: str
    policy_version: int
    lengths: list[int]
    token_ids: list[array[int]]

    def to_parts(self, idx: int) -> tuple[dict[str, Any], dict[str, array[Any]]]:
        meta = {"batch_id": self.batch_id, "policy_version": self.policy_version, "lengths": self.lengths}
        flat = codec.i32()
        for t in self.token_ids:
            flat.extend(t)
        return meta, {f"t{idx}": flat}


def encode_history(iterations: list[HistoryIteration]) -> bytes:
    metas, arrays = [], {}
    for i, it in enumerate(iterations):
        m, a = it.to_parts(i)
        metas.append(m)
        arrays.update(a)
    return codec.encode({"iterations": metas}, arrays)


def decode_history(data: bytes) -> list[HistoryIteration]:
    m, a = codec.decode(data)
    out = []
    for i, it in enumerate(m["iterations"]):
        flat, pos, toks = a[f"t{i}"], 0, []
        for n in it["lengths"]:
            toks.append(flat[pos : pos + n])
            pos += n
        out.append(HistoryIteration(it["batch_id"], it["policy_version"], list(it["lengths"]), toks))
    return out
