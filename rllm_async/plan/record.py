"""The workload a run records for `rllm-async plan`: rollout lengths and times, train and sync times.

Bounded in size: rollouts are a reservoir sample of whole groups (about `cap` rows: a group's
rollouts share a task, and their lengths with it), steps the first `cap`; each row says which kept
group it belongs to and whether that group was filtered, and the seconds it spent outside model
calls (tools, environment, reward). The engine's load is the number of rollouts in a model call
(`RolloutMeter`, which each rollout's context tells when a call begins and ends): each rollout
carries the mean of it over its calls and, for each `c` in `OFFSETS`, the integral of
dt / (load + c) over its calls: under processor sharing with R(n) = rmax n / (n + n_half) a
rollout of L tokens has L = rmax * that integral at c = n_half, so the engine's decode rate as a
function of its load can be fitted from the rows alone. The same integrals over the time the
learner was training (`inv_train`) and syncing weights (`inv_sync`) tell how much of that rate
generation keeps beside each: none during a sync that pauses the engine, a fraction while
training shares the engine's processors. Each step also carries its forward-backward calls with
the part of each during which a model call ran (`calls`), from which the learner's own slowdown
beside generation is fitted, and the run's `config.yaml` beside the record tells whether its
backend runs generation and training on one device.

The trainer imports this module, and no other of the planner: it imports nothing of the fit, the
replay or the simulator (`fit.py`, `replay.py`, `simulate.py`), which lie above the trainer.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import numpy as np

from rllm_async.types import Episode

FILE_NAME = "workload.jsonl"
CAP = 2048
OFFSETS = (0.0, 4.0, 8.0, 16.0, 32.0, 64.0, 128.0, 256.0, 512.0, 1024.0)
PHASES = ("train", "sync")  # what the learner may be doing beside generation
_OFFSETS = np.array(OFFSETS)
_BATCH = 4096  # pending starts and ends integrated at once
_ACC_COLUMNS = 2 + (1 + len(PHASES)) * len(OFFSETS)  # a kept rollout's time, area, integrals


@dataclass(slots=True)
class RolloutRow:
    """One finished rollout: tokens, turns, virtual or real seconds, and the mean number of
    rollouts in a model call during its own calls."""

    start: float
    end: float
    prompt: int
    completion: int
    turns: int
    active: float
    inv: list[float]
    # Seconds outside model calls (a call's wait for a weight sync is inside it): tools,
    # environment, reward (None: recorded before these were).
    tool_s: float | None = None
    # The parts of `inv` spent while the learner trained and synced weights (None: recorded
    # before these were, read as generation beside nothing).
    inv_train: list[float] | None = None
    inv_sync: list[float] | None = None
    # The kept group it belongs to (None: recorded before groups were), and whether that group
    # was filtered (None: not known, as for a group that failed or that the run's end cancelled).
    group: int | None = None
    filtered: bool | None = None


@dataclass(slots=True)
class StepRow:
    """One optimizer step: completion tokens trained, their forward-backward, optim and sync time."""

    step: int
    end: float
    tokens: int
    train_s: float
    optim_s: float
    sync_s: float
    # Its forward-backward calls: [tokens, seconds, the seconds of them during which at least
    # one rollout was running] (None: recorded before these were).
    calls: list[list[float]] | None = None


@dataclass(slots=True)
class KeptGroup:
    """A dispatched group the reservoir keeps: its number among the started groups, its rollouts
    that finished with an episode (each one's accumulator slot, end time, prompt and completion
    tokens and turns), and whether it was filtered once it ended."""

    id: int
    done: list[tuple[int, float, int, int, int]] = field(default_factory=list)
    filtered: bool | None = None


class RolloutMeter:
    """One rollout as its context reports it to the recorder: each model call's beginning and
    end (`rllm_async.rollout.CallMeter`); the engine's load is the number of rollouts in a call.
    A kept rollout's meter has its group and a `slot` in the recorder's accumulator, which adds
    up its calls' seconds and integrals; every other rollout shares one meter without."""

    __slots__ = ("_recorder", "group", "slot")

    def __init__(
        self, recorder: WorkloadRecorder, group: KeptGroup | None, slot: int | None
    ) -> None:
        self._recorder, self.group, self.slot = recorder, group, slot

    def call_began(self) -> None:
        self._recorder._load(1, self.slot, -1.0)

    def call_ended(self) -> None:
        self._recorder._load(-1, self.slot, 1.0)


