"""The environment for a subprocess that measures glibc malloc's page faults."""

from __future__ import annotations

import os


def plain_malloc_env() -> dict[str, str]:
    """This process's environment without glibc malloc settings (MALLOC_ARENA_MAX, MALLOC_*_,
    GLIBC_TUNABLES): some base images and platforms set them, and a probe that inherits, say, one
    arena measures a thread arena's behaviour on the main arena (0 faults where the control
    expects thousands)."""
    return {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_") and k != "GLIBC_TUNABLES"}
