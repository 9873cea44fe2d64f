"""A sim workload fitted to a recorded run (`workload.jsonl`), for `rllm-async plan` to replay: the
rollout lengths drawn from the recorded ones, the engine's decode rate as a function of the number
of active rollouts, training seconds per completion token, optimizer-step and weight-sync seconds;
what it measured and what it assumed, in words.

Where generation and training shared one device, each slows the other, and a record shows the
speeds of its own mode's overlap only. Its own mode is replayed as recorded; the other mode (sync
from an async record, async from a sync one) from the speeds each has alone and the shares of them
each keeps beside the other (`FittedWorkload.other`). Given a record of the same job in the other
mode (a twin), that mode is replayed from the twin's own fit instead.

Past 400 lines because each parameter's fit sits beside the words saying what it measured or
assumed, and the two modes' speeds are fitted from the same rows.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from rllm_async.backends import get_backend_factory
from rllm_async.config import ConfigError
from rllm_async.plan.record import OFFSETS, RolloutRow, StepRow, Workload
from rllm_async.workflows.sim import RecordedGroup, RecordedRollout

DEFAULT_N_HALF = 64.0
# On a device shared by generation and training, the share of its speed each keeps beside the
# other where the record cannot tell: a device time-shared evenly.
SHARED_SHARE = 0.5
# A phase must hold this part of generation (or of training) for its share to be measured.
SEEN = 0.1
# What a twin record must share with the record it completes: the job, whatever the mode.
JOB_KEYS = ("groups_per_step", "group_size", "max_tokens")
ALONE_OR_NOT = "training seconds per token are what this run measured, beside generation or not"


@dataclass
class FittedWorkload:
    """A sim workload fitted to a record: the sim backend's options and the recorded groups."""

    groups: list[RecordedGroup]
    rmax: float
    n_half: float
    train_rate: float
    t_optim: float
    t_sync: float
    meta: dict[str, Any]
    measured_step_s: float
    filter_rate: float = 0.0
    train_share: float = 1.0  # of the decode rate, while the learner trains
    sync_share: float = 1.0  # of the decode rate, while it syncs weights
    measured: list[str] = field(default_factory=list)
    assumed: list[str] = field(default_factory=list)
    learner_share: float = 1.0  # of the training speed, while generation decodes
    shared_device: bool | None = None  # None: the record does not say
    # The fit that replays the other mode than the recorded one: a twin record's, or where the
    # device was shared, this record's speeds alone and the shares each keeps beside the other.
    other: FittedWorkload | None = None

    @property
    def lengths(self) -> list[int]:
        """The recorded completion lengths the replay draws from, sorted."""
        return sorted(r.completion for g in self.groups for r in g.rollouts)

    def for_mode(self, mode: str) -> FittedWorkload:
        """The fit to replay `mode` with: this one, or `other` for the other mode."""
        return self.other if self.other is not None and mode != self.meta["mode"] else self

    def scaled(self, servers: float = 1.0, batch: float = 1.0) -> FittedWorkload:
        """This workload with `servers` times the rollout servers and `batch` times the groups."""
        meta = dict(self.meta)
        meta["max_concurrency"] = max(1, round(meta["max_concurrency"] * servers))
        meta["groups_per_step"] = max(1, round(meta["groups_per_step"] * batch))
        assumed = list(self.assumed)
        if servers != 1:
            assumed.append(
                f"{servers:g}x rollout servers: decode rate and concurrency scale linearly "
                "(identical servers, perfect load balance); the trainer is unchanged"
            )
        if batch != 1:
            assumed.append(
                f"{batch:g}x groups per step: training time grows with the tokens, "
                "optimizer-step and weight-sync times stay as measured"
            )
        return FittedWorkload(
            self.groups,
            self.rmax * servers,
            self.n_half * servers,
            self.train_rate,
            self.t_optim,
            self.t_sync,
            meta,
            math.nan if servers != 1 or batch != 1 else self.measured_step_s,
            self.filter_rate,
            self.train_share,
            self.sync_share,
            list(self.measured),
            assumed,
            self.learner_share,
            self.shared_device,
            None if self.other is None else self.other.scaled(servers, batch),
        )

    def on_devices(self, gen: float, train: float) -> FittedWorkload:
        """This workload with generation and training each on devices of its own, `gen` and
        `train` times the devices each had in the record: the decode rate and concurrency scale
        with `gen` (as `scaled`), training tokens/s with `train`, from the speeds each had alone
        where the recorded device was shared; neither slows the other."""
        alone = self.other if self.other is not None else self
        meta = dict(self.meta)
        meta["max_concurrency"] = max(1, round(meta["max_concurrency"] * gen))
        assumed = [
            *self.assumed,
            f"{gen:g}x the generation devices and {train:g}x the training devices, each on "
            "devices of its own: decode rate and concurrency scale linearly with the first, "
            "training tokens/s with the second (perfect data parallelism), optimizer-step and "
            "weight-sync times stay as measured, and neither slows the other",
        ]
        return FittedWorkload(
            self.groups,
            alone.rmax * gen,
            self.n_half * gen,
            alone.train_rate * train,
            self.t_optim,
            self.t_sync,
            meta,
            math.nan,
            self.filter_rate,
            1.0,
            self.sync_share,
            list(self.measured),
            assumed,
            1.0,
            False,
        )


