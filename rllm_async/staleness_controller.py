"""The controller of `coordinator.pipeline_depth: auto`: the pipeline depth, step by step, from
what each step's record measured.

It keeps the trainer busy (its idle ratio waiting for groups under `auto.target_idle`), within
the budgets (`auto.max_waste`, `auto.max_dropped`, `auto.max_mean_staleness`,
`auto.max_sampler_kl`: the KL between the sampler's and the learner's token distributions, which
grows with staleness) and never above the ceiling that the hard bound `max_staleness` allows
(`depth_ceiling`). Once every `auto.hold_steps` steps it judges the steps since its last
judgment, and moves at most once:

1. a budget exceeded: back to the depth the last move up came from (else one lower), and no
   higher for `auto.retry_steps` steps (reason `waste`, `dropped`, `staleness` or `sampler_kl`);
2. the last move undone where it made things worse (`worse`). Each depth is measured over its
   last `STAY_STEPS` judged steps: goodput (generated tokens not wasted, per second) and the
   trainer's busy ratio, each a mean over steps with its standard error; a difference counts
   where it exceeds `auto.min_gain` and `Z` standard errors (the steps' own noise). A move up is
   undone while, within `retry_steps` of it, the new depth gives less goodput with the trainer
   no busier (groups over the bound are dropped: the waste shows up steps later); it is not
   tried again for `retry_steps` steps. A move down is undone where the depth it left did better
   on either measure, or, for a move made for groups over the bound (3), gave more goodput on the
   mean over a whole stay at the new depth and at least half a stay at the old one; the
   controller then stays at least that deep for `retry_steps` steps;
3. the trainer idle while more than `min_gain` of the groups taken were dropped as too stale,
   none of the rollouts hung: one lower (`over_bound`), and no higher until that is judged, or
   for `retry_steps` if longer: the depth left failed, as a move undone does. Fewer rollouts at
   once decode faster, so fewer go over the bound; the move is judged as any move down. Hung
   rollouts are left out: they hold their groups past the bound at any depth, and a deeper
   pipeline keeps the others flowing around them; for that reason the trainer idle with hung
   rollouts lifts the limit this move set;
4. the trainer idle above `target_idle`: up, doubling while it idles over four times the target,
   else by one (`trainer_idle`), but not to where the judged steps predict a budget exceeded:
   each depth deeper adds about one version to the consumed groups' staleness, and the sampler
   KL grows in proportion to the staleness;
5. the trainer busy (idle under half the target) while generation idles above
   `auto.generation_idle` (generation waits for admission): one lower, for less staleness at no
   cost in throughput (`generation_idle`).

After each move it lets steps pass before judging again: as many as the consumed groups'
staleness (the groups admitted before the move still arrive, those admitted after it take as
long), and after a move down, the old depth plus one (groups admitted deeper may still be dropped).
Limits and judgments lapse after `retry_steps`, so that a drifting workload is explored again;
the limit an undone move or a move of (3) sets holds twice as long for each such move in a row
(at most 8 times), until a move stands through its judgment: a tight bound's deeper depths,
which keep sending groups over it, are tried less and less often. A move of (3) that is undone
takes back the failure it had counted: the depth it left did better, so the only failed move
is that one.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from rllm_async.config import AutoDepthConfig

STAY_STEPS = 8  # the steps at a depth that say what it gives
Z = 2.0  # standard errors by which a difference between depths must exceed the steps' noise
REASONS = (  # in the order the controller weighs them
    "waste",
    "dropped",
    "staleness",
    "sampler_kl",
    "worse",
    "over_bound",
    "trainer_idle",
    "generation_idle",
)


@dataclass(frozen=True, slots=True)
class DepthChange:
    """One move of the controller: from `old` to `new`, and why (one of `REASONS`)."""

    old: int
    new: int
    reason: str

    def metrics(self) -> dict[str, float]:
        """The change as a record's metric: `coordinator/depth_change/<reason>`, new - old."""
        return {f"coordinator/depth_change/{self.reason}": float(self.new - self.old)}


