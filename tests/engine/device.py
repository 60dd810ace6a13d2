"""The device the engine tests run on (SEER_TEST_DEVICE=cuda runs them on a GPU; CI has none), and
whether this machine can build the C kernels."""

from __future__ import annotations

import os

import pytest

from services.worker.engines.reference.kernels import build

DEVICE = os.environ.get("SEER_TEST_DEVICE", "cpu")

# The C kernels' tests are skipped only where their prerequisites are missing: a build or load
# failure on a machine that has them must fail (test_kernel_builds_where_it_can), not skip.
CAN_BUILD = build.cpu_has_avx2_fma() and build.compiler() is not None
needs_kernel = pytest.mark.skipif(not CAN_BUILD, reason="no C compiler / AVX2 here")
