"""Where the embedded model lives. The converted model is cached once per machine.

SEER_MODEL_DIR overrides the location; the default is $XDG_CACHE_HOME/seer/models/<name> (or
~/.cache/seer/models/<name>).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

EMBEDDED_MODEL_NAME = "SmolLM2-135M-Instruct"


def cache_root(env: Mapping[str, str] | None = None) -> Path:
    """env: the environment the answer is for (a child process's; default this process's)."""
    env = os.environ if env is None else env
    home = env.get("HOME") or os.path.expanduser("~")
    base = env.get("XDG_CACHE_HOME") or os.path.join(home, ".cache")
    return Path(base) / "seer" / "models"


def default_model_dir(env: Mapping[str, str] | None = None) -> Path:
    """env: as cache_root's (`seer up` resolves it for the services it starts, whose environment
    may set SEER_MODEL_DIR where its own does not)."""
    env = os.environ if env is None else env
    explicit = env.get("SEER_MODEL_DIR")
    if explicit:
        return Path(explicit)
    return cache_root(env) / EMBEDDED_MODEL_NAME
