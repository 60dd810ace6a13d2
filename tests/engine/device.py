"""The device the engine tests run on: SEER_TEST_DEVICE=cuda runs them on a GPU (CI has none)."""

from __future__ import annotations

import os

DEVICE = os.environ.get("SEER_TEST_DEVICE", "cpu")
