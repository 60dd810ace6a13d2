"""The buffer's domain records (pure dataclasses) and their stored encoding.

Enum values equal the protobuf enum numbers of seer.v1 so the server converts them by value.

Decoding reads each field by name and checks its type (_Fields): a required field missing or of the
wrong type, or a value that is no record at all, is RecordError naming the RocksDB key and the field
(it was a bare TypeError from `cls(**m)`). A field this buffer does not know is ignored with one
warning per field name: within a store format (store.STORE_FORMAT) a newer buffer adds only fields
an older one may ignore; a change an older buffer would misread bumps the format, and the store is
then refused at open (README "Storage format").
"""

from __future__ import annotations

import dataclasses
import enum
import logging
import struct
from array import array
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from services.buffer import codec
from services.common.chunkstats import ChunkStats
from services.common.errors import DataLoss
from services.common.log import kv

log = logging.getLogger(__name__)

_E = TypeVar("_E", bound=enum.IntEnum)


class RecordError(DataLoss):
    """A stored record this buffer cannot decode: names the RocksDB key and the field ("" when the
    value as a whole is unreadable), so an operator can find it with any RocksDB tool."""

    def __init__(self, key: bytes, record_field: str, problem: str) -> None:
        self.key = key
        self.record_field = record_field
        where = f" field {record_field!r}" if record_field else ""
        super().__init__(f"stored record {key.decode(errors='backslashreplace')!r}{where}: {problem}")


# (what the field must be, in words; the test). type() rather than isinstance: a JSON bool is no
# integer here, and an int is no string.
_Check = tuple[str, Callable[[Any], bool]]
_INT: _Check = ("an integer", lambda v: type(v) is int)
_NUM: _Check = ("a number", lambda v: type(v) in (int, float))
_STR: _Check = ("a string", lambda v: type(v) is str)
_INT_LIST: _Check = ("a list of integers", lambda v: type(v) is list and all(type(x) is int for x in v))
_STR_MAP: _Check = ("an object of strings", lambda v: type(v) is dict and all(type(x) is str for x in v.values()))
_OBJ: _Check = ("an object", lambda v: type(v) is dict)
_LIST: _Check = ("a list", lambda v: type(v) is list)

# Fields a submission stored as the in-process caller gave them before validation made them their
# types (validation._typed_group, _typed_sampling): ignore_eos=1, seed=3.0, top_k=True. Such a record
# was accepted, so it must recover: read as the value it meant (int(), bool()), but only
# these spellings of it (a fraction or a string is still a RecordError).
_INTEGRAL: _Check = ("an integer", lambda v: type(v) in (int, bool) or (type(v) is float and v.is_integer()))
_OPT_INTEGRAL: _Check = ("an integer or null", lambda v: v is None or _INTEGRAL[1](v))
_INTEGRAL_LIST: _Check = ("a list of integers", lambda v: type(v) is list and all(_INTEGRAL[1](x) for x in v))
_ANY_NUM: _Check = ("a number", lambda v: type(v) in (int, float, bool))
_BOOLISH: _Check = ("a boolean", lambda v: type(v) is bool or (type(v) in (int, float) and v in (0, 1)))

# "<record kind>.<field>" already warned about: one warning per unknown field name, not one per record
# (recovery reads every batch record; a field on all of them would otherwise log once each).
_warned_unknown: set[str] = set()


def _warn_unknown(kind: str, name: str, key: bytes) -> None:
    tag = f"{kind}.{name}"
    if tag in _warned_unknown:
        return
    _warned_unknown.add(tag)
    log.warning("stored record has a field this buffer does not know (written by a newer buffer?); ignored",
                extra=kv(record=kind, field=name, key=key.decode(errors="backslashreplace")))


def _decode(data: bytes, key: bytes) -> tuple[dict[str, Any], dict[str, array[Any]]]:
    """codec.decode, its failures (bad magic, a cut value, a header that is not JSON) as RecordError."""
    try:
        return codec.decode(data)
    except (ValueError, KeyError, TypeError, struct.error) as e:
        raise RecordError(key, "", f"not a readable record: {e}") from None


