"""What the buffer needs from the model directory: vocabulary size, context length, tokenizer.

Only config.json and tokenizer.json are read (no torch); the tokenizer is used with special tokens
and chat template off, as rollout.proto specifies for prompt_text.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from services.buffer.config import DEFAULT_MAX_CONTEXT, DEFAULT_VOCAB_SIZE, BufferConfig
from services.common.log import get_logger, kv
from services.common.model_paths import default_model_dir

log = get_logger(__name__)


# max_text_bytes_per_token by tokenizer file (path, size, mtime): once per process, not per buffer
# started in it (the tests start many).
_TEXT_BOUNDS: dict[tuple[str, int, int], int] = {}


class TextTokenizer:
    def __init__(self, path: Path) -> None:
        from tokenizers import Tokenizer

        self._tok = Tokenizer.from_file(str(path))
        st = path.stat()
        self._key = (str(path.resolve()), st.st_size, st.st_mtime_ns)

    def encode(self, text: str) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=False).ids)

    def decode(self, ids: list[int]) -> str:
        return str(self._tok.decode(ids, skip_special_tokens=True))

    def max_text_bytes_per_token(self) -> int:
        """An upper bound on the bytes one token adds to decode()'s UTF-8 text, whatever its
        neighbours (computed once, ~80 ms for 49K tokens). Each token is decoded alone: its ASCII
        bytes come out as themselves in any context, and each other byte (one of a multi-byte
        character, or of a U+FFFD replacing bytes the token alone leaves incomplete) stands for at
        most one raw byte, which a context can turn into at most one U+FFFD (3 bytes); +1 for a
        separator a decoder may put between tokens (a space a word-piece or metaspace decoder adds
        or strips at the start)."""
        bound = _TEXT_BOUNDS.get(self._key)
        if bound is None:
            n = self.size
            texts = self._tok.decode_batch([[i] for i in range(n)], skip_special_tokens=True) if n else []
            bound = 1 + max((len(b) + 2 * sum(c >= 0x80 for c in b) for b in (t.encode() for t in texts)),
                            default=0)
            _TEXT_BOUNDS[self._key] = bound
        return bound

    @property
    def size(self) -> int:
        """How many tokens the tokenizer has, added tokens included (its ids are [0, size) in the
        tokenizer.json files of Hugging Face models)."""
        return int(self._tok.get_vocab_size(with_added_tokens=True))


@dataclass(frozen=True)
class ModelInfo:
    vocab_size: int
    max_context: int
    tokenizer: TextTokenizer | None
    model_dir: str = ""


def resolve_model_dir(setting: str) -> Path | None:
    if setting == "":
        return None
    if setting == "auto":
        d = default_model_dir()
        return d if (d / "tokenizer.json").is_file() else None
    d = Path(setting)
    if not d.is_dir():
        raise ValueError(f"model_dir: {setting} is not a directory")
    return d


def load_model_info(cfg: BufferConfig) -> ModelInfo:
    d = resolve_model_dir(cfg.model_dir)
    vocab, ctx, tok = DEFAULT_VOCAB_SIZE, DEFAULT_MAX_CONTEXT, None
    if d is not None:
        config_path = d / "config.json"
        if config_path.is_file():
            mc = json.loads(config_path.read_text(encoding="utf-8"))
            vocab = int(mc.get("vocab_size", vocab))
            ctx = int(mc.get("max_position_embeddings", ctx))
        if (d / "tokenizer.json").is_file():
            tok = TextTokenizer(d / "tokenizer.json")
    info = ModelInfo(
        vocab_size=cfg.vocab_size or vocab,
        max_context=cfg.max_context or ctx,
        tokenizer=tok,
        model_dir=str(d or ""),
    )
    log.info("model info", extra=kv(model_dir=info.model_dir, vocab_size=info.vocab_size,
                                             max_context=info.max_context, tokenizer=tok is not None))
    if tok is not None and tok.size > info.vocab_size:
        # Said once at startup; each prompt_text that hits such an id is refused at submission.
        log.warning("the tokenizer has more tokens than the vocabulary: prompt_text that tokenizes to an id "
                    ">= vocab_size is refused", extra=kv(tokenizer_size=tok.size, vocab_size=info.vocab_size))
    return info
