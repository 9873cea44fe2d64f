"""The `sim` backend: a deterministic, model-free simulation of generation and training.

Generation follows processor sharing: with n sequences decoding, the aggregate rate is
R(n) = rmax * n / (n + n_half), split evenly, at most `slots` at once (a FIFO queue beyond).
Training takes completion tokens / train_rate seconds; weight syncs take t_sync. Used by tests,
benchmarks and to dry-run a schedule; `WORKLOADS` holds the benchmark configurations.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import math
from bisect import bisect_right
from collections import Counter, deque
from collections.abc import Sequence
from dataclasses import dataclass
from heapq import heapify, heappop, heappush
from itertools import count
from pathlib import Path
from statistics import NormalDist
from typing import Any, ClassVar, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, model_validator

from rllm_async.backends.base import Completion, SamplingParams
from rllm_async.backends.toy_tokenizers import ByteTokenizer
from rllm_async.config import Config, ConfigError, LossConfig, config_from_dict, validate_options
from rllm_async.rollout import RolloutContext
from rllm_async.types import Episode, TrajectoryGroup
from rllm_async.workflows.base import Workflow

LEN_MEDIAN = 1500.0
LEN_SIGMA = 0.8
LEN_CAP = 16384
_LENGTH_KEYS = ("len_median", "len_sigma", "len_cap")
_STD_NORMAL = NormalDist()


class SimSyncError(RuntimeError):
    """An injected weight-sync failure (`sync_fail_every`)."""


class SimWorkflowError(RuntimeError):
    """An injected workflow failure (`exception_rate`, `fail_tasks`)."""


class SimOptions(BaseModel):
    """The `backend:` keys of `name: sim`. Times are virtual seconds, rates tokens per second."""

    model_config = ConfigDict(extra="forbid")

    latency: Literal["ps", "zero"] = "ps"  # zero: generation, training and syncs take no time
    slots: int = Field(default=512, ge=1)
    rmax: float = Field(default=20000.0, gt=0.0)
    n_half: float = Field(default=64.0, ge=0.0)
    train_rate: float | None = Field(default=None, gt=0.0)
    train_ratio: float | None = Field(default=None, gt=0.0)  # T_train / T_gen(sync) per step
    t_sync: float = Field(default=0.5, ge=0.0)
    sync_fail_every: int = Field(default=0, ge=0)  # 0: never
    sync_hang_every: int = Field(default=0, ge=0)  # 0: never
    # The rollout-length distribution train_ratio is calibrated on; from_config takes any of
    # these not given here from workflow.args, so the two cannot disagree silently.
    len_median: float = Field(default=LEN_MEDIAN, gt=0.0)
    len_sigma: float = Field(default=LEN_SIGMA, ge=0.0)
    len_cap: int = Field(default=LEN_CAP, ge=1)

    @model_validator(mode="after")
    def _one_train_speed(self) -> SimOptions:
        if self.train_rate is not None and self.train_ratio is not None:
            raise ValueError(
                "give one of backend.train_rate (tokens/s) or backend.train_ratio "
                "(T_train / T_gen), not both"
            )
        if self.train_rate is None and self.train_ratio is None:
            self.train_ratio = 0.3
        return self


class SimWorkflowArgs(BaseModel):
    """The `workflow.args` of SimWorkflow."""

    model_config = ConfigDict(extra="forbid")

    seed: int = 0
    len_median: float = Field(default=LEN_MEDIAN, gt=0.0)
    len_sigma: float = Field(default=LEN_SIGMA, ge=0.0)
    len_cap: int = Field(default=LEN_CAP, ge=1)
    exception_rate: float = Field(default=0.0, ge=0.0, le=1.0)
    hang_rate: float = Field(default=0.0, ge=0.0, le=1.0)
    reward_delay_s: float = Field(default=0.0, ge=0.0)
    fail_tasks: list[str] = Field(default_factory=list)
    version_slope: float = 0.02  # logit gain in success probability per policy version


# --- the math, as pure functions (benchmarks use them for ideal times) ---


def ps_rate(n: int, rmax: float, n_half: float) -> float:
    """Aggregate decode rate (tokens/s) with n sequences active; n = slots gives the ideal rate."""
    return rmax * n / (n + n_half) if n > 0 else 0.0


def ps_makespan(lengths: Sequence[int], rmax: float, n_half: float, slots: int) -> float:
    """Seconds until sequences of `lengths`, submitted together in this order, have all finished."""
    heap = [float(x) for x in lengths[:slots]]
    heapify(heap)
    waiting = iter(lengths[slots:])
    t = level = 0.0
    while heap:
        finish = heappop(heap)
        t += (finish - level) * (len(heap) + 1 + n_half) / rmax
        level = finish
        nxt = next(waiting, None)
        if nxt is not None:
            heappush(heap, level + nxt)
    return t


def rollout_length(u: float, median: float, sigma: float, cap: int) -> int:
    """A lognormal rollout length from a uniform draw u in (0, 1), rounded and capped."""
    return min(cap, max(1, round(median * math.exp(sigma * _STD_NORMAL.inv_cdf(u)))))


def sample_lengths(
    rng: np.random.Generator, n: int, median: float, sigma: float, cap: int
) -> np.ndarray:
    """n rollout lengths from the same distribution as `rollout_length`."""
    return np.clip(np.rint(median * np.exp(sigma * rng.standard_normal(n))), 1, cap).astype(int)


@dataclass(frozen=True, slots=True)
class StepProfile:
    """Mean completion tokens and mean sync-mode generation time (s) of one optimizer step."""

    tokens: float
    t_gen: float

    def train_rate_for(self, ratio: float) -> float:
        """The train_rate that makes T_train / T_gen(sync) equal `ratio`."""
        return self.tokens / (ratio * self.t_gen)


def step_profile(
    opts: SimOptions, rollouts: int, *, steps: int = 2000, seed: int = 0
) -> StepProfile:
    """Average over `steps` seeded samples of a sync step: `rollouts` sequences started together."""
    rng = np.random.default_rng(seed)
    lengths = sample_lengths(
        rng, steps * rollouts, opts.len_median, opts.len_sigma, opts.len_cap
    ).reshape(steps, rollouts)
    if rollouts <= opts.slots:
        # Closed form: the service level S rises at rmax / (n + n_half) per second, so
        # rmax * t = sum of n dS + n_half * sum of dS = total tokens + n_half * longest length.
        t_gen = (lengths.sum(axis=1) + opts.n_half * lengths.max(axis=1)) / opts.rmax
    else:
        t_gen = np.array(
            [ps_makespan(row.tolist(), opts.rmax, opts.n_half, opts.slots) for row in lengths]
        )
    return StepProfile(tokens=float(lengths.sum(axis=1).mean()), t_gen=float(t_gen.mean()))


# --- deterministic draws and synthetic tasks ---


def uniforms(*key: object, n: int) -> list[float]:
    """n uniform draws in (0, 1) fixed by `key` alone, not by scheduling order or PYTHONHASHSEED."""
    digest = hashlib.blake2b("\x1f".join(map(str, key)).encode(), digest_size=8 * n).digest()
    # 52 bits keep (k + 0.5) / 2**52 exactly representable and strictly inside (0, 1).
    return [
        ((int.from_bytes(digest[8 * i : 8 * i + 8], "little") >> 12) + 0.5) / 2**52
        for i in range(n)
    ]


def task_difficulty(task_id: str) -> float:
    """The base success probability p0 in [0.1, 0.9] of a task, fixed by its id."""
    return 0.1 + 0.8 * uniforms("p0", task_id, n=1)[0]


def synthetic_tasks(n: int, seed: int = 0) -> list[dict[str, Any]]:
    """n synthetic tasks for SimWorkflow (`data.train.generator`)."""
    if n < 1:
        raise ValueError(f"synthetic_tasks needs n >= 1, got {n}")
    ids = [f"sim-{seed}-{i}" for i in range(n)]
    return [
        {"id": tid, "prompt": f"Simulated task {i}.", "p0": task_difficulty(tid)}
        for i, tid in enumerate(ids)
    ]


# --- the policy ---


_QUEUED, _ACTIVE, _DONE, _CANCELLED = range(4)


class _Job:
    __slots__ = ("done", "length", "start", "state")

    def __init__(self, length: int, done: asyncio.Future[None]) -> None:
        self.length = length
        self.done = done
        self.start = 0.0  # service level when it got a slot
        self.state = _QUEUED


class ProcessorSharing:
    """Decode slots shared evenly: with n active, each sequence gets rmax / (n + n_half) tokens/s.

    All active sequences get the same rate, so one counter, the service each has attained
    (`level`), tells when each finishes: at its start level plus its length. A heap of finish
    levels and a single timer for the next completion make every event O(log n).
    """

    def __init__(self, rmax: float, n_half: float, slots: int) -> None:
        self.rmax = rmax
        self.n_half = n_half
        self.slots = slots
        self.active = 0
        self._level = 0.0
        self._t_last = 0.0
        self._heap: list[tuple[float, int, _Job]] = []
        self._queue: deque[_Job] = deque()
        self._seq = count()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._rescheduling = False

    @property
    def queued(self) -> int:
        return sum(job.state == _QUEUED for job in self._queue)

    def level(self) -> float:
        """The attained-service counter now."""
        self._advance()
        return self._level

    def submit(self, length: int) -> _Job:
        """Queue a sequence of `length` tokens; `job.done` resolves when it has decoded them all."""
        loop = asyncio.get_running_loop()
        if loop is not self._loop and self.active == 0:
            # A new event loop (a new run): nothing armed on the old one carries over.
            self._loop, self._timer, self._rescheduling = loop, None, False
        job = _Job(length, loop.create_future())
        if self.active < self.slots:
            self._start(job)
        else:
            self._queue.append(job)
        return job

    def cancel(self, job: _Job) -> None:
        """Withdraw a sequence (its caller was cancelled); a finished one is left alone."""
        if job.state == _ACTIVE:
            self._advance()
            job.state = _CANCELLED  # its heap entry is skipped when reached
            self.active -= 1
            self._fill()
            self._changed()
        elif job.state == _QUEUED:
            job.state = _CANCELLED  # its queue entry is skipped when reached

    def close(self, reason: str) -> None:
        """Stop the clock and fail every waiting sequence with RuntimeError(reason)."""
        if self._timer is not None:
            self._timer.cancel()
        for job in [entry[2] for entry in self._heap] + list(self._queue):
            if job.state in (_QUEUED, _ACTIVE) and not job.done.done():
                job.done.set_exception(RuntimeError(reason))
            job.state = _CANCELLED
        self._heap.clear()
        self._queue.clear()
        self.active = 0

    def _advance(self) -> None:
        if self._loop is None:
            return
        now = self._loop.time()
        if self.active:
            self._level += (now - self._t_last) * self.rmax / (self.active + self.n_half)
        self._t_last = now

    def _start(self, job: _Job) -> None:
        self._advance()
        job.state = _ACTIVE
        job.start = self._level
        self.active += 1
        heappush(self._heap, (job.start + job.length, next(self._seq), job))
        self._changed()

    def _fill(self) -> None:
        while self._queue and self.active < self.slots:
            job = self._queue.popleft()
            if job.state == _QUEUED:
                self._start(job)

    def _changed(self) -> None:
        # The rate changed, so the armed completion time is stale: disarm now, re-arm once per
        # loop iteration (a burst of joins costs one timer, not one each).
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if not self._rescheduling and self._loop is not None:
            self._rescheduling = True
            self._loop.call_soon(self._reschedule)

    def _reschedule(self) -> None:
        self._rescheduling = False
        heap = self._heap
        while heap and heap[0][2].state != _ACTIVE:
            heappop(heap)
        if heap and self._loop is not None:
            self._advance()
            dt = (heap[0][0] - self._level) * (self.active + self.n_half) / self.rmax
            self._timer = self._loop.call_at(self._t_last + max(dt, 0.0), self._complete)

    def _complete(self) -> None:
        self._timer = None
        self._advance()
        heap = self._heap
        # The timer was armed for the head's finish level: float rounding must not leave it short.
        self._level = max(self._level, heap[0][0])
        limit = self._level + 1e-9 * max(1.0, self._level)
        while heap and heap[0][0] <= limit:
            job = heappop(heap)[2]
            if job.state == _ACTIVE:
                job.state = _DONE
                self.active -= 1
                if not job.done.done():
                    job.done.set_result(None)
        self._fill()
        self._changed()


class SimPolicy:
    """A PolicyClient without a model: decodes exactly `max_tokens` tokens in simulated time.

    Token ids are 0 and logprobs -1.0. Tokens carry the version that produced them: the pinned
    one, or, with `version=None`, the versions in force while each token was decoded.
    """

    def __init__(self, opts: SimOptions) -> None:
        self.engine = (
            ProcessorSharing(opts.rmax, opts.n_half, opts.slots) if opts.latency == "ps" else None
        )
        self._tokenizer = ByteTokenizer()
        self._version = 0
        self._refs: Counter[int] = Counter()
        # Service levels at which the version changed, for per-token versions in latest mode.
        self._change_levels = [0.0]
        self._change_versions = [0]
        self._closed = False

    @property
    def tokenizer(self) -> ByteTokenizer:
        return self._tokenizer

    @property
    def version(self) -> int:
        return self._version

    @property
    def snapshots(self) -> dict[int, int]:
        """Acquired snapshots still held: version -> refcount (empty when nothing leaks)."""
        return dict(self._refs)

    def acquire(self) -> int:
        self._refs[self._version] += 1
        return self._version

    def release(self, version: int) -> None:
        if self._refs.get(version, 0) <= 0:
            raise ValueError(f"release({version}) without a matching acquire()")
        self._refs[version] -= 1
        if not self._refs[version]:
            del self._refs[version]

    def set_version(self, version: int) -> None:
        """Serve `version` from now on; sequences still decoding switch to it mid-way."""
        self._version = version
        if self.engine is not None:
            self._change_levels.append(self.engine.level())
            self._change_versions.append(version)

    async def generate(
        self, prompt_ids: list[int], params: SamplingParams, *, version: int | None = None
    ) -> Completion:
        if self._closed:
            raise RuntimeError("the sim backend is closed")
        if version is not None and version != self._version and version not in self._refs:
            raise ValueError(f"generate(version={version}): snapshot not held; acquire() it first")
        n = max(0, params.max_tokens)
        if self.engine is None or n == 0:
            versions = [self._version if version is None else version] * n
        else:
            job = self.engine.submit(n)
            try:
                await job.done
            finally:
                self.engine.cancel(job)
            versions = [version] * n if version is not None else self._token_versions(job.start, n)
        return Completion(ids=[0] * n, logprobs=[-1.0] * n, versions=versions)

    def _token_versions(self, start: float, n: int) -> list[int]:
        # Token k is emitted when the level reaches start + k + 1; a change at level L reaches
        # the tokens emitted after it, k >= floor(L - start).
        levels, versions = self._change_levels, self._change_versions
        i = bisect_right(levels, start)
        current, done, out = versions[i - 1], 0, []
        while i < len(levels) and levels[i] < start + n:
            cut = max(done, min(n, math.floor(levels[i] - start + 1e-9)))
            out += [current] * (cut - done)
            current, done, i = versions[i], cut, i + 1
        return out + [current] * (n - done)

    def close(self) -> None:
        if not self._closed and self.engine is not None:
            self.engine.close("the sim backend was closed while generating")
        self._closed = True


# --- the workflow ---


class SimWorkflow(Workflow):
    """One model call of a lognormal length and a {0, 1} reward that improves with the version.

    Every draw is fixed by (seed, task id, rollout index, attempt), so a rollout's length and
    faults do not depend on scheduling order.
    """

    def __init__(self, **args: Any) -> None:
        self.args: SimWorkflowArgs = validate_options(SimWorkflowArgs, args, "workflow.args")

    async def run(self, task: dict[str, Any], ctx: RolloutContext) -> Episode | float | None:
        a = self.args
        task_id = str(task["id"])
        if task_id in a.fail_tasks:
            raise SimWorkflowError(f"task {task_id} is in workflow.args.fail_tasks")
        u_len, u_hang, u_exc, u_reward = uniforms(
            a.seed, task_id, ctx.rollout_index, ctx.attempt, n=4
        )
        length = rollout_length(u_len, a.len_median, a.len_sigma, a.len_cap)
        prompt = ctx.policy.tokenizer.encode(str(task.get("prompt", task_id)))
        out = await ctx.generate(prompt, max_tokens=length)
        if u_hang < a.hang_rate:
            await asyncio.get_running_loop().create_future()  # never resolves
        if u_exc < a.exception_rate:
            raise SimWorkflowError(f"injected failure (exception_rate={a.exception_rate})")
        if a.reward_delay_s:
            await asyncio.sleep(a.reward_delay_s)
        p0 = float(task["p0"]) if "p0" in task else task_difficulty(task_id)
        version = sum(out.versions) / len(out.versions)
        logit = math.log(p0 / (1.0 - p0)) + a.version_slope * version
        return 1.0 if u_reward < 0.5 * (1.0 + math.tanh(logit / 2)) else 0.0  # sigmoid


# --- the backend ---

TrainedGroup = tuple[str, str, tuple[float, ...], tuple[float, ...], tuple[int, ...], int]


class SimBackend:
    """The Backend protocol on simulated time: training and syncs only sleep and log.

    `trained` holds one list per optimizer step of (task_id, name, rewards, advantages,
    completion lengths, min_version), so tests can compare the batches of two runs.
    """

    options: ClassVar[type[BaseModel]] = SimOptions
    virtual_clock: ClassVar[bool] = True

    def __init__(
        self, opts: SimOptions | None = None, *, rollouts_per_step: int = 128, seed: int = 0
    ) -> None:
        self.opts = opts if opts is not None else SimOptions()
        self.profile = step_profile(self.opts, rollouts_per_step, seed=seed)
        if self.opts.train_rate is not None:
            self.train_rate = self.opts.train_rate
        else:
            assert self.opts.train_ratio is not None  # SimOptions sets one of the two
            self.train_rate = self.profile.train_rate_for(self.opts.train_ratio)
        self.version = 0
        self.steps = 0
        self.trained: list[list[TrainedGroup]] = []
        self.sync_failures = 0
        self.sync_hangs = 0
        self._policy = SimPolicy(self.opts)
        self._open_step: list[TrainedGroup] | None = None
        self._faulted: set[int] = set()
        self._closed = False

    @classmethod
    def from_config(cls, config: Config) -> SimBackend:
        options = config.backend.options
        opts = validate_options(SimOptions, options, "backend")
        inherited = {
            k: config.workflow.args[k]
            for k in _LENGTH_KEYS
            if k in config.workflow.args and k not in options
        }
        if inherited:
            opts = validate_options(SimOptions, {**options, **inherited}, "backend")
        rollouts = config.train.groups_per_step * config.rollout.group_size
        return cls(opts, rollouts_per_step=rollouts, seed=config.seed)

    def policy(self) -> SimPolicy:
        return self._policy

    async def forward_backward(
        self, groups: list[TrajectoryGroup], loss: LossConfig
    ) -> dict[str, float]:
        tokens = sum(g.num_completion_tokens for g in groups)
        seconds = tokens / self.train_rate if self.opts.latency == "ps" else 0.0
        if seconds:
            await asyncio.sleep(seconds)
        if self._open_step is None:
            self._open_step = []
            self.trained.append(self._open_step)
        self._open_step.extend(
            (
                g.task_id,
                g.name,
                tuple(g.rewards),
                tuple(g.advantages),
                tuple(t.num_completion_tokens for t in g.trajectories),
                g.min_version,
            )
            for g in groups
        )
        return {"sim/train_tokens": float(tokens), "sim/train_s": seconds}

    async def optim_step(self) -> dict[str, float]:
        if self._open_step is None:
            self.trained.append([])
        groups = len(self.trained[-1])
        self._open_step = None
        self.steps += 1
        return {"sim/step_groups": float(groups)}

    async def on_policy_updated(self, version: int) -> None:
        """Sleep t_sync, then serve `version`; a faulty version hangs or fails at its first try."""
        if self.opts.latency == "ps" and self.opts.t_sync:
            await asyncio.sleep(self.opts.t_sync)
        first_attempt = version not in self._faulted
        if first_attempt and _every(self.opts.sync_hang_every, version):
            self._faulted.add(version)
            self.sync_hangs += 1
            await asyncio.get_running_loop().create_future()  # never resolves
        if first_attempt and _every(self.opts.sync_fail_every, version):
            self._faulted.add(version)
            self.sync_failures += 1
            raise SimSyncError(
                f"injected weight-sync failure at version {version} "
                f"(sync_fail_every={self.opts.sync_fail_every})"
            )
        self.version = version
        self._policy.set_version(version)

    async def save(self, path: Path) -> None:
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        state = {"version": self.version, "steps": self.steps}
        (path / "sim_state.json").write_text(json.dumps(state))

    async def load(self, path: Path) -> None:
        state = json.loads((Path(path) / "sim_state.json").read_text())
        self.version = int(state["version"])
        self.steps = int(state["steps"])
        self._policy.set_version(self.version)

    async def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._policy.close()


def _every(n: int, version: int) -> bool:
    return n > 0 and version > 0 and version % n == 0


# --- benchmark workloads ---


def _workload(
    *,
    groups_per_step: int = 32,
    len_sigma: float = LEN_SIGMA,
    len_cap: int = LEN_CAP,
    train_ratio: float = 0.3,
    timeout_s: float = 1200.0,
    exception_rate: float = 0.0,
    hang_rate: float = 0.0,
    sync_fail_every: int = 0,
) -> dict[str, Any]:
    slots = 512
    return {
        "backend": {
            "name": "sim",
            "latency": "ps",
            "slots": slots,
            "rmax": 20000.0,
            "n_half": 64.0,
            "t_sync": 0.5,
            "train_ratio": train_ratio,
            "sync_fail_every": sync_fail_every,
        },
        "workflow": {
            "cls": "rllm_async.backends.sim:SimWorkflow",
            "args": {
                "len_median": LEN_MEDIAN,
                "len_sigma": len_sigma,
                "len_cap": len_cap,
                "exception_rate": exception_rate,
                "hang_rate": hang_rate,
            },
        },
        "data": {
            "train": {"generator": "rllm_async.backends.sim:synthetic_tasks", "args": {"n": 1024}}
        },
        "train": {"groups_per_step": groups_per_step},
        # timeout_s: a few times the longest legitimate rollout at full concurrency (cap tokens
        # at rmax / (slots + n_half) tok/s), so only injected hangs are reclaimed by it.
        "rollout": {
            "group_size": 8,
            "max_tokens": len_cap,
            "timeout_s": timeout_s,
            "max_concurrency": slots,
        },
    }


WORKLOADS: dict[str, dict[str, Any]] = {
    "W1": _workload(),  # reasoning
    "W2": _workload(train_ratio=1.0),  # balanced
    "W3": _workload(groups_per_step=16, len_sigma=1.3, len_cap=32768, timeout_s=3600.0),
    "W4": _workload(exception_rate=0.02, hang_rate=0.005, sync_fail_every=50),  # faults
}


def workload_config(name: str, overrides: list[str] | None = None) -> Config:
    """The Config of workload `name` with `key=value` overrides applied (as on the command line)."""
    from omegaconf import OmegaConf

    if name not in WORKLOADS:
        raise ConfigError(f"unknown sim workload '{name}': choose one of {', '.join(WORKLOADS)}")
    merged = OmegaConf.merge(
        OmegaConf.create(WORKLOADS[name]), OmegaConf.from_dotlist(list(overrides or []))
    )
    data = OmegaConf.to_container(merged, resolve=True)
    assert isinstance(data, dict)
    return config_from_dict({str(k): v for k, v in data.items()})