class _Fields:
    """One stored record's JSON fields (and arrays), read by name: required ones must be there,
    every one read must have its type; done() warns about those never read (unknown here)."""

    def __init__(self, kind: str, key: bytes, meta: Any, arrays: dict[str, array[Any]] | None = None,
                 prefix: str = "") -> None:
        if type(meta) is not dict:
            raise RecordError(key, prefix.rstrip("."), f"{_OBJ[0]} expected, got {type(meta).__name__}")
        self.kind = kind
        self.key = key
        self._meta: dict[str, Any] = meta
        self._arrays = arrays or {}
        self._prefix = prefix
        self._seen: set[str] = set()
        self._seen_arrays: set[str] = set()

    def _checked(self, name: str, check: _Check) -> Any:
        value = self._meta[name]
        if not check[1](value):
            raise RecordError(self.key, self._prefix + name,
                              f"{check[0]} expected, got {type(value).__name__} {str(value)[:60]}")
        return value

    def req(self, name: str, check: _Check) -> Any:
        self._seen.add(name)
        if name not in self._meta:
            raise RecordError(self.key, self._prefix + name, "missing (a required field)")
        return self._checked(name, check)

    def opt(self, name: str, check: _Check, default: Any) -> Any:
        """A field records written before it existed lack: `default` then."""
        self._seen.add(name)
        if name not in self._meta:
            return default
        return self._checked(name, check)

    def enum(self, name: str, cls: type[_E], default: _E | None = None) -> _E:
        """An enum stored as its number (required when no default is given). A number this buffer
        does not know is an error, not skipped: a newer buffer's new state would be misread."""
        value = self.req(name, _INT) if default is None else self.opt(name, _INT, int(default))
        try:
            return cls(value)
        except ValueError:
            raise RecordError(self.key, self._prefix + name, f"{value} is not a {cls.__name__}") from None

    def sub(self, name: str, check: _Check = _OBJ, default: Any = None) -> _Fields:
        """A nested object (required when default is None), read field by field like this one."""
        value = self.req(name, check) if default is None else self.opt(name, check, default)
        return _Fields(self.kind, self.key, value, prefix=f"{self._prefix}{name}.")

    def array(self, name: str, typecode: str) -> array[Any]:
        self._seen_arrays.add(name)
        a = self._arrays.get(name)
        if a is None:
            raise RecordError(self.key, name, "missing (a required array)")
        if a.typecode != typecode:
            raise RecordError(self.key, name, f"array of type {typecode!r} expected, got {a.typecode!r}")
        return a

    def done(self) -> None:
        for name in sorted(self._meta.keys() - self._seen):
            _warn_unknown(self.kind, self._prefix + name, self.key)
        for name in sorted(self._arrays.keys() - self._seen_arrays):
            _warn_unknown(self.kind, f"arrays.{name}", self.key)


