"""Group-relative advantage estimators (pure Python): built-ins by name, others by import path."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

from rllm_async.imports import import_object

AdvantageFn = Callable[[Sequence[float], bool], list[float]]


def grpo(rewards: Sequence[float], normalize_std: bool = False) -> list[float]:
    """Reward minus the group mean, optionally divided by the group's (population) std."""
    n = len(rewards)
    mean = sum(rewards) / n
    centered = [r - mean for r in rewards]
    if not normalize_std:
        return centered
    std = math.sqrt(sum(c * c for c in centered) / n)
    return [c / (std + 1e-6) for c in centered]


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


BUILTIN: dict[str, AdvantageFn] = {"grpo": grpo, "rloo": rloo}


def get_advantage_fn(name: str) -> AdvantageFn:
    """The estimator `algorithm.advantage` names: a built-in, or an import path "pkg.mod:fn"."""
    if name in BUILTIN:
        return BUILTIN[name]
    if ":" in name or "." in name:
        fn: AdvantageFn = import_object(name, "algorithm.advantage")
        return fn
    raise KeyError(
        f"unknown algorithm.advantage '{name}': choose one of {', '.join(sorted(BUILTIN))}, "
        "or give an import path 'package.module:function'"
    )
