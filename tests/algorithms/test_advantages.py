from __future__ import annotations

import math

import pytest

from rllm_async.algorithms.advantages import get_advantage_fn, grpo, rloo


def test_grpo_mean_and_std() -> None:
    assert grpo([1.0, 0.0, 0.0, 1.0]) == [0.5, -0.5, -0.5, 0.5]
    normed = grpo([1.0, 0.0, 0.0, 1.0], True)
    assert normed == pytest.approx([1.0, -1.0, -1.0, 1.0], rel=1e-5)


def test_rloo_leave_one_out() -> None:
    # r_i - mean of the others: 3 - (1+2)/2 = 1.5, ...
    assert rloo([1.0, 2.0, 3.0]) == [1.0 - 2.5, 2.0 - 2.0, 3.0 - 1.5]
    assert rloo([5.0]) == [0.0]


def sign(rewards, normalize_std=False):
    return [math.copysign(1.0, r) for r in rewards]


def test_advantage_by_name_or_import_path() -> None:
    assert get_advantage_fn("grpo") is grpo
    assert get_advantage_fn("tests.algorithms.test_advantages:sign")([-2.0, 3.0]) == [-1.0, 1.0]
    with pytest.raises(KeyError, match=r"unknown algorithm\.advantage 'nope'.*grpo"):
        get_advantage_fn("nope")