def _read_stats(f: _Fields) -> ChunkStats:
    """ChunkStats from its stored object: every field defaults to 0 (records written before a field
    existed lack it); a float default makes the field a number, an int one an integer."""
    values: dict[str, Any] = {}
    for fl in dataclasses.fields(ChunkStats):
        if isinstance(fl.default, float):
            values[fl.name] = float(f.opt(fl.name, _NUM, fl.default))
        else:
            values[fl.name] = f.opt(fl.name, _INT, fl.default)
    f.done()
    return ChunkStats(**values)


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
    def read(cls, f: _Fields) -> Sampling:
        """From its stored object; a field records written before it existed lack gets its default.
        Odd types an older buffer stored from in-process callers are read as what they meant
        (_INTEGRAL, _BOOLISH)."""
        d = cls()
        seed = f.opt("seed", _OPT_INTEGRAL, d.seed)
        out = cls(temperature=float(f.opt("temperature", _ANY_NUM, d.temperature)),
                  top_p=float(f.opt("top_p", _ANY_NUM, d.top_p)), top_k=int(f.opt("top_k", _INTEGRAL, d.top_k)),
                  seed=None if seed is None else int(seed),
                  stop_token_ids=tuple(int(t) for t in f.opt("stop_token_ids", _INTEGRAL_LIST, [])),
                  ignore_eos=bool(f.opt("ignore_eos", _BOOLISH, d.ignore_eos)))
        f.done()
        return out


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
    def decode(cls, data: bytes, *, key: bytes) -> BatchRecord:
        f = _Fields("BatchRecord", key, *_decode(data, key))
        rec = cls(
            batch_id=f.req("batch_id", _STR), content_hash=f.req("content_hash", _STR),
            policy_version=f.req("policy_version", _INT), created_at=float(f.req("created_at", _NUM)),
            num_groups=f.req("num_groups", _INT), num_requests=f.req("num_requests", _INT),
            state=f.enum("state", BatchState, BatchState.RUNNING), num_results=f.opt("num_results", _INT, 0),
            num_cancelled=f.opt("num_cancelled", _INT, 0), generated_tokens=f.opt("generated_tokens", _INT, 0),
            finished_at=float(f.opt("finished_at", _NUM, 0.0)),
            trace_context=dict(f.opt("trace_context", _STR_MAP, {})), submit_seq=f.opt("submit_seq", _INT, 0),
            submission_token=f.opt("submission_token", _STR, ""),
        )
        f.done()
        return rec


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
    def decode(cls, data: bytes, *, key: bytes) -> GroupRecord:
        f = _Fields("GroupRecord", key, *_decode(data, key))
        rec = cls(
            batch_id=f.req("batch_id", _STR), group_index=f.req("group_index", _INT),
            prompt_key=f.req("prompt_key", _STR), prompt_token_ids=f.array("prompt", "i"),
            group_size=int(f.req("group_size", _INTEGRAL)), max_tokens=int(f.req("max_tokens", _INTEGRAL)),
            sampling=Sampling.read(f.sub("sampling")), labels=dict(f.req("labels", _STR_MAP)),
        )
        f.done()
        return rec


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
    def decode(cls, data: bytes, *, key: bytes) -> RequestRecord:
        # A fixed struct, not named fields: its magic is its version (a layout an older buffer
        # would misread gets a new magic and a new store format); bytes after it are ignored.
        try:
            magic, n, gi, si, seed, state, next_seq, generated, reason, result_index = cls._HEAD.unpack_from(data, 0)
            if magic != cls._MAGIC:
                raise RecordError(key, "", f"not a request record (magic {magic!r}, expected {cls._MAGIC!r})")
            pos = cls._HEAD.size
            bid = data[pos : pos + n].decode()
            stats = ChunkStats(*cls._STATS.unpack_from(data, pos + n))
        except (struct.error, UnicodeDecodeError) as e:
            raise RecordError(key, "", f"not a readable request record: {e}") from None
        try:
            st = RequestState(state)
        except ValueError:
            raise RecordError(key, "state", f"{state} is not a RequestState") from None
        try:
            fr = FinishReason(reason)
        except ValueError:
            raise RecordError(key, "finish_reason", f"{reason} is not a FinishReason") from None
        return cls(bid, gi, si, seed, st, next_seq, generated, fr, stats, result_index)


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
    def decode(cls, data: bytes, *, key: bytes) -> ChunkRecord:
        f = _Fields("ChunkRecord", key, *_decode(data, key))
        rec = cls(f.array("t", "i"), f.array("l", "f"), f.enum("finish_reason", FinishReason),
                  f.opt("worker_id", _STR, ""))
        f.done()
        return rec


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
    def decode(cls, data: bytes, *, key: bytes) -> RolloutResult:
        f = _Fields("RolloutResult", key, *_decode(data, key))
        rec = cls(
            request_id=f.req("request_id", _STR), batch_id=f.req("batch_id", _STR),
            group_index=f.req("group_index", _INT), sample_index=f.req("sample_index", _INT),
            prompt_key=f.req("prompt_key", _STR), token_ids=f.array("t", "i"), logprobs=f.array("l", "f"),
            finish_reason=f.enum("finish_reason", FinishReason), policy_version=f.req("policy_version", _INT),
            stats=_read_stats(f.sub("stats")), num_chunks=f.req("num_chunks", _INT),
            latency_seconds=float(f.req("latency_seconds", _NUM)), labels=dict(f.req("labels", _STR_MAP)),
            text=f.opt("text", _STR, ""), chunk_ends=f.opt("chunk_ends", _INT_LIST, []),
            last_chunk_reason=f.enum("last_chunk_reason", FinishReason, FinishReason.UNSPECIFIED),
        )
        f.done()
        return rec


