# ruff: noqa
# Research script (session 6, GPU runs); see README.md beside it.
"""Device-side model preparation (this machine has no network): the GGUF weights through the
project's own converter, the tokenizer files carried from the prepared cache."""
import shutil, sys, types
from pathlib import Path
import transformers
from services.worker.model import prepare as P

gguf, out = Path(sys.argv[1]), Path(sys.argv[2])
tok = Path(__file__).parent
out.mkdir(parents=True, exist_ok=True)

class _Tok:
    @staticmethod
    def from_pretrained(*a, **k):
        return types.SimpleNamespace(save_pretrained=lambda d: [shutil.copy(tok / f, Path(d) / f) for f in
                                     ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")])

transformers.AutoTokenizer = _Tok
P.convert(gguf, out, dtype="float32")
print("prepared", sorted(p.name for p in out.iterdir()))
