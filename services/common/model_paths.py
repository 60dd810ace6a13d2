"""Where the embedded model lives. The converted model is cached once per machine.

SEER_MODEL_DIR overrides the location; the default is $XDG_CACHE_HOME/seer/models/<name> (or
~/.cache/seer/models/<name>).
"""

from __future__ import annotations

import os
from pathlib import Path

EMBEDDED_MODEL_NAME = "SmolLM2-135M-Instruct"


def cache_root() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "seer" / "models"


def default_model_dir() -> Path:
    env = os.environ.get("SEER_MODEL_DIR")
    if env:
        return Path(env)
    return cache_root() / EMBEDDED_MODEL_NAME
