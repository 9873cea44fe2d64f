"""A task set for runs on the random tiny model: the reward is a property of the reply that varies
from sample to sample (its length's parity), so that groups have signal and steps are taken."""

from __future__ import annotations

from typing import Any


def generator(n: int = 64) -> list[dict[str, Any]]:
    return [{"id": f"p{i}", "prompt": f"what is {i} plus {i % 7}?"} for i in range(n)]


def reward(task: dict[str, Any], text: str) -> float:
    return float(len(text) % 2)
