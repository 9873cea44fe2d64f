"""Guess the number: find a secret in 1..N from "higher"/"lower" feedback in as few turns as possible.

The environment states the range still possible after each guess ("higher 9-15"), so a policy that
always guesses the middle (binary search) solves N=15 within 4 turns, while one that guesses at
random inside the range fails 40% of the time. Rewards are per step: +1 for the correct guess,
`-GUESS_COST` for every other reply, so the return rewards solving in few turns.

Use it with `workflow.cls: rllm_async.workflows.EnvWorkflow`,
`workflow.args.env: rllm_async.tasks.guess:GuessEnv` and
`data.train.generator: rllm_async.tasks.guess:generator`.
"""

from __future__ import annotations

import asyncio
import random
from typing import Any

GUESS_COST = 0.15
MAX_REPLY_CHARS = 8


def generator(n: int = 1000, seed: int = 0, high: int = 15) -> list[dict[str, Any]]:
    """`n` games with secrets drawn uniformly from 1..high, the same for the same arguments."""
    rng = random.Random(seed)
    return [
        {"id": f"guess-{seed}-{i}", "secret": rng.randint(1, high), "high": high} for i in range(n)
    ]


def observation(feedback: str, low: int, high: int) -> str:
    """What the model sees: the feedback word and the range still possible."""
    return f"{feedback} {low}-{high}"


class GuessEnv:
    """One game. `latency_s` > 0 makes every step take a lognormal time with that median (and
    shape `latency_sigma`), standing in for a slow tool or environment."""

    def __init__(
        self, latency_s: float = 0.0, latency_sigma: float = 1.0, seed: int | None = None
    ) -> None:
        self.latency_s = latency_s
        self.latency_sigma = latency_sigma
        self._rng = random.Random(seed)
        self.secret = self.low = self.high = 0
        self.is_correct = False

    def reset(self, task: dict[str, Any]) -> str:
        self.secret, self.low, self.high = int(task["secret"]), 1, int(task.get("high", 15))
        self.is_correct = False
        return observation("guess", self.low, self.high)

    async def step(self, action: str) -> tuple[str, float, bool]:
        if self.latency_s > 0:
            await asyncio.sleep(self._rng.lognormvariate(0.0, self.latency_sigma) * self.latency_s)
        guess = parse_guess(action)
        if guess is None:
            return observation("invalid", self.low, self.high), -GUESS_COST, False
        if guess == self.secret:
            self.is_correct = True
            return "correct", 1.0, True
        if guess < self.secret:
            self.low = max(self.low, guess + 1)
            return observation("higher", self.low, self.high), -GUESS_COST, False
        self.high = min(self.high, guess - 1)
        return observation("lower", self.low, self.high), -GUESS_COST, False


def parse_guess(text: str) -> int | None:
    """The reply as a number, or None unless it is a short run of ASCII digits."""
    text = text.strip()
    if not text or len(text) > MAX_REPLY_CHARS or not (text.isascii() and text.isdigit()):
        return None
    return int(text)


def random_play(task: dict[str, Any], rng: random.Random, max_turns: int) -> list[dict[str, Any]]:
    """One game played by guessing uniformly inside the possible range, as chat messages."""
    low, high, secret = 1, int(task.get("high", 15)), int(task["secret"])
    messages = [{"role": "user", "content": observation("guess", low, high)}]
    for _ in range(max_turns):
        guess = rng.randint(low, high)
        messages.append({"role": "assistant", "content": str(guess)})
        if guess == secret:
            break
        if guess < secret:
            low, feedback = guess + 1, "higher"
        else:
            high, feedback = guess - 1, "lower"
        messages.append({"role": "user", "content": observation(feedback, low, high)})
    return messages


def warm_start_examples(
    n: int = 2000, seed: int = 1, high: int = 15, max_turns: int = 4
) -> list[dict[str, Any]]:
    """Transcripts of random-in-range play, one example per assistant turn: they teach the format
    and to stay inside the range, not to bisect, so that RL has the turns to improve."""
    rng = random.Random(f"play-{seed}")  # not the generator's stream, or guesses equal secrets
    examples = []
    for task in generator(n=n, seed=seed, high=high):
        messages = random_play(task, rng, max_turns)
        for end, msg in enumerate(messages, start=1):
            if msg["role"] == "assistant":
                examples.append({"messages": messages[:end]})
    return examples
