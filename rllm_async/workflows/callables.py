"""What workflows take from config: callables by import path, sync or async, and their rewards."""

from __future__ import annotations

import inspect
import math
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from rllm_async.config import ConfigError
from rllm_async.imports import import_object

T = TypeVar("T")


async def maybe_await(value: T | Awaitable[T]) -> T:
    """The value itself, or what it resolves to when it is awaitable (sync or async callables)."""
    if inspect.isawaitable(value):
        return await value
    return value


def load(obj: Any, what: str) -> Any:
    """`obj`, or the object its import path names (config gives strings, code gives objects)."""
    return import_object(obj, what) if isinstance(obj, str) else obj


def score(fn: Callable[..., Any], *args: Any) -> tuple[float, bool | None]:
    """A reward function's `reward` or `(reward, is_correct)` as a pair."""
    out = fn(*args)
    return (float(out[0]), bool(out[1])) if isinstance(out, tuple) else (float(out), None)


@dataclass(frozen=True, slots=True)
class NamedReward:
    """One reward function of a weighted sum; `name` labels its metric (`episode/reward/<name>`)."""

    name: str
    fn: Callable[..., Any]
    weight: float = 1.0


def load_rewards(spec: Any, what: str) -> list[NamedReward]:
    """`reward_fn` as config gives it: one function (an import path or a callable), or a list of
    them, each a function or `{fn: ..., weight: 1.0, name: ...}` (name: the function's own)."""
    items = spec if isinstance(spec, list) else [spec]
    if not items:
        raise ConfigError(f"{what}: an empty list; give at least one reward function")
    rewards = []
    for i, item in enumerate(items):
        where = f"{what}[{i}]" if isinstance(spec, list) else what
        entry = dict(item) if isinstance(item, dict) else {"fn": item}
        unknown = set(entry) - {"fn", "weight", "name"}
        if "fn" not in entry or unknown:
            raise ConfigError(
                f"{where}: give a function, or {{fn: path, weight: 1.0, name: ...}}; got {item!r}"
            )
        fn = load(entry["fn"], f"{where}.fn")
        weight = entry.get("weight", 1.0)
        if (
            isinstance(weight, bool)
            or not isinstance(weight, int | float)
            or not math.isfinite(weight)
        ):
            raise ConfigError(f"{where}.weight: {weight!r} is not a finite number")
        default = (
            entry["fn"].split(":")[-1].split(".")[-1] if isinstance(entry["fn"], str) else None
        )
        name = str(entry.get("name") or default or getattr(fn, "__name__", f"reward{i}"))
        rewards.append(NamedReward(name, fn, float(weight)))
    names = [r.name for r in rewards]
    if len(set(names)) < len(names):
        raise ConfigError(f"{what}: reward names {names} repeat; give each a distinct `name`")
    return rewards


def score_all(
    rewards: list[NamedReward], *args: Any
) -> tuple[float, bool | None, dict[str, float]]:
    """The weighted sum of the rewards, whether the reply is correct (every function that judges
    says so; None when none judges), and each function's own reward by name."""
    parts: dict[str, float] = {}
    verdicts: list[bool] = []
    for reward in rewards:
        value, correct = score(reward.fn, *args)
        parts[reward.name] = value
        if correct is not None:
            verdicts.append(correct)
    total = sum(r.weight * parts[r.name] for r in rewards)
    return total, (all(verdicts) if verdicts else None), parts