# Responses one history iteration of a prompt key keeps: at most max(this, the newest batch's count
# of the key) — the newest batch's responses are kept whole, and older ones of the version fill up
# to this many, none beyond (merge_iteration). The draft service's bound
# (services/draft/history.py HISTORY_ITERATION_RESPONSES). An iteration is a policy version, and every
# batch of the key at that version merges into it: a loop that never updates the weights (a
# benchmark, an evaluation) runs every batch at one version, and without a bound that iteration, one
# RocksDB value rewritten whole at every completing batch, grew for ever. The oldest go first.
HISTORY_ITERATION_RESPONSES = 64


@dataclass
class HistoryIteration:
    """The finished responses of one policy version for one prompt key (RhymeRL history): every
    batch of the key at that version, the oldest responses first (merge_iteration). batch_id: the
    newest batch merged into it (an older buffer stored one iteration per batch: by_version)."""

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


def decode_history(data: bytes, *, key: bytes) -> list[HistoryIteration]:
    f = _Fields("HistoryIteration", key, *_decode(data, key))
    iterations = f.req("iterations", _LIST)
    out = []
    for i, raw in enumerate(iterations):
        it = _Fields("HistoryIteration", key, raw, prefix=f"iterations[{i}].")
        lengths = it.req("lengths", _INT_LIST)
        flat, pos, toks = f.array(f"t{i}", "i"), 0, []
        if sum(lengths) != len(flat) or min(lengths, default=0) < 0:
            raise RecordError(key, f"iterations[{i}].lengths",
                              f"lengths summing to {sum(lengths)} for {len(flat)} stored tokens")
        for n in lengths:
            toks.append(flat[pos : pos + n])
            pos += n
        out.append(HistoryIteration(it.req("batch_id", _STR), it.req("policy_version", _INT), list(lengths), toks))
        it.done()
    f.done()
    return out


def merge_iteration(older: HistoryIteration, newer: HistoryIteration, cap: int) -> HistoryIteration:
    """One iteration of one version: `newer`'s responses after `older`'s. Over `cap` responses the
    oldest go, never `newer`'s (a batch's responses to a key are kept whole, as before): lengths
    and token ids stay paired (GetHistory sends the responses in the order of the lengths)."""
    lengths = [*older.lengths, *newer.lengths]
    token_ids = [*older.token_ids, *newer.token_ids]
    excess = len(lengths) - max(cap, len(newer.lengths))
    if excess > 0:
        del lengths[:excess], token_ids[:excess]
    return HistoryIteration(newer.batch_id, newer.policy_version, lengths, token_ids)


def by_version(iterations: list[HistoryIteration], cap: int) -> list[HistoryIteration]:
    """A key's stored iterations as policy versions, newest version first: iterations of one
    version merge (merge_iteration). A buffer before this one stored one iteration per batch,
    newest first, so a version that ran several batches of the key is several iterations in its
    records: read here as the one iteration they are now (the store format is unchanged: an older
    buffer reads a merged iteration as one batch's, which it is to it)."""
    merged: dict[int, HistoryIteration] = {}
    for it in reversed(iterations):  # oldest first: each later one is the newer of a merge
        prev = merged.get(it.policy_version)
        merged[it.policy_version] = it if prev is None else merge_iteration(prev, it, cap)
    return sorted(merged.values(), key=lambda it: it.policy_version, reverse=True)


def add_iteration(iterations: list[HistoryIteration], new: HistoryIteration, keep: int, cap: int
                  ) -> list[HistoryIteration] | None:
    """The key's iterations (by_version's: newest version first) with a completed batch's responses
    added: merged into its version's iteration when the key has one, else a new iteration in
    version order; the newest `keep` versions stay. None: nothing changes (a version older than
    every one of `keep` kept, which a buffer cannot produce: a weight update waits for the
    batches of the version it replaces)."""
    out = [merge_iteration(it, new, cap) if it.policy_version == new.policy_version else it for it in iterations]
    if all(it.policy_version != new.policy_version for it in iterations):
        if len(iterations) >= keep and all(it.policy_version > new.policy_version for it in iterations):
            return None
        out = sorted([*iterations, new], key=lambda it: it.policy_version, reverse=True)
    return out[:keep]
