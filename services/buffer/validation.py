"""SubmitBatch validation: every check names the offending field; nothing is stored on failure."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import numbers
import operator
import re
import struct
from array import array
from collections.abc import Iterable
from dataclasses import dataclass

from services.buffer.model import ModelInfo
from services.buffer.records import GroupSpec, Sampling
from services.common.errors import FailedPrecondition, InvalidArgument, ResourceExhausted
from services.common.sampling_limits import MIN_TEMPERATURE

# fullmatch, not match with "$": "$" also matches before a trailing newline.
BATCH_ID_RE = re.compile(r"[A-Za-z0-9._:-]{1,128}")
# Sample indexes are 4 zero-padded digits in the store's keys (store.request_key, chunk_key).
MAX_GROUP_SIZE = 1024
# Group indexes are 6 zero-padded digits in the store's keys (store.group_key, request_key,
# chunk_key): only below 10**6 is their key order the numeric order, and a restart rebuilds the work
# feed (the scheduler's snapshot, FIFO) and GetBatch lists requests in key order. A batch with more
# groups is refused (split it) instead of its requests coming back out of order after a restart;
# widening the keys would leave every stored batch under the old layout. The default
# max_requests_per_batch (65,536) bounds groups far lower; this binds only a larger setting.
MAX_GROUPS_PER_BATCH = 1_000_000
MAX_STOP_TOKENS = 1024
MAX_PROMPT_KEY_CHARS = 512
MAX_LABEL_BYTES = 64 * 1024
UINT64_MAX = 2**64 - 1
# The buffer server's send limit: services.common.grpcutil.MAX_MESSAGE_BYTES, which
# services/common/server.py configures (not imported: the core stays free of grpc; a test checks
# they agree). One StreamResults message carries one whole result, so a response longer than this
# allows would be accepted, generated and stored, then fail at every send, and a reader resuming at
# its cursor would fail forever. Read at call time (tests lower it).
MAX_RESULT_MESSAGE_BYTES = 64 * 1024 * 1024
# What a StreamResultsResponse holds besides the per-token arrays, the text, the prompt key and the
# labels: cursor, submission id, ids, indices, finish reason, version, stats, latency, tags and
# length prefixes (a few hundred bytes; generously rounded up).
RESULT_FIXED_BYTES = 4096


@dataclass(frozen=True)
class ValidGroup:
    prompt_key: str
    prompt_token_ids: tuple[int, ...]
    group_size: int
    max_tokens: int
    sampling: Sampling  # top_p normalized (0 -> 1); seed as given (None = draw one)
    labels: dict[str, str]


def content_hash(batch_id: str, groups: list[GroupSpec], seed_scope: str = "") -> str:
    """Canonical hash of a submission (idempotency key content, independent of tokenizer), of its
    groups as typed_groups makes them: `seed=3` and `seed=3.0` are one content, and a numpy
    integer hashes as the int it is (json.dumps refused it: INTERNAL). Typing leaves well-typed
    input as it is, so the hash of every such submission is the one stored before typing came
    first; legacy_content_hash covers the rest."""
    doc: dict[str, object] = {
        "batch_id": batch_id,
        "groups": [
            {
                "prompt_key": g.prompt_key, "prompt_token_ids": list(g.prompt_token_ids),
                "prompt_text": g.prompt_text, "group_size": g.group_size, "max_tokens": g.max_tokens,
                "sampling": g.sampling.to_meta(), "labels": [list(kv) for kv in g.labels],
            }
            for g in groups
        ],
    }
    if seed_scope:
        # Only when set: batches stored before the field existed keep their hash.
        doc["seed_scope"] = seed_scope
    raw = json.dumps(doc, sort_keys=True, separators=(",", ":"), allow_nan=True).encode()
    return hashlib.sha256(raw).hexdigest()


def legacy_content_hash(batch_id: str, groups: list[GroupSpec], seed_scope: str = "") -> str | None:
    """The hash a buffer before typed_groups stored: of the groups as sent (None when they do not
    serialize, e.g. a numpy integer: that submission was INTERNAL then, so nothing was stored with
    it). A batch stored so with an odd spelling (`seed=3.0`, `ignore_eos=1`) has this hash, not
    content_hash's; its caller's retry spells it the same way, and is still already_submitted."""
    try:
        return content_hash(batch_id, groups, seed_scope)
    except (TypeError, ValueError):
        return None


def default_prompt_key(tokens: tuple[int, ...]) -> str:
    h = hashlib.blake2b(b"".join(t.to_bytes(4, "little") for t in tokens), digest_size=16)
    return "tok:" + h.hexdigest()


def validate_batch_id(batch_id: str) -> None:
    if not BATCH_ID_RE.fullmatch(batch_id):
        raise InvalidArgument(f"must match [A-Za-z0-9._:-]{{1,128}}, got {batch_id[:140]!r}", field="batch_id")


def validate_seed_scope(seed_scope: str) -> None:
    if seed_scope and not BATCH_ID_RE.fullmatch(seed_scope):
        raise InvalidArgument(f"must be empty or match [A-Za-z0-9._:-]{{1,128}}, got {seed_scope[:140]!r}",
                              field="seed_scope")


def validate_submission_token(token: str) -> None:
    if token and not BATCH_ID_RE.fullmatch(token):
        raise InvalidArgument(f"must be empty or match [A-Za-z0-9._:-]{{1,128}}, got {token[:140]!r}",
                              field="submission_token")


def _check_tokens(tokens: tuple[int, ...], vocab: int, field: str) -> None:
    if not tokens or (min(tokens) >= 0 and max(tokens) < vocab):  # fast path in C; the loop names the index
        return
    for j, t in enumerate(tokens):
        if not 0 <= t < vocab:
            raise InvalidArgument(f"token id {t} outside the vocabulary [0, {vocab})", field=f"{field}[{j}]")


# In-process callers (tests, benches, an embedding trainer) hand the core Python values that
# protobuf would have typed: ignore_eos=1, seed=3.0, a numpy integer. Each is made the type its
# record decodes (records.py checks every stored field's type) or refused naming the field: an odd
# type stored as it came was accepted once and then refused at recovery, failing the restart.


def _integer(value: object, field: str) -> int:
    """An integer field as an int: an int, a numpy or other integer (__index__), or a float with
    an integral value (3.0), numpy's of any width too (np.float32(3.0): dtype.kind "f", duck-typed
    as _real does). A bool, a fraction or anything else is InvalidArgument."""
    if type(value) is int:
        return value
    if not isinstance(value, bool):
        if isinstance(value, float) and math.isfinite(value) and value.is_integer():
            return int(value)
        if _scalar_kind(value) == "f":
            # Only np.float64 is a float subclass: np.float32(3.0), np.float16 and a 0-d float
            # array were refused ("must be an integer") where np.float64(3.0) passed. float() is
            # exact for each up to float64; int() of the value itself keeps a wider one's digits.
            f = float(value)  # type: ignore[arg-type]
            if math.isfinite(f) and f.is_integer():
                return int(value)  # type: ignore[call-overload]
        elif not isinstance(value, float):
            try:
                return operator.index(value)  # type: ignore[arg-type]
            except TypeError:
                pass
    raise InvalidArgument(f"must be an integer, got {_describe(value)}", field=field)


def _typed_tokens(tokens: object, field: str) -> tuple[int, ...]:
    """Prompt token ids as a tuple of ints. protobuf's (a tuple of ints, from convert) pass at C
    speed, without a per-token Python loop (65,536 prompts of 1K tokens are 64M tokens). Other
    spellings of integers (a numpy array or its integers, a list) are converted at C speed too
    (array('q'), through __index__); only what that refuses (3.0, a bool, a huge or odd value) goes
    through _integer, which converts it or names its index."""
    if isinstance(tokens, (str, bytes)) or not isinstance(tokens, Iterable):
        raise InvalidArgument(f"must be a sequence of integers, got {type(tokens).__name__}", field=field)
    seq = tokens if isinstance(tokens, tuple) else tuple(tokens)
    types = set(map(type, seq))  # C speed
    if types <= {int}:
        return seq
    if bool not in types and not any(issubclass(t, float) for t in types):
        try:
            return tuple(array("q", seq).tolist())
        except (TypeError, OverflowError):
            pass
    return tuple(_integer(t, f"{field}[{j}]") for j, t in enumerate(seq))


def _describe(value: object) -> str:
    """A refused value for the message: its type with the module outside builtins ("numpy.bool
    True", not "bool True" for np.bool_), and its text cut short."""
    t = type(value)
    name = t.__name__ if t.__module__ == "builtins" else f"{t.__module__.split('.')[0]}.{t.__name__}"
    return f"{name} {str(value)[:60]}"


def _scalar_kind(value: object) -> str | None:
    """A numpy scalar's (or 0-d array's) dtype.kind ("b", "i", "u", "f", ...), else None."""
    dtype = getattr(value, "dtype", None)
    if dtype is None or getattr(value, "shape", ()) != ():
        return None
    kind = getattr(dtype, "kind", None)
    return kind if isinstance(kind, str) else None


def _real(value: object, field: str) -> float:
    """A float field as a float: any real number, numpy's scalars included (np.float32(0.5),
    np.int64(1): numbers.Real, or a numeric dtype); a bool (Python's or numpy's) or anything else
    is InvalidArgument. Duck-typed (dtype.kind): the buffer does not depend on numpy."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    kind = _scalar_kind(value)
    if kind in ("f", "i", "u") or (kind is None and isinstance(value, numbers.Real) and not isinstance(value, bool)):
        try:
            return float(value)  # type: ignore[arg-type]
        except (TypeError, ValueError, OverflowError):
            pass
    raise InvalidArgument(f"must be a number, got {_describe(value)}", field=field)


def _boolean(value: object, field: str) -> bool:
    """A bool field as a bool: a bool (numpy's np.bool_ too: dtype.kind "b"), or the integer 0 or 1
    (as protobuf and C callers spell it)."""
    if isinstance(value, bool):
        return value
    kind = _scalar_kind(value)
    if kind == "b":
        return bool(value)
    if (isinstance(value, int) or kind in ("i", "u")) and value in (0, 1):
        return bool(value)
    raise InvalidArgument(f"must be a boolean, got {_describe(value)}", field=field)


def _typed_sampling(s: Sampling, field: str) -> Sampling:
    """The sampling with every field its type. Its limits (MAX_STOP_TOKENS among them) are
    _validate_sampling's: typing runs before a stored batch is looked up, and a batch an older
    buffer stored under other limits must still be found (core.submit_batch)."""
    stop = s.stop_token_ids
    if not isinstance(stop, (tuple, list)):
        raise InvalidArgument(f"must be a sequence of integers, got {type(stop).__name__}",
                              field=f"{field}.stop_token_ids")
    return Sampling(
        temperature=_real(s.temperature, f"{field}.temperature"), top_p=_real(s.top_p, f"{field}.top_p"),
        top_k=_integer(s.top_k, f"{field}.top_k"),
        seed=None if s.seed is None else _integer(s.seed, f"{field}.seed"),
        # At C speed (_typed_tokens): the count is bounded only later, in _validate_sampling.
        stop_token_ids=_typed_tokens(stop, f"{field}.stop_token_ids"),
        ignore_eos=_boolean(s.ignore_eos, f"{field}.ignore_eos"))


def as_typed(value: float) -> str:
    """A float field's value for an error message, as the user typed it. The proto's float fields
    are float32: `top_p=-0.1` arrives as -0.10000000149011612, and echoing that made the user's
    value look mangled. A value float32 holds exactly is shown as the shortest decimal that rounds
    back to it in float32 (-0.1); any other (an in-process caller's float64) as Python's repr."""
    try:
        single = struct.unpack("f", struct.pack("f", value))[0]
    except OverflowError:  # beyond float32's range: not from the proto
        return repr(value)
    if single != value:  # nan, or a float64 float32 does not hold
        return repr(value)
    for digits in range(1, 10):  # 9 significant digits round-trip every float32
        text = f"{value:.{digits}g}"
        if struct.unpack("f", struct.pack("f", float(text)))[0] == single:
            return repr(float(text))
    return repr(value)


def _validate_sampling(s: Sampling, vocab: int, field: str) -> Sampling:
    """A sampling typed_groups already typed (_typed_sampling) checked against its limits, top_p
    normalized."""
    if len(s.stop_token_ids) > MAX_STOP_TOKENS:
        # Every work item of the group repeats them: a few hundred KB of them in one group made one
        # WatchWork message over gRPC's size limit, and the scheduler's work feed failed for every
        # batch until this one was cancelled. Checked here, after the stored-batch lookup, not in
        # typing: a batch an older buffer stored with more is still found by its retry.
        raise InvalidArgument(f"at most {MAX_STOP_TOKENS}, got {len(s.stop_token_ids)}",
                              field=f"{field}.stop_token_ids")
    if not math.isfinite(s.temperature) or s.temperature < 0:
        raise InvalidArgument(f"must be finite and >= 0, got {as_typed(s.temperature)}", field=f"{field}.temperature")
    if 0 < s.temperature < MIN_TEMPERATURE:
        # The workers refuse it (float32 logits / temperature overflow): refuse it at submission,
        # not after every chunk attempt failed.
        raise InvalidArgument(f"must be 0 (greedy) or >= {MIN_TEMPERATURE:g}, got {as_typed(s.temperature)}",
                              field=f"{field}.temperature")
    if not math.isfinite(s.top_p) or not 0 <= s.top_p <= 1:
        raise InvalidArgument(f"must be in (0, 1] (0 = off), got {as_typed(s.top_p)}", field=f"{field}.top_p")
    if s.top_k < 0:
        raise InvalidArgument(f"must be >= 0 (0 = off), got {s.top_k}", field=f"{field}.top_k")
    if s.seed is not None and not 0 <= s.seed <= UINT64_MAX:
        raise InvalidArgument(f"must be a uint64, got {s.seed}", field=f"{field}.seed")
    _check_tokens(s.stop_token_ids, vocab, f"{field}.stop_token_ids")
    return Sampling(s.temperature, s.top_p if s.top_p > 0 else 1.0, s.top_k, s.seed, s.stop_token_ids,
                    s.ignore_eos)


def _varint_bytes(value: int) -> int:
    return max(1, (value.bit_length() + 6) // 7)


def max_response_tokens(model: ModelInfo, prompt_key_chars: int, labels: dict[str, str]) -> int:
    """The longest response whose StreamResultsResponse surely fits MAX_RESULT_MESSAGE_BYTES: per
    token a packed token id (the varint of the largest id), a packed float logprob, and at most
    max_text_bytes_per_token of text (when the buffer detokenizes); besides, the prompt key (4
    bytes a character at most), the labels (a map entry's tags and length prefixes: 18 bytes) and
    RESULT_FIXED_BYTES."""
    per_token = _varint_bytes(max(0, model.vocab_size - 1)) + 4
    if model.tokenizer is not None:
        per_token += model.tokenizer.max_text_bytes_per_token()
    fixed = (RESULT_FIXED_BYTES + 4 * prompt_key_chars
             + sum(18 + len(k.encode()) + len(v.encode()) for k, v in labels.items()))
    return max(0, (MAX_RESULT_MESSAGE_BYTES - fixed) // per_token)


def _typed_group(g: GroupSpec, f: str) -> GroupSpec:
    """The group with every field its type (see _integer, _typed_tokens, _typed_sampling), or
    InvalidArgument naming the field; a well-typed group comes back equal. Its limits are checked
    in validate_group."""
    for name in ("prompt_key", "prompt_text"):
        if not isinstance(getattr(g, name), str):
            raise InvalidArgument(f"must be a string, got {type(getattr(g, name)).__name__}", field=f"{f}.{name}")
    for k, v in g.labels:
        if not isinstance(k, str) or not isinstance(v, str):
            raise InvalidArgument(f"keys and values must be strings, got {k!r}: {str(v)[:60]!r}", field=f"{f}.labels")
    return dataclasses.replace(g, prompt_token_ids=_typed_tokens(g.prompt_token_ids, f"{f}.prompt_token_ids"),
                               group_size=_integer(g.group_size, f"{f}.group_size"),
                               max_tokens=_integer(g.max_tokens, f"{f}.max_tokens"),
                               sampling=_typed_sampling(g.sampling, f"{f}.sampling"))


def typed_groups(groups: list[GroupSpec]) -> list[GroupSpec]:
    """A submission's groups with every field its type (_typed_group), before anything reads them:
    content_hash hashes these, so an idempotent retry that spells a value another way (`seed=3`
    for `3.0`, a numpy integer) is the same content. It depends on no limit of the buffer (a stored
    batch is looked up by this hash before the submission is validated against them), but the
    group count is checked first (MAX_GROUPS_PER_BATCH, a constant): typing a million groups would
    take seconds before the refusal."""
    check_group_count(groups)
    return [_typed_group(g, f"groups[{i}]") for i, g in enumerate(groups)]


def check_group_count(groups: list[GroupSpec]) -> None:
    if len(groups) > MAX_GROUPS_PER_BATCH:
        raise ResourceExhausted(f"{len(groups)} groups in one batch; at most {MAX_GROUPS_PER_BATCH} "
                                "(split the batch)", field="groups")


def _check_context(prompt_len: int, max_tokens: int, max_context: int, f: str, prompt_field: str) -> None:
    """The prompt and its response within the model context. A prompt that alone fills the context
    names the prompt (no max_tokens would fit: it was blamed on max_tokens, and a user lowered it in
    vain); otherwise max_tokens, with the largest that fits."""
    if prompt_len + max_tokens <= max_context:
        return
    if prompt_len >= max_context:
        # At the context exactly, no token is left to generate (max_tokens is at least 1).
        over = (f"exceeds the model context {max_context} by {prompt_len - max_context} tokens"
                if prompt_len > max_context else f"fills the model context {max_context}, leaving no token to generate")
        raise InvalidArgument(
            f"prompt length {prompt_len} {over}; a prompt may have at most {max_context - 1} tokens (shorten it by "
            f"{prompt_len - max_context + 1})", field=f"{f}.{prompt_field}")
    raise InvalidArgument(
        f"prompt length {prompt_len} + max_tokens {max_tokens} exceeds the model context {max_context}: "
        f"max_tokens can be at most {max_context - prompt_len} for this prompt", field=f"{f}.max_tokens")


def validate_group(i: int, g: GroupSpec, model: ModelInfo) -> ValidGroup:
    """One group as typed_groups returned it (not typed again: that walked every prompt token once
    more, 0.2-0.3 s for 4,096 prompts of 4,096 tokens), checked against the buffer's limits."""
    f = f"groups[{i}]"
    if not 1 <= g.group_size <= MAX_GROUP_SIZE:
        raise InvalidArgument(f"must be in 1..{MAX_GROUP_SIZE}, got {g.group_size}", field=f"{f}.group_size")
    if g.max_tokens < 1:
        raise InvalidArgument(f"must be >= 1, got {g.max_tokens}", field=f"{f}.max_tokens")
    if g.prompt_token_ids and g.prompt_text:
        raise InvalidArgument("give exactly one of prompt_token_ids and prompt_text, not both",
                              field=f"{f}.prompt_text")
    if g.prompt_text:
        if model.tokenizer is None:
            raise FailedPrecondition("this buffer has no tokenizer (start it with --model-dir); send "
                                     "prompt_token_ids instead", field=f"{f}.prompt_text")
        tokens = tuple(model.tokenizer.encode(g.prompt_text))
        if not tokens:
            raise InvalidArgument("tokenizes to an empty prompt", field=f"{f}.prompt_text")
        # Checked like prompt_token_ids: a tokenizer can produce ids the model does not have (its
        # tokenizer.json has more tokens than config.json's vocab_size, a --vocab-size below the
        # tokenizer's, a tokenizer.json without config.json and the 49,152 default). Accepted,
        # such a prompt went on to the workers, whose model has no embedding for the id.
        if max(tokens) >= model.vocab_size:
            j = next(j for j, t in enumerate(tokens) if t >= model.vocab_size)
            raise InvalidArgument(
                f"tokenizes to token id {tokens[j]} (token {j}) outside the vocabulary [0, {model.vocab_size}): "
                "this buffer's tokenizer and vocab_size disagree (check --model-dir and --vocab-size); "
                "send prompt_token_ids instead", field=f"{f}.prompt_text")
    else:
        tokens = g.prompt_token_ids
        if not tokens:
            raise InvalidArgument("empty prompt: give prompt_token_ids or prompt_text",
                                  field=f"{f}.prompt_token_ids")
        _check_tokens(tokens, model.vocab_size, f"{f}.prompt_token_ids")
    _check_context(len(tokens), g.max_tokens, model.max_context, f,
                   "prompt_text" if g.prompt_text else "prompt_token_ids")
    sampling = _validate_sampling(g.sampling, model.vocab_size, f"{f}.sampling")
    if len(g.prompt_key) > MAX_PROMPT_KEY_CHARS:
        raise InvalidArgument(f"at most {MAX_PROMPT_KEY_CHARS} characters", field=f"{f}.prompt_key")
    label_bytes = sum(len(k.encode()) + len(v.encode()) for k, v in g.labels)
    if label_bytes > MAX_LABEL_BYTES:
        raise InvalidArgument(f"{label_bytes} bytes of labels; at most {MAX_LABEL_BYTES}", field=f"{f}.labels")
    prompt_key = g.prompt_key or default_prompt_key(tokens)
    labels = dict(g.labels)
    limit = max_response_tokens(model, len(prompt_key), labels)
    if g.max_tokens > limit:
        raise InvalidArgument(
            f"must be at most {limit}: a response of {g.max_tokens} tokens (ids, logprobs, text, labels) "
            f"could exceed the {MAX_RESULT_MESSAGE_BYTES}-byte gRPC message that delivers it",
            field=f"{f}.max_tokens")
    return ValidGroup(
        prompt_key=prompt_key,
        prompt_token_ids=tokens,
        group_size=g.group_size,
        max_tokens=g.max_tokens,
        sampling=sampling,
        labels=labels,
    )


def validate_batch(batch_id: str, groups: list[GroupSpec], model: ModelInfo,
                   max_requests: int, seed_scope: str = "") -> list[ValidGroup]:
    """A submission's groups, as typed_groups returned them (typed once, by the caller: submit_batch
    hashes the typed groups before this), checked against the buffer's limits."""
    validate_batch_id(batch_id)
    validate_seed_scope(seed_scope)
    if not groups:
        raise InvalidArgument("a batch needs at least one group", field="groups")
    check_group_count(groups)
    for i, g in enumerate(groups):  # a group too large to run cannot be split: name it, before the total
        if not 1 <= g.group_size <= MAX_GROUP_SIZE:
            raise InvalidArgument(f"must be in 1..{MAX_GROUP_SIZE}, got {g.group_size}",
                                  field=f"groups[{i}].group_size")
    total = sum(max(g.group_size, 0) for g in groups)
    if total > max_requests:
        raise ResourceExhausted(f"{total} requests in one batch; at most {max_requests} (split the batch)",
                                field="groups")
    return [validate_group(i, g, model) for i, g in enumerate(groups)]
