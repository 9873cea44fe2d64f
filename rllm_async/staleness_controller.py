"""The controller of `coordinator.pipeline_depth: auto`: the pipeline depth, step by step, from
what each step's record measured.

It keeps the trainer busy (its idle ratio waiting for groups under `auto.target_idle`) with the
least depth that does so, within the budgets (`auto.max_waste`, `auto.max_dropped`,
`auto.max_mean_staleness`)
and never above the ceiling that the hard bound `max_staleness` allows (`depth_ceiling`). It moves
at most once every `auto.hold_steps` steps, judging the last `hold_steps` steps together:

1. a budget exceeded: one lower, and no higher than that from then on (reason `waste`,
   `dropped` or `staleness`);
2. the trainer idle above `target_idle`: up, doubling while it idles over four times the target,
   else by one (`trainer_idle`);
3. the trainer busy (idle under half the target) while generation idles above
   `auto.generation_idle` (generation waits for admission): one lower, for less staleness at no
   cost in throughput (`generation_idle`). Where that left the trainer idle and the depth went
   back up, it never goes below that depth again.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from rllm_async.config import AutoDepthConfig

REASONS = ("trainer_idle", "generation_idle", "waste", "dropped", "staleness")


@dataclass(frozen=True, slots=True)
class DepthChange:
    """One move of the controller: from `old` to `new`, and why (one of `REASONS`)."""

    old: int
    new: int
    reason: str

    def metrics(self) -> dict[str, float]:
        """The change as a record's metric: `coordinator/depth_change/<reason>`, new - old."""
        return {f"coordinator/depth_change/{self.reason}": float(self.new - self.old)}


class DepthController:
    """The pipeline depth of `pipeline_depth: auto`, in [0, `ceiling`]; `observe` each step's
    record, and it returns the change it made, if any."""

    def __init__(self, config: AutoDepthConfig, ceiling: int) -> None:
        if ceiling < 0:
            raise ValueError(f"no pipeline depth fits the staleness bound (ceiling {ceiling})")
        self.config = config
        self.ceiling = ceiling
        self.depth = min(config.initial, ceiling)
        self.floor = 0  # raised where a move down left the trainer idle
        self.cap = ceiling  # lowered where a budget was exceeded
        self.changes: list[tuple[int, DepthChange]] = []  # (step, change)
        self._steps = 0
        self._since = 0  # steps observed since the last judgment (or the start)
        self._last_reason: str | None = None
        self._reset_window()

    def _reset_window(self) -> None:
        self._time = self._trainer_idle = self._generation_idle = 0.0
        self._wasted = self._generated = 0.0
        self._dropped = self._taken = 0.0
        self._staleness_sum = 0.0
        self._staleness_n = 0

    def observe(self, record: Mapping[str, float]) -> DepthChange | None:
        """Take one step's record (`async/trainer_idle_ratio`, `async/generation_idle_ratio`,
        `time/step_s`, `tokens/wasted`, `tokens/generated`, `groups/dropped_stale`, `groups/consumed`,
        `staleness/mean`); the change it
        makes after it, if any. The first step (the pipeline filling) is not judged."""
        self._steps += 1
        if self._steps == 1:
            return None
        step_s = float(record.get("time/step_s", 0.0))
        self._time += step_s
        self._trainer_idle += float(record.get("async/trainer_idle_ratio", 0.0)) * step_s
        self._generation_idle += float(record.get("async/generation_idle_ratio", 0.0)) * step_s
        self._wasted += float(record.get("tokens/wasted", 0.0))
        self._generated += float(record.get("tokens/generated", 0.0))
        dropped = float(record.get("groups/dropped_stale", 0.0))
        self._dropped += dropped
        self._taken += dropped + float(record.get("groups/consumed", 0.0))
        if "staleness/mean" in record:
            self._staleness_sum += float(record["staleness/mean"])
            self._staleness_n += 1
        self._since += 1
        if self._since < self.config.hold_steps:
            return None
        change = self._decide()
        self._since = 0  # each judgment takes the steps since the one before
        self._reset_window()
        if change is not None:
            self.depth = change.new
            self._last_reason = change.reason
            self.changes.append((self._steps, change))
        return change

    def _decide(self) -> DepthChange | None:
        c, d = self.config, self.depth
        time = max(self._time, 1e-12)
        idle, gen_idle = self._trainer_idle / time, self._generation_idle / time
        waste = self._wasted / self._generated if self._generated else 0.0
        staleness = self._staleness_sum / self._staleness_n if self._staleness_n else 0.0
        over = None
        dropped = self._dropped / self._taken if self._taken else 0.0
        if c.max_waste is not None and waste > c.max_waste:
            over = "waste"
        elif c.max_dropped is not None and dropped > c.max_dropped:
            over = "dropped"
        elif c.max_mean_staleness is not None and staleness > c.max_mean_staleness:
            over = "staleness"
        if over is not None:
            if d == 0:
                return None
            self.cap = d - 1
            self.floor = min(self.floor, self.cap)
            return DepthChange(d, d - 1, over)
        if idle > c.target_idle:
            new = min(self.ceiling, self.cap, d + max(1, d) if idle > 4 * c.target_idle else d + 1)
            if new <= d:
                return None
            if self._last_reason == "generation_idle":
                self.floor = max(self.floor, new)  # the move down cost throughput: not again
            return DepthChange(d, new, "trainer_idle")
        if idle < c.target_idle / 2 and gen_idle > c.generation_idle and d > self.floor:
            return DepthChange(d, d - 1, "generation_idle")
        return None
