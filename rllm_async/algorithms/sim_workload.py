"""The simulated workload's math, shared by the sim backend (to calibrate) and SimWorkflow (to draw).

Rollout lengths are lognormal (median, sigma, capped); every draw is fixed by a key, never by
scheduling order; a task's base success probability is fixed by its id.
"""

from __future__ import annotations

import math
import struct
from collections.abc import Callable
from functools import cache
from hashlib import blake2b
from statistics import NormalDist

import numpy as np

LEN_MEDIAN = 1500.0
LEN_SIGMA = 0.8
LEN_CAP = 16384
_STD_NORMAL = NormalDist()


def drift_factor(version: float, steps: int, growth: float, shape: str = "linear") -> float:
    """The factor a drifting quantity has reached at `version`: 1 at version 0, `growth` from
    `steps` on, linear in between (`shape` "linear") or all at once at `steps` ("step");
    `steps` 0 or `growth` 1: no drift."""
    if steps <= 0 or growth == 1.0:
        return 1.0
    if shape == "step":
        return growth if version >= steps else 1.0
    return 1.0 + (growth - 1.0) * min(1.0, max(0.0, version) / steps)


def rollout_length(u: float, median: float, sigma: float, cap: int) -> int:
    """A lognormal rollout length from a uniform draw u in (0, 1), rounded and capped."""
    return min(cap, max(1, round(median * math.exp(sigma * _STD_NORMAL.inv_cdf(u)))))


def sample_lengths(
    rng: np.random.Generator, n: int, median: float, sigma: float, cap: int
) -> np.ndarray:
    """n rollout lengths from the same distribution as `rollout_length`."""
    return np.clip(np.rint(median * np.exp(sigma * rng.standard_normal(n))), 1, cap).astype(int)


@cache
def _words(n: int) -> Callable[[bytes], tuple[int, ...]]:
    """The unpacker of n little-endian 64-bit words (one per n: a hot path)."""
    return struct.Struct(f"<{n}Q").unpack


_WORDS_4 = _words(4)
_ULP = 2.0**-52  # uniforms are (k + 0.5) * _ULP for 52-bit k


def uniforms(*key: object, n: int) -> list[float]:
    """n uniform draws in (0, 1) fixed by `key` alone, not by scheduling order or PYTHONHASHSEED."""
    digest = blake2b("\x1f".join(map(str, key)).encode(), digest_size=8 * n).digest()
    # 52 bits keep (k + 0.5) / 2**52 exactly representable and strictly inside (0, 1).
    return [((k >> 12) + 0.5) * _ULP for k in _words(n)(digest)]


def rollout_uniforms(
    seed: int, task_id: str, index: int, attempt: int
) -> tuple[float, float, float, float]:
    """`uniforms(seed, task_id, index, attempt, n=4)`, the draws of one rollout attempt, written
    out for a hot path."""
    key = f"{seed}\x1f{task_id}\x1f{index}\x1f{attempt}".encode()
    a, b, c, d = _WORDS_4(blake2b(key, digest_size=32).digest())
    return (
        ((a >> 12) + 0.5) * _ULP,
        ((b >> 12) + 0.5) * _ULP,
        ((c >> 12) + 0.5) * _ULP,
        ((d >> 12) + 0.5) * _ULP,
    )


def task_difficulty(task_id: str) -> float:
    """The base success probability p0 in [0.1, 0.9] of a task, fixed by its id."""
    return 0.1 + 0.8 * uniforms("p0", task_id, n=1)[0]
