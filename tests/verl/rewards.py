"""A reward a random model earns about half the time, so every group has something to learn."""

from __future__ import annotations

from typing import Any


def has_digit(task: dict[str, Any], text: str) -> float:
    return float(any(ch.isdigit() for ch in text))