@dataclass(slots=True)
class _Totals:
    """What some steps measured, summed; the ratios of a judgment come from it."""

    seconds: float = 0.0
    trainer_idle_s: float = 0.0
    generation_idle_s: float = 0.0
    generated: float = 0.0  # tokens
    wasted: float = 0.0  # tokens
    dropped: float = 0.0  # groups over the bound
    timeouts: float = 0.0  # rollouts that hung
    taken: float = 0.0  # groups consumed or dropped
    staleness: float = 0.0  # sum of the steps' mean staleness
    staleness_steps: int = 0
    sampler_kl: float = 0.0  # summed over the trained tokens
    trained: float = 0.0  # tokens

    def add(self, r: Mapping[str, float]) -> None:
        step_s = float(r.get("time/step_s", 0.0))
        self.seconds += step_s
        self.trainer_idle_s += float(r.get("async/trainer_idle_ratio", 0.0)) * step_s
        self.generation_idle_s += float(r.get("async/generation_idle_ratio", 0.0)) * step_s
        self.generated += float(r.get("tokens/generated", 0.0))
        self.wasted += float(r.get("tokens/wasted", 0.0))
        dropped = float(r.get("groups/dropped_stale", 0.0))
        self.dropped += dropped
        self.timeouts += float(r.get("rollout/timeouts", 0.0))
        self.taken += dropped + float(r.get("groups/consumed", 0.0))
        if "staleness/mean" in r:
            self.staleness += float(r["staleness/mean"])
            self.staleness_steps += 1
        if "loss/sampler_kl" in r:
            tokens = float(r.get("loss/num_tokens", 1.0))
            self.sampler_kl += float(r["loss/sampler_kl"]) * tokens
            self.trained += tokens

    @property
    def idle(self) -> float:
        return self.trainer_idle_s / self.seconds if self.seconds > 0 else 0.0

    @property
    def generation_idle(self) -> float:
        return self.generation_idle_s / self.seconds if self.seconds > 0 else 0.0


@dataclass(frozen=True, slots=True)
class _Estimate:
    """A mean over steps, with the sum of squared deviations from it, for a two-sample test."""

    mean: float
    squares: float
    n: int

    @classmethod
    def of(cls, values: list[float]) -> _Estimate:
        values = [v for v in values if math.isfinite(v)]
        mean = statistics.fmean(values) if values else 0.0
        return cls(mean, sum((v - mean) * (v - mean) for v in values), len(values))

    def exceeds(self, other: _Estimate, margin: float) -> bool:
        """Whether this is above `other` by `margin` (a fraction) and by more than `Z` standard
        errors of the difference (the two samples' variance pooled, so that a single step is
        judged by the other's noise): a gain the steps' noise does not explain."""
        if not self.n or not other.n:
            return False
        gap = self.mean - other.mean
        df = self.n + other.n - 2  # 0: one step each, no noise to judge by but the margin
        pooled = (self.squares + other.squares) / df if df else 0.0
        se = math.sqrt(pooled * (1 / self.n + 1 / other.n))
        return gap > abs(other.mean) * margin and gap > Z * se


@dataclass(frozen=True, slots=True)
class _Mark:
    """A depth, and what it gave over its last judged steps: goodput and the trainer's busy ratio."""

    depth: int
    goodput: _Estimate
    busy: _Estimate
    step: int  # when it was judged

    @classmethod
    def of(cls, depth: int, records: Iterable[Mapping[str, float]], step: int) -> _Mark:
        goodput, busy = [], []
        for r in records:
            step_s = float(r.get("time/step_s", 0.0))
            if step_s > 0:
                good = float(r.get("tokens/generated", 0.0)) - float(r.get("tokens/wasted", 0.0))
                goodput.append(good / step_s)
                busy.append(1.0 - float(r.get("async/trainer_idle_ratio", 0.0)))
        return cls(depth, _Estimate.of(goodput), _Estimate.of(busy), step)


def _better(a: _Mark, b: _Mark, margin: float) -> bool:
    """Whether `a` did better than `b` by `margin`: more goodput, or the trainer busier."""
    return a.busy.exceeds(b.busy, margin) or a.goodput.exceeds(b.goodput, margin)


def _worse(a: _Mark, b: _Mark, margin: float) -> bool:
    """Whether `a` did worse than `b`: less goodput by `margin`, and the trainer no busier."""
    return b.goodput.exceeds(a.goodput, margin) and a.busy.mean <= b.busy.mean


