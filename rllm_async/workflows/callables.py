"""What workflows take from config: callables by import path, sync or async, and their rewards."""

from __future__ import annotations

import inspect
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

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