def fit_workload(
    workload: Workload, twin: Workload | None = None, twin_name: str = "the twin"
) -> FittedWorkload:
    """Fit the sim backend's parameters to a recorded workload; with `twin`, a record of the same
    job in the other mode (named `twin_name` in what is measured and assumed), that mode is
    replayed from the twin's own fit rather than modelled from this record."""
    if twin is None:
        return _fit_record(workload, model_other_mode=True)
    own = _fit_record(workload, model_other_mode=False)
    other = _fit_record(twin, model_other_mode=False)
    mine, theirs = own.meta, other.meta
    if mine["mode"] == theirs["mode"]:
        raise ConfigError(
            f"both records ran mode: {mine['mode']}; give a record of the same job in the other "
            "mode as the twin (or plan from one record)"
        )
    differ = [k for k in JOB_KEYS if mine.get(k) != theirs.get(k)]
    if differ:
        said = ", ".join(f"{k} {mine.get(k)} and {theirs.get(k)}" for k in differ)
        raise ConfigError(
            f"the records ran different jobs ({said}): give a twin that ran the same job in the "
            "other mode"
        )
    say = f"replays of {theirs['mode']} mode, from {twin_name}"
    own.measured += [f"{say}: {m}" for m in other.measured]
    own.assumed += [f"{say}: {a}" for a in other.assumed]
    own.other = other
    return own