class DepthController:
    """The pipeline depth of `pipeline_depth: auto`, in [0, `ceiling`]; `observe` each step's
    record, and it returns the change it made, if any."""

    def __init__(self, config: AutoDepthConfig, ceiling: int) -> None:
        if ceiling < 0:
            raise ValueError(f"no pipeline depth fits the staleness bound (ceiling {ceiling})")
        self.config = config
        self.ceiling = ceiling
        self.depth = min(config.initial, ceiling)
        self.changes: list[tuple[int, DepthChange]] = []  # (step, change)
        self._steps = 0
        self._window = _Totals()  # the steps since the last judgment
        self._since = 0
        # The last steps judged at this depth since the move to it: what it gives now.
        self._stay: deque[Mapping[str, float]] = deque(maxlen=STAY_STEPS)
        self._wait = 0  # steps to let pass before judging again
        self._lag = 0.0  # the consumed groups' staleness, recent steps weighing most
        self._cap, self._floor = ceiling, 0  # limits from failed trials and budgets...
        self._cap_until = self._floor_until = 0  # ...until these steps
        self._cap_for_drops = False  # whether the cap is from groups over the bound (3)
        self._below: list[_Mark] = []  # the depths moved up from, each with what it gave
        self._above: _Mark | None = None  # the depth a judged move down came from
        self._above_over_bound = False  # whether that move was for groups over the bound
        self._trial: int | None = None  # the step of the last move not yet judged to stand
        self._undone = 0  # moves undone in a row: each doubles how long the next limit holds

    @property
    def cap(self) -> int:
        """The highest depth the controller may move up to now."""
        return self._cap if self._steps < self._cap_until else self.ceiling

    @property
    def floor(self) -> int:
        """The lowest depth the controller may move down to now, but for a budget."""
        return self._floor if self._steps < self._floor_until else 0

    def observe(self, record: Mapping[str, float]) -> DepthChange | None:
        """Take one step's record (`time/step_s`, `async/trainer_idle_ratio`,
        `async/generation_idle_ratio`, `tokens/generated`, `tokens/wasted`,
        `groups/dropped_stale`, `groups/consumed`, `rollout/timeouts`, `staleness/mean`,
        `loss/sampler_kl`, `loss/num_tokens`); the change it makes after it, if any. The first
        step (the pipeline filling) is not judged."""
        self._steps += 1
        if self._steps == 1:
            return None
        if "staleness/mean" in record:
            self._lag += 0.5 * (float(record["staleness/mean"]) - self._lag)
        if self._wait:
            self._wait -= 1
            return None
        self._window.add(record)
        self._stay.append(record)
        self._since += 1
        if self._since < self.config.hold_steps:
            return None
        change = self._decide(self._window)
        if change is not None:
            self._move(change)
        self._window, self._since = _Totals(), 0
        return change

    def _move(self, change: DepthChange) -> None:
        left = _Mark.of(change.old, self._stay, self._steps)
        if change.new > change.old:
            self._below.append(left)
            self._above = None
        else:
            self._below = [m for m in self._below if m.depth < change.new]
            judged = change.reason in ("worse", "generation_idle", "over_bound")
            self._above = left if judged else None
            self._above_over_bound = change.reason == "over_bound"
        if change.reason in ("worse", "over_bound"):  # the depth left had failed
            self._undone, self._trial = self._undone + 1, None
        else:
            self._trial = self._steps
        self.depth = change.new
        self.changes.append((self._steps, change))
        self._stay.clear()
        # Groups admitted before the move arrive for about as many steps as the consumed
        # groups' staleness, and those admitted after it take as long; after a move down,
        # those admitted at the deeper depth may come (or be dropped) up to that depth later.
        drain = change.old + 1 if change.new < change.old else 0
        self._wait = max(1, math.ceil(self._lag), drain)

    def _decide(self, w: _Totals) -> DepthChange | None:
        c, d = self.config, self.depth
        here = _Mark.of(d, self._stay, self._steps)
        # A move is judged against the depth it left for `retry_steps`; then it stands.
        recent = self._steps - c.retry_steps
        if self._trial is not None and self._trial < recent:
            self._undone, self._trial = 0, None
        over = self._over_budget(w)
        if over is not None:  # back where the last move up came from, or one lower
            new = self._below[-1].depth if self._below else d - 1
            if new < 0:
                return None
            self._limit(new, c.retry_steps)
            return DepthChange(d, new, over)
        above = self._above
        if above is not None and above.step >= recent and self._undo_down(above, here):
            # The move down made things worse: back up, and not below that for a while. A move
            # down for groups over the bound had counted as a failed trial of the depth it left:
            # that depth did better, so the failure is this move's alone, not one more.
            if self._above_over_bound:
                self._undone = max(0, self._undone - 1)
            self._cap = max(self.cap, above.depth)  # a limit from before the move still holds
            self._floor, self._floor_until = above.depth, self._steps + self._hold()
            return DepthChange(d, above.depth, "worse")
        below = self._below[-1] if self._below else None
        if (
            below is not None
            and below.step >= recent
            and below.depth >= self.floor
            and _worse(here, below, c.min_gain)
        ):
            # The move up made things worse (its waste shows up late): back, not up again soon.
            self._limit(below.depth, self._hold())
            return DepthChange(d, below.depth, "worse")
        dropping = w.taken and w.dropped / w.taken > c.min_gain and not w.timeouts
        if w.idle > c.target_idle and dropping and d > self.floor:
            # Generation-bound and dropping groups over the bound: a shallower pipeline runs
            # fewer rollouts at once, each faster, so fewer go over it. No higher until judged
            # (the wait after a move down, the old depth + 1 steps, then a stay's steps), and
            # as a failed trial: longer for each in a row, as the deeper depth keeps failing.
            self._limit(d - 1, max(d + 1 + STAY_STEPS, self._hold()), for_drops=True)
            return DepthChange(d, d - 1, "over_bound")
        if w.idle > c.target_idle and w.timeouts and self._cap_for_drops:
            # Hung rollouts stall a shallow pipeline, and a deeper one flows around them: the
            # drops that set the cap are the lesser cost now.
            self._cap_until = 0
        if w.idle > c.target_idle:
            new = min(self.cap, d + max(1, d) if w.idle > 4 * c.target_idle else d + 1)
            new = self._within_budgets(w, new)
            return DepthChange(d, new, "trainer_idle") if new > d else None
        if w.idle < c.target_idle / 2 and w.generation_idle > c.generation_idle and d > self.floor:
            return DepthChange(d, d - 1, "generation_idle")
        return None

    def _hold(self) -> int:
        """How long a limit from a failed move holds: `retry_steps`, twice as long for each
        failed move in a row before it (at most 8x)."""
        return self.config.retry_steps << min(self._undone, 3)

    def _limit(self, cap: int, steps: int, *, for_drops: bool = False) -> None:
        """No deeper than `cap` for `steps` steps; `for_drops`: set by groups over the bound."""
        self._cap, self._cap_until, self._cap_for_drops = cap, self._steps + steps, for_drops

    def _undo_down(self, above: _Mark, here: _Mark) -> bool:
        """Whether the move down from `above` made things worse: the depth it left did better
        (beyond the steps' noise); or, for a move made for groups over the bound, gave more
        goodput on the mean over a whole stay here (the move's premise, that fewer rollouts at
        once lose fewer groups, did not pay), the mean there taken over at least half a stay
        (the mean of one or two heavy-tailed steps is noise)."""
        if _better(above, here, self.config.min_gain):
            return True
        full = here.goodput.n >= STAY_STEPS and above.goodput.n >= STAY_STEPS // 2
        return self._above_over_bound and full and above.goodput.mean > here.goodput.mean

    def _within_budgets(self, w: _Totals, new: int) -> int:
        """The deepest depth up to `new` whose consumed groups' staleness, and the sampler KL
        that grows with it, the judged steps predict within `max_mean_staleness` and
        `max_sampler_kl`: each depth deeper adds about one version to the staleness of what the
        trainer takes, and the KL grows in proportion to it."""
        c, d = self.config, self.depth
        if not w.staleness_steps:
            return new
        staleness = w.staleness / w.staleness_steps
        kl = w.sampler_kl / w.trained if w.trained else 0.0
        while new > d:
            predicted = staleness + new - d
            if (c.max_mean_staleness is None or predicted <= c.max_mean_staleness) and (
                c.max_sampler_kl is None
                or staleness <= 0
                or kl * predicted / staleness <= c.max_sampler_kl
            ):
                break
            new -= 1
        return new

    def _over_budget(self, w: _Totals) -> str | None:
        """The first budget the judged steps exceed (`waste`, `dropped`, `staleness`,
        `sampler_kl`), if any."""
        c = self.config
        if c.max_waste is not None and w.generated and w.wasted / w.generated > c.max_waste:
            return "waste"
        if c.max_dropped is not None and w.taken and w.dropped / w.taken > c.max_dropped:
            return "dropped"
        staleness = w.staleness / w.staleness_steps if w.staleness_steps else 0.0
        if c.max_mean_staleness is not None and staleness > c.max_mean_staleness:
            return "staleness"
        kl = w.sampler_kl / w.trained if w.trained else 0.0
        if c.max_sampler_kl is not None and kl > c.max_sampler_kl:
            return "sampler_kl"
        return None
