"""The controller of `rollout.max_concurrency: auto`: as many rollouts at once as keep the engine's
decode slots full.

A rollout spends a share f of its time in model calls and the rest in tools, its environment and
its reward. By Little's law, c rollouts at once keep c * f of them in the engine on average, so
the engine's `slots` stay full at c = slots / f. Each step's record says how long the rollouts
that ended in it spent in model calls and how long they ran (`rollout/model_s`,
`rollout/wall_s`); every `HOLD_STEPS` steps the controller sets the limit to slots / f over the
steps since its last decision, where that differs from the limit by more than `BAND`. An engine
with more sequences than slots queues them, and the wait counts as model time: f rises and the
limit comes back down. The limit starts at, and never goes under, `slots`.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Mapping
from dataclasses import dataclass

from rllm_async.config import Config, ConfigError
from rllm_async.rollout import CallMeter

HOLD_STEPS = 2  # at most one change every HOLD_STEPS steps, measured over them
BAND = 0.2  # the relative difference below which the limit stays where it is


@dataclass(frozen=True, slots=True)
class ConcurrencyChange:
    """One move of the limit, and the share of rollout time in model calls it answered."""

    old: int
    new: int
    model_share: float

    def metrics(self) -> dict[str, float]:
        """The change as a record's metrics: new - old, and the share measured."""
        return {
            "rollout/max_concurrency_change": float(self.new - self.old),
            "rollout/model_share": self.model_share,
        }


class ConcurrencyController:
    """Moves the rollout limit to slots / (share of rollout time in model calls)."""

    def __init__(self, slots: int) -> None:
        self.slots = slots
        self.limit = slots
        self._steps = 0
        self._model_s = 0.0
        self._wall_s = 0.0

    def observe(self, record: Mapping[str, float]) -> ConcurrencyChange | None:
        """Take one step's record; the change of the limit it leads to, if any."""
        self._steps += 1
        self._model_s += record.get("rollout/model_s", 0.0)
        self._wall_s += record.get("rollout/wall_s", 0.0)
        if self._steps < HOLD_STEPS or self._model_s <= 0.0:
            return None
        share = min(1.0, self._model_s / self._wall_s)
        self._steps, self._model_s, self._wall_s = 0, 0.0, 0.0
        target = max(self.slots, math.ceil(self.slots / share))
        if abs(target - self.limit) <= BAND * self.limit:
            return None
        change = ConcurrencyChange(self.limit, target, share)
        self.limit = target
        return change


class ModelClock:
    """A rollout's `CallMeter`, from its start: adds up the seconds in which at least one of its
    model calls ran, and tells `inner` (the workload record's meter) of each call as well."""

    __slots__ = ("_began", "_calls", "_loop", "_since", "inner", "model_s")

    def __init__(self, inner: CallMeter, loop: asyncio.AbstractEventLoop) -> None:
        self.inner, self._loop = inner, loop
        self.model_s = 0.0
        self._began = loop.time()
        self._calls = 0
        self._since = 0.0

    def call_began(self) -> None:
        if not self._calls:
            self._since = self._loop.time()
        self._calls += 1
        self.inner.call_began()

    def call_ended(self) -> None:
        self._calls -= 1
        if not self._calls:
            self.model_s += self._loop.time() - self._since
        self.inner.call_ended()

    def metrics(self) -> dict[str, float]:
        """The rollout's seconds in model calls, and in all, so far."""
        return {"rollout/model_s": self.model_s, "rollout/wall_s": self._loop.time() - self._began}


def starting_concurrency(config: Config, backend: object) -> int:
    """The rollout limit a run starts with: `rollout.max_concurrency`, or with `auto` the most
    sequences `backend`'s engine decodes together (its class's `decode_slots`); ConfigError
    where the backend cannot tell."""
    limit = config.rollout.max_concurrency
    if limit != "auto":
        return limit
    ask = getattr(type(backend), "decode_slots", None)
    slots = None if ask is None else ask(dict(config.backend.options))
    if slots is None:
        raise ConfigError(
            "rollout.max_concurrency: auto needs the most sequences the engine decodes together, "
            f"and backend {config.backend.name!r} with these options cannot tell (servers of "
            "your own, or vLLM's default --max-num-seqs): set rollout.max_concurrency to a "
            "number, or give the servers' --max-num-seqs in backend.vllm.extra_args"
        )
    return int(slots)
