"""Rewards a random model earns about half the time, so every group has something to learn, and
short prompts for the tiny Qwen3."""

from __future__ import annotations

from typing import Any


def has_digit(task: dict[str, Any], text: str) -> float:
    return float(any(ch.isdigit() for ch in text))


def odd_length(task: dict[str, Any], text: str) -> float:
    """Whether the reply has an odd number of characters: varies from sample to sample."""
    return float(len(text) % 2)


def questions(n: int = 64) -> list[dict[str, Any]]:
    """Arithmetic questions in the words the tiny Qwen3's tokenizer was trained on."""
    return [{"id": f"q{i}", "prompt": f"what is {i} plus {i % 7}?"} for i in range(n)]