def _fit_record(workload: Workload, *, model_other_mode: bool) -> FittedWorkload:
    """`fit_workload` of one record; with `model_other_mode`, `FittedWorkload.other` from its own
    speeds where the device was shared, and an "assumed" line where the record cannot tell."""
    rows = [r for r in workload.rollouts if r.completion > 0 and r.end > r.start]
    steps = workload.steps
    if not rows or not steps:
        raise ConfigError("the recorded workload has no finished rollouts or no steps to fit")
    meta = workload.meta
    # Rollouts still running at the end were never recorded, and those are the long ones: the
    # lengths come from groups that started early enough that any of the observed durations
    # would have finished.
    end = max(r.end for r in rows)
    longest = max(r.end - r.start for r in rows)
    grouped = _grouped(rows, int(meta["group_size"]))
    early = [g for g in grouped if min(r.start for r in g) <= end - longest]
    drawn = early if sum(map(len, early)) >= min(len(rows), 100) else grouped
    groups = [
        RecordedGroup(rollouts=[_recorded(r) for r in g], filtered=g[0].filtered) for g in drawn
    ]
    outcomes = sum(g.filtered is not None for g in groups)
    measured = [
        f"rollout lengths: {sum(map(len, drawn))} recorded rollouts of {len(drawn)} groups that "
        f"started {longest:.1f} s or more before the end ({workload.rollouts_seen} finished), "
        "drawn a group per task",
        "training seconds per completion token, optimizer-step and weight-sync seconds: "
        f"{max(1, len(steps) - 1)} recorded steps after the first",
        "step times after the first step, which holds the engine's and the learner's warm-up "
        "(measured and replayed alike)",
    ]
    assumed = [
        "each rollout's turns are model calls of equal length, its time outside them shared out "
        "after each; prompt prefill is not modelled",
        "groups are filtered as recorded (a drawn group as it was, at the recorded rate where "
        "that is not known), independently of the setting; no failures",
        "the engine shares its decode rate evenly over the active rollouts (processor sharing)",
        ALONE_OR_NOT,
    ]
    if all(r.tool_s is not None for r in rows):
        outside = sum(r.tool_s or 0.0 for r in rows) / sum(r.end - r.start for r in rows)
        measured.append(
            f"time outside model calls (tools, environment, reward): {outside:.0%} of the "
            "rollouts' time, replayed per rollout"
        )
    else:
        assumed.append(
            "no time outside model calls: the rollouts' whole time decoded (a record from before "
            "it was measured)"
        )
    if any(r.group is None for r in rows):
        assumed.append(
            "the rollouts of a group have independent lengths (a record from before groups were "
            "kept whole)"
        )
    if outcomes:
        measured.append(
            f"which groups were filtered: {outcomes} of the {len(groups)} drawn, replayed with "
            "their lengths"
        )
    # The first step holds the engine's warm-up (vLLM's first batch took 19 s where later ones
    # took about 1 s): it is left out of the decode rate and of the measured step time.
    warm = [r for r in rows if r.end > steps[0].end]
    if len(warm) >= min(100, len(rows) // 2):
        rows = warm
    phased = all(r.inv_train is not None and r.inv_sync is not None for r in rows)
    rmax, n_half, identified, shares = _fit_rate(rows)
    if phased:
        measured.append(
            f"decoding beside the learner: {shares[0]:.0%} of the rate while it trains, "
            f"{shares[1]:.0%} while it syncs weights"
        )
    else:
        assumed.append(
            "generation decodes at its full rate while the learner trains and syncs weights "
            "(a record from before these were measured)"
        )
    active = [r.active for r in rows]
    rate = f"R(n) = {rmax:.0f} n / (n + {n_half:g}) tok/s"
    if identified:
        measured.append(
            f"decode rate vs concurrency: {rate}, fitted on {min(active):.0f}-{max(active):.0f} "
            "mean active rollouts"
        )
    else:
        assumed.append(
            f"decode rate vs concurrency: {rate}; concurrency hardly varied "
            f"({min(active):.0f}-{max(active):.0f} active), so n_half = {n_half:g} is assumed "
            "and rmax follows from it"
        )
    slots = engine_slots(workload)
    if slots is not None and int(meta["max_concurrency"]) > slots:
        assumed.append(_beyond_slots(slots, int(meta["max_concurrency"]), active))
    # The first step also holds the learner's warm-up (on a GPU, 0.6 s where later steps took
    # 0.12): left out of training's speed, as out of the step times.
    timed = steps[1:] or steps
    tokens = sum(s.tokens for s in timed)
    train_s = sum(s.train_s for s in timed)
    train_rate = tokens / train_s if train_s > 0 else 1e12
    counts = meta.get("groups", {})
    ended = sum(counts.get(k, 0) for k in ("consumed", "filtered", "failed", "dropped_stale"))
    filter_rate = counts.get("filtered", 0) / ended if ended else 0.0
    measured.append(f"filtered groups: {filter_rate:.1%} of the {ended} that ended")
    n = len(steps)
    measured_step_s = (
        (steps[-1].end - steps[0].end) / (n - 1)
        if n > 1
        else steps[0].end - float(meta.get("start", 0.0))
    )
    own = FittedWorkload(
        groups=groups,
        rmax=rmax,
        n_half=n_half,
        train_rate=train_rate,
        t_optim=sum(s.optim_s for s in timed) / len(timed),
        t_sync=sum(s.sync_s for s in timed) / len(timed),
        meta=meta,
        measured_step_s=measured_step_s,
        filter_rate=filter_rate,
        train_share=shares[0],
        sync_share=shares[1],
        measured=measured,
        assumed=assumed,
        shared_device=shared_device(workload),
    )
    if not model_other_mode:
        return own
    if own.shared_device:
        mode = meta["mode"]
        assumed[assumed.index(ALONE_OR_NOT)] = f"replays of {mode} mode: {ALONE_OR_NOT}"
        overlap = _overlap(rows, n_half)
        own.other = _other_mode(own, timed, overlap)
    elif own.shared_device is None:
        assumed.append(
            "generation and training run on devices of their own (the record does not say "
            "whether they shared one), so the other mode is replayed at this mode's speeds"
        )
    return own


def _recorded(row: RolloutRow) -> RecordedRollout:
    """What the replay takes of a recorded rollout."""
    return RecordedRollout(
        completion=row.completion, turns=max(1, row.turns), tool_s=row.tool_s or 0.0
    )


def _grouped(rows: list[RolloutRow], group_size: int) -> list[list[RolloutRow]]:
    """The rows by the group they belong to; rows recorded before groups were, in groups of
    `group_size` drawn at random (their lengths independent)."""
    by_group: dict[int, list[RolloutRow]] = {}
    loose = []
    for row in rows:
        if row.group is None:
            loose.append(row)
        else:
            by_group.setdefault(row.group, []).append(row)
    order = np.random.default_rng(0).permutation(len(loose))
    shuffled = [loose[i] for i in order]
    size = max(1, group_size)
    return [*by_group.values(), *(shuffled[i : i + size] for i in range(0, len(shuffled), size))]


def shared_device(workload: Workload) -> bool | None:
    """Whether the recorded run's generation and training shared one device, as its backend
    tells from the run's `config.yaml` (`shares_device`)."""
    answer = _ask_backend(workload, "shares_device")
    return None if answer is None else bool(answer)


def engine_slots(workload: Workload) -> int | None:
    """The most sequences the recorded run's engine decoded together, as its backend tells from
    the run's `config.yaml` (`decode_slots`)."""
    answer = _ask_backend(workload, "decode_slots")
    return None if answer is None else int(answer)


def _ask_backend(workload: Workload, question: str) -> Any:
    """What the recorded run's backend class answers to `question(options)` about its `backend:`
    options; None where no config lies beside the record, the backend is not installed where the
    plan runs or does not answer, or the options are of another version of it."""
    backend = dict((workload.config or {}).get("backend") or {})
    try:
        factory = get_backend_factory(str(backend.pop("name", None)))
    except ConfigError:
        return None
    ask = getattr(factory, question, None)
    try:
        return None if ask is None else ask(backend)
    except ValueError:
        return None


def _beyond_slots(slots: int, concurrency: int, active: list[float]) -> str:
    """What the replay assumes where more rollouts may be in flight than the engine decodes
    together: the rate as fitted on the rollouts in flight, for all of them."""
    head = (
        f"the engine decodes at most {slots} sequences together (the run's config), the rest "
        f"waiting their turn; the replay shares R(n) over all rollouts in flight, up to "
        f"{concurrency}"
    )
    over = sum(a > slots for a in active) / len(active)
    if over < SEEN:
        return (
            f"{head}, extrapolating R(n) above the {max(active):.0f} in flight it was fitted on "
            f"(above {slots} the engine's rate stays R({slots}))"
        )
    return (
        f"{head}: {over:.0%} of the rollouts had more than {slots} in flight on average, so R(n) "
        f"is the engine's rate at {slots} shared with those waiting, and its shape below {slots}, "
        "which the other mode or a lower concurrency replays, is hardly seen"
    )


def _overlap(rows: list[RolloutRow], n_half: float) -> float:
    """The part of generation (its integral dt / (active + n_half)) the learner trained beside."""
    k = OFFSETS.index(n_half)
    total = sum(r.inv[k] for r in rows)
    train = sum(r.inv_train[k] for r in rows if r.inv_train is not None)
    return train / total if total > 0 else 0.0


def _other_mode(own: FittedWorkload, steps: list[StepRow], overlap: float) -> FittedWorkload:
    """The fit replaying the other mode than the recorded one on a shared device: the decode
    rate and training's speed alone and the share each keeps beside the other, measured where
    the record saw each both alone and beside the other, else assumed; its measured and assumed
    items go to `own`'s lists, naming the mode they are for."""
    mode = "sync" if own.meta["mode"] != "sync" else "async"
    say = f"replays of {mode} mode (generation and training shared one device)"
    rmax = own.rmax
    if SEEN <= overlap <= 1.0 - SEEN:
        train_share = own.train_share
        own.measured.append(
            f"{say}: decoding keeps {train_share:.0%} of its rate beside training, as measured "
            f"(training overlapped {overlap:.0%} of generation)"
        )
    elif overlap > 1.0 - SEEN:
        # Decoding was seen beside training only: its rate there is measured, not alone.
        train_share = SHARED_SHARE
        rmax = own.rmax * own.train_share / train_share
        own.assumed.append(
            f"{say}: decoding keeps {train_share:.0%} of its rate beside training (training "
            f"overlapped {overlap:.0%} of generation, too much to see it alone), so it decodes "
            f"at R(n) = {rmax:.0f} n / (n + {own.n_half:g}) tok/s alone"
        )
    else:
        train_share = SHARED_SHARE
        own.assumed.append(
            f"{say}: decoding keeps {train_share:.0%} of its rate beside training (training "
            f"overlapped {overlap:.0%} of generation here, too little to measure)"
        )
    measured = _learner_share(steps)
    if measured is not None:
        learner_share, train_rate = measured
        own.measured.append(
            f"{say}: training alone at {train_rate:.0f} tok/s, keeping {learner_share:.0%} of "
            "that beside generation (fitted on the forward-backward calls' time with and "
            "without rollouts running)"
        )
    else:
        # Each loses the same part of its speed to the other, as the sync records that saw both
        # measured (countdown on two CPU cores: decoding kept 40-45%, training 42-47%); the
        # complement would make training nearly free alone wherever decoding barely slowed.
        learner_share = max(0.05, train_share)
        calls = [c for s in steps for c in s.calls or []]
        beside = sum(c[2] for c in calls)
        alone = sum(c[1] for c in calls) - beside
        tokens = sum(c[0] for c in calls)
        if not calls:  # a record from before the calls were: all training counted alone
            alone, tokens = sum(s.train_s for s in steps), sum(s.tokens for s in steps)
        train_rate = tokens / max(alone + learner_share * beside, 1e-12)
        own.assumed.append(
            f"{say}: training keeps {learner_share:.0%} of its speed beside generation, the "
            f"share decoding keeps beside training ({beside / max(alone + beside, 1e-12):.0%} of its "
            "time ran beside rollouts, too uniformly to tell that share from its speed alone); "
            f"{train_rate:.0f} tok/s alone follows"
        )
    return FittedWorkload(
        own.groups,
        rmax,
        own.n_half,
        train_rate,
        own.t_optim,
        own.t_sync,
        own.meta,
        math.nan,
        own.filter_rate,
        train_share,
        own.sync_share,
        learner_share=learner_share,
        shared_device=True,
    )


def _learner_share(steps: list[StepRow]) -> tuple[float, float] | None:
    """The share of its speed training keeps beside generation and its rate alone (tokens/s),
    fitted as tokens = rate * (alone + share * beside) over the forward-backward calls; None
    where the calls did not train both alone and beside rollouts for a part `SEEN` of their time,
    in proportions that vary by `SEEN` or more, or the fit falls outside (0, 1]."""
    calls = np.array([c for s in steps for c in s.calls or [] if c[1] > 0]).reshape(-1, 3)
    if len(calls) < 3:
        return None
    tokens, seconds, beside = calls.T
    alone = seconds - beside
    if min(alone.sum(), beside.sum()) < SEEN * seconds.sum() or np.std(beside / seconds) < SEEN:
        return None
    (rate, rate_beside), *_ = np.linalg.lstsq(np.stack([alone, beside], 1), tokens, rcond=None)
    share = rate_beside / rate if rate > 0 else math.nan
    if not 0.0 < share <= 1.0 + 1e-6:
        return None
    return min(float(share), 1.0), float(rate)


def _fit_rate(rows: list[RolloutRow]) -> tuple[float, float, bool, tuple[float, float]]:
    """rmax and n_half of R(n) = rmax n / (n + n_half), and the shares of it that generation keeps
    while the learner trains and syncs, that best explain each rollout's length as
    rmax * (free + train_share * train + sync_share * sync) of its integrals dt / (active +
    n_half); False when n_half makes little difference. Shares are on a grid of 0.05; a phase that
    overlapped generation for under 0.5% of it (or was not recorded) keeps share 1."""
    lengths = np.log([r.completion for r in rows])
    total = np.array([r.inv for r in rows])
    train = np.array([r.inv_train or [0.0] * len(OFFSETS) for r in rows])
    sync = np.array([r.inv_sync or [0.0] * len(OFFSETS) for r in rows])
    free = total - train - sync
    grid = np.linspace(0.0, 1.0, 21)
    fits = []
    for k in range(len(OFFSETS)):
        seen = [p[:, k].sum() >= 0.005 * total[:, k].sum() for p in (train, sync)]
        s_train, s_sync = (grid if on else np.ones(1) for on in seen)
        x = (
            free[:, k, None, None]
            + s_train[None, :, None] * train[:, k, None, None]
            + s_sync[None, None, :] * sync[:, k, None, None]
        )
        gaps = lengths[:, None, None] - np.log(np.maximum(x, 1e-300))  # log rmax
        residual = gaps.var(axis=0)
        i, j = np.unravel_index(int(np.argmin(residual)), residual.shape)
        # Tokens over integrals summed over the rollouts, the throughput the engine kept, rather
        # than a mean of their ratios, which first-come-first-served scheduling biases upwards.
        rmax = float(np.exp(lengths).sum() / x[:, i, j].sum())
        fits.append((float(residual[i, j]), rmax, (float(s_train[i]), float(s_sync[j]))))
    residual = np.array([f[0] for f in fits])
    best = int(np.argmin(residual))
    default = OFFSETS.index(DEFAULT_N_HALF)
    if residual[default] - residual[best] < 1e-4:  # a 1% error in rmax either way
        best = default
    identified = best != default or bool(np.ptp(residual) >= 1e-4)
    return fits[best][1], OFFSETS[best], identified, fits[best][2]