@dataclass(slots=True)
class Workload:
    """A recorded workload: the run's settings (`meta`), sampled rollouts and steps, and the run's
    `config.yaml` where it lies beside the record (None otherwise)."""

    meta: dict[str, Any]
    rollouts: list[RolloutRow] = field(default_factory=list)
    steps: list[StepRow] = field(default_factory=list)
    rollouts_seen: int = 0
    config: dict[str, Any] | None = field(default=None, compare=False)


class WorkloadRecorder:
    """Collects a run's workload; `write` puts it in the run directory.

    Which groups are kept is decided when they are dispatched (a reservoir sample of
    `cap // meta["group_size"]` groups); every model call's beginning and end is logged, and the
    running integrals advance over the log in batches.
    """

    def __init__(
        self,
        meta: dict[str, Any],
        *,
        clock: Callable[[], float],
        start: float = 0.0,
        cap: int = CAP,
        seed: int = 0,
    ) -> None:
        self.meta = {**meta, "start": start}
        self.clock = clock  # what the meters time model calls on: the event loop's
        self.cap = cap
        self._group_cap = max(1, cap // int(meta.get("group_size", 1)))
        self._groups: list[KeptGroup] = []  # by reservoir slot
        self._steps: list[StepRow] = []
        self._finished = 0
        self._rng = random.Random(seed)
        self._groups_started = 0
        self._active = 0
        self._area = 0.0  # integral of the active count over time
        # Integrals of dt / (active + c), c in OFFSETS: over all time, then over each phase.
        self._inv = np.zeros((1 + len(PHASES), len(OFFSETS)))
        self._phase = 0  # 0: none, else 1 + the index in PHASES
        # Seconds with at least one model call running: in all, then in each phase; and the
        # training part of it when the last forward-backward call ended.
        self._busy = np.zeros(1 + len(PHASES))
        self._train_busy = 0.0
        self._t_last = start
        # Calls' beginnings and ends not yet integrated: when, and how many rollouts were in a
        # call until then. Integrating them in a batch keeps a call's cost to two appends (16k
        # rollouts in flight end thousands of times a second); the integrals are brought up to
        # date when read.
        self._times: list[float] = []
        self._counts: list[int] = []
        # Where a kept rollout's call began (sign -1) or ended (+1): the event's index in the
        # log, and the rollout's slot in `_acc`, which adds up sign * (the time, the area and
        # the integrals there), so that each row holds its calls' seconds and integrals.
        self._marks: list[tuple[int, int, float]] = []
        self._acc = np.zeros((64, _ACC_COLUMNS))
        self._starts: list[float] = []  # by slot
        self._unkept = RolloutMeter(self, None, None)
        self._tokens = 0
        self._train_s = 0.0
        self._calls: list[list[float]] = []

    def _load(self, change: int, slot: int | None = None, sign: float = 0.0) -> None:
        """`change` rollouts entered (or left) a model call now; a kept rollout's `slot` gets
        `sign` times the integrals there once they are known."""
        times = self._times
        if slot is not None:
            self._marks.append((len(times), slot, sign))
        times.append(self.clock())
        self._counts.append(self._active)
        self._active += change
        if len(times) >= _BATCH:
            self._integrate()

    def _integrate(self) -> None:
        """Fold the logged events into the running integrals, and the marks into `_acc`."""
        if not self._times:
            return
        t = np.array(self._times)
        n = np.array(self._counts, dtype=float)[:, None]
        dt = np.maximum(np.diff(t, prepend=self._t_last), 0.0)[:, None]
        area = self._area + np.cumsum(n * dt)
        rates = np.divide(dt, n + _OFFSETS, out=np.zeros((len(t), len(OFFSETS))), where=n > 0)
        inv = np.cumsum(rates, axis=0)
        busy = float((dt[:, 0] * (n[:, 0] > 0)).sum())
        self._busy[0] += busy
        if self._phase:
            self._busy[self._phase] += busy
        if self._marks:
            marks = np.array(self._marks)
            at, slots = marks[:, 0].astype(int), marks[:, 1].astype(int)
            values = np.empty((len(at), _ACC_COLUMNS))
            values[:, 0] = t[at]
            values[:, 1] = area[at]
            values[:, 2:] = self._with(inv[at]).reshape(len(at), -1)
            np.add.at(self._acc, slots, marks[:, 2:] * values)
        self._area, self._inv = float(area[-1]), self._with(inv[-1])
        self._t_last = max(self._t_last, self._times[-1])
        self._times.clear()
        self._counts.clear()
        self._marks.clear()

    def _with(self, step: np.ndarray) -> np.ndarray:
        """The integrals with `step` (one row, or one per event) more of this phase."""
        out = np.broadcast_to(self._inv, step.shape[:-1] + self._inv.shape).copy()
        out[..., 0, :] += step
        if self._phase:
            out[..., self._phase, :] += step
        return out

    def phase(self, name: str | None) -> None:
        """From now on the learner is doing `name` (one of `PHASES`), or nothing (None)."""
        self._load(0)
        self._integrate()
        self._phase = 0 if name is None else 1 + PHASES.index(name)

    def group_started(self) -> KeptGroup | None:
        """A group was dispatched; the group to hand to `started` and `group_ended` (None when
        it is not kept: a kept one replaces one kept before it)."""
        self._groups_started += 1
        slot = self._groups_started - 1
        if slot >= self._group_cap:
            slot = self._rng.randrange(self._groups_started)
        if slot >= self._group_cap:
            return None
        group = KeptGroup(self._groups_started - 1)
        if slot < len(self._groups):
            self._groups[slot] = group
        else:
            self._groups.append(group)
        return group

    def group_ended(self, group: KeptGroup | None, filtered: bool | None) -> None:
        """A group's rollouts all ended; it was `filtered` or trained on (None: neither)."""
        if group is not None:
            group.filtered = filtered

    def started(self, group: KeptGroup | None) -> RolloutMeter:
        """A rollout of `group` starts now; the meter its model calls report to, to hand to
        `finished` (with a slot of its own when its group is kept)."""
        if group is None:
            return self._unkept
        slot = len(self._starts)
        self._starts.append(self.clock())
        if slot == len(self._acc):
            self._acc = np.concatenate([self._acc, np.zeros_like(self._acc)])
        return RolloutMeter(self, group, slot)

    def finished(self, meter: RolloutMeter, episode: Episode | None) -> None:
        """A rollout ended now, its calls too; recorded when it was kept and produced an episode."""
        if episode is None:
            return
        self._finished += 1
        group = meter.group
        if group is not None and meter.slot is not None:
            steps = [s for t in episode.trajectories for s in t.steps]
            prompt = len(steps[0].prompt_ids) if steps else 0
            completion = episode.num_completion_tokens
            group.done.append((meter.slot, self.clock(), prompt, completion, len(steps)))

    def _row(
        self, group: KeptGroup, slot: int, end: float, prompt: int, completion: int, turns: int
    ) -> RolloutRow:
        """The row of a kept rollout that ended at `end`, its calls integrated."""
        start, acc = self._starts[slot], self._acc[slot]
        model_s, area = float(acc[0]), float(acc[1])
        inv = acc[2:].reshape(1 + len(PHASES), len(OFFSETS)).tolist()
        return RolloutRow(
            start=start,
            end=end,
            prompt=prompt,
            completion=completion,
            turns=turns,
            active=area / model_s if model_s > 0 else 0.0,
            inv=inv[0],
            tool_s=max(0.0, end - start - model_s),
            inv_train=inv[1],
            inv_sync=inv[2],
            group=group.id,
            filtered=group.filtered,
        )

    @property
    def workload(self) -> Workload:
        """What was recorded so far."""
        self._integrate()
        rows = [self._row(group, *done) for group in self._groups for done in group.done]
        return Workload(self.meta, rows, list(self._steps), self._finished)

    def trained(self, tokens: int, seconds: float) -> None:
        """One forward-backward call of `tokens` completion tokens took `seconds` (the training
        phase that just ended)."""
        self._integrate()
        train_busy = float(self._busy[1 + PHASES.index("train")])
        beside = min(train_busy - self._train_busy, seconds)
        self._train_busy = train_busy
        self._tokens += tokens
        self._train_s += seconds
        self._calls.append([tokens, seconds, beside])

    def step(self, step: int, now: float, optim_s: float, sync_s: float) -> None:
        """An optimizer step ended; the forward-backward calls since the last one belong to it."""
        if len(self._steps) < self.cap:
            row = StepRow(step, now, self._tokens, self._train_s, optim_s, sync_s, self._calls)
            self._steps.append(row)
        self._tokens, self._train_s, self._calls = 0, 0.0, []

    def write(self, run_path: Path) -> Path:
        """Write `workload.jsonl` (a meta line, then one line per row) into `run_path`."""
        path = Path(run_path) / FILE_NAME
        return write_workload(self.workload, path)


def write_workload(workload: Workload, path: Path) -> Path:
    """Write `workload` as JSON lines at `path`."""
    w = workload
    lines = [json.dumps({"kind": "meta", **w.meta, "rollouts_seen": w.rollouts_seen})]
    lines += [json.dumps({"kind": "rollout", **_row(r)}) for r in w.rollouts]
    lines += [json.dumps({"kind": "step", **_row(s)}) for s in w.steps]
    path.write_text("\n".join(lines) + "\n")
    return path


def _row(row: RolloutRow | StepRow) -> dict[str, Any]:
    """A row's fields (not `dataclasses.asdict`, which deep-copies every list on the way)."""
    return {f.name: getattr(row, f.name) for f in fields(row)}


def read_workload(path: Path) -> Workload:
    """Read a `workload.jsonl` file, the one in a run directory, or the first one a level below."""
    path = Path(path)
    if path.is_dir():
        found = [path / FILE_NAME] if (path / FILE_NAME).exists() else []
        path = (found or sorted(path.glob(f"*/{FILE_NAME}")) or [path / FILE_NAME])[0]
    if not path.exists():
        raise FileNotFoundError(f"{path}: no recorded workload (runs write it when they end)")
    config = path.parent / "config.yaml"
    workload = Workload({}, config=_read_config(config) if config.exists() else None)
    for line in path.read_text().splitlines():
        row = json.loads(line)
        kind = row.pop("kind")
        if kind == "meta":
            workload.rollouts_seen = int(row.pop("rollouts_seen", 0))
            workload.meta = row
        elif kind == "rollout":
            workload.rollouts.append(RolloutRow(**row))
        elif kind == "step":
            workload.steps.append(StepRow(**row))
    return workload


def _read_config(path: Path) -> dict[str, Any] | None:
    """The run's `config.yaml` as plain data (None if it is not a mapping)."""
    from omegaconf import OmegaConf

    data = OmegaConf.to_container(OmegaConf.load(path))
    return {str(k): v for k, v in data.items()} if isinstance(data, dict) else None
