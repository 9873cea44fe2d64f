"""Group-relative advantage estimators (pure Python), found by name in a small registry."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

AdvantageFn = Callable[[Sequence[float], bool], list[float]]

_REGISTRY: dict[str, AdvantageFn] = {}


def register_advantage(name: str) -> Callable[[AdvantageFn], AdvantageFn]:
    """Register `fn(rewards, normalize_std) -> advantages` under `name` (`algorithm.advantage`)."""

    def deco(fn: AdvantageFn) -> AdvantageFn:
        _REGISTRY[name] = fn
        return fn

    return deco


def get_advantage_fn(name: str) -> AdvantageFn:
    try:
        return _REGISTRY[name]
    except KeyError:
        raise KeyError(
            f"unknown algorithm.advantage '{name}': choose one of {', '.join(sorted(_REGISTRY))}"
        ) from None


def advantage_names() -> list[str]:
    return sorted(_REGISTRY)


@register_advantage("grpo")
def grpo(rewards: Sequence[float], normalize_std: bool = False) -> list[float]:
    """Reward minus the group mean, optionally divided by the group's (population) std."""
    n = len(rewards)
    mean = sum(rewards) / n
    centered = [r - mean for r in rewards]
    if not normalize_std:
        return centered
    std = math.sqrt(sum(c * c for c in centered) / n)
    return [c / (std + 1e-6) for c in centered]


@register_advantage("rloo")
def rloo(rewards: Sequence[float], normalize_std: bool = False) -> list[float]:
    """Reward minus the mean of the *other* rollouts (leave-one-out baseline); needs n >= 2."""
    n = len(rewards)
    if n < 2:
        return [0.0] * n
    total = sum(rewards)
    adv = [r - (total - r) / (n - 1) for r in rewards]
    if not normalize_std:
        return adv
    std = math.sqrt(sum(a * a for a in adv) / n)
    return [a / (std + 1e-6) for a in adv]
