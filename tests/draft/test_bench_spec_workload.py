"""bench.spec's suite workloads: the long-tail shape that the suite throughput is measured on."""

from __future__ import annotations

import pytest

from bench.spec import LONGTAIL_FRACTIONS, suite_workload


def test_longtail_is_eight_groups_of_four_with_a_heavy_tail() -> None:
    prompts = [[i, i + 1] for i in range(8)]
    wl = suite_workload("longtail", prompts, 8, 200)
    assert [g for _p, g, _m in wl] == [4] * 8
    lengths = [m for _p, _g, m in wl]
    assert lengths == sorted(lengths) and lengths[-1] == 200 and lengths[0] == 20
    # The last group alone runs for about half of the longest group's steps.
    assert lengths[-1] - lengths[-2] >= lengths[-1] // 2
    assert [p for p, _g, _m in wl] == prompts
    assert len(LONGTAIL_FRACTIONS) == 8


def test_uniform_and_bad_names() -> None:
    assert suite_workload("uniform", [[1], [2]], 8, 48) == [([1], 8, 48), ([2], 8, 48)]
    with pytest.raises(ValueError, match="needs 8 prompts"):
        suite_workload("longtail", [[1]], 8, 48)
    with pytest.raises(ValueError, match="--suite-workload"):
        suite_workload("zipf", [[1]], 8, 48)
