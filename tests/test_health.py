"""The failure-rate breaker against a direct count over its window."""

from __future__ import annotations

import random

import pytest

from rllm_async.config import Config
from rllm_async.health import FailureRateBreaker, FailureRateError


def _breaker(window: int, max_rate: float) -> FailureRateBreaker:
    config = Config.model_validate(
        {"rollout": {"failure_window": window, "max_failure_rate": max_rate}}
    )
    return FailureRateBreaker(config)


@pytest.mark.parametrize("seed", range(20))
def test_the_breaker_trips_exactly_when_the_window_holds_too_many_failures(seed: int) -> None:
    rng = random.Random(seed)
    window = rng.choice([1, 5, 40, 200])
    max_rate = rng.choice([0.1, 0.3, 0.5, 0.9])
    p_fail = rng.uniform(0.0, 0.6)
    breaker = _breaker(window, max_rate)
    outcomes: list[bool] = []
    for _ in range(1000):
        failed = rng.random() < p_fail
        outcomes.append(failed)
        recent = outcomes[-window:]
        rate = sum(recent) / len(recent)
        expected = len(recent) >= min(window, 32) and rate > max_rate
        if expected:
            with pytest.raises(FailureRateError, match="last error: boom"):
                breaker.observe(failed, "boom" if failed else "")
            return
        breaker.observe(failed, "boom" if failed else "")
    assert p_fail <= max_rate + 0.1  # the run never tripped: its failure rate stayed low
