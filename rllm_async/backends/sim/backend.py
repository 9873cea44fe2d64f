"""The `sim` backend: a deterministic, model-free simulation of generation and training.

Generation runs on a simulated inference server (`server.py`). Training takes completion tokens /
train_rate seconds alone (recomputing old logprobs, a forward pass only, a third of that), each
optimizer step t_optim; weight syncs take t_sync. While training and syncing, generation decodes at
train_share and sync_share of its rate; while generation decodes, training and recomputing run at
learner_share of their speed (a device the two share). With `kl_per_version`, training records
the sampler-learner KL that its tokens' staleness brings. Used by tests, benchmarks and to dry-run
a schedule.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any, ClassVar

from pydantic import BaseModel

from rllm_async.algorithms.sim_workload import drift_factor
from rllm_async.backends.sim.options import LENGTH_KEYS, SimOptions
from rllm_async.backends.sim.policy import SimPolicy
from rllm_async.backends.sim.server import step_profile
from rllm_async.config import Config, LossConfig, validate_options
from rllm_async.types import TrajectoryGroup


class SimSyncError(RuntimeError):
    """An injected weight-sync failure (`sync_fail_every`)."""


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
            for k in LENGTH_KEYS
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
        lengths = [tuple(t.num_completion_tokens for t in g.trajectories) for g in groups]
        tokens = sum(map(sum, lengths))
        seconds = tokens * self.seconds_per_token(self.steps) if self.opts.latency == "ps" else 0.0
        if seconds:
            await self._beside_generation(seconds, self.opts.train_share, learner=True)
        if self._open_step is None:
            self._open_step = []
            self.trained.append(self._open_step)
        self._open_step.extend(
            (
                g.task_id,
                g.name,
                tuple(g.rewards),
                tuple(g.advantages),
                n,
                g.min_version,
            )
            for g, n in zip(groups, lengths, strict=True)
        )
        return {"sim/train_tokens": float(tokens), "sim/train_s": seconds, **self._kl(groups)}

    def _kl(self, groups: list[TrajectoryGroup]) -> dict[str, float]:
        """`loss/sampler_kl` of `groups`' tokens (`kl_per_version` per version of staleness, the
        policy's steps since each model call's oldest version), with `loss/num_tokens`."""
        o = self.opts
        if not o.kl_per_version:
            return {}
        stale = tokens = 0
        for g in groups:
            for t in g.trajectories:
                for call in t.steps:
                    if call.versions:
                        n = len(call.completion_ids)
                        stale += n * (self.steps - min(call.versions))
                        tokens += n
        rate = o.kl_per_version * drift_factor(self.steps, o.kl_drift_steps, o.kl_growth)
        kl = rate * stale / tokens if tokens else 0.0
        return {"loss/sampler_kl": kl, "loss/num_tokens": float(tokens)}

    async def recompute_logprobs(self, groups: list[TrajectoryGroup]) -> None:
        """A no-grad forward pass over `groups` (old logprobs): a third of a training pass's time."""
        tokens = sum(g.num_completion_tokens for g in groups)
        if self.opts.latency == "ps" and tokens:
            await self._learner_time(tokens * self.seconds_per_token(self.steps) / 3)

    def seconds_per_token(self, step: int) -> float:
        """The learner's seconds per token at optimizer step `step` (`train_growth` drifts it)."""
        o = self.opts
        growth = drift_factor(step, o.train_drift_steps, o.train_growth, o.train_drift_shape)
        return growth / self.train_rate

    async def optim_step(self) -> dict[str, float]:
        if self.opts.latency == "ps" and self.opts.t_optim:
            await asyncio.sleep(self.opts.t_optim)
        if self._open_step is None:
            self.trained.append([])
        groups = len(self.trained[-1])
        self._open_step = None
        self.steps += 1
        return {"sim/step_groups": float(groups)}

    async def on_policy_updated(self, version: int) -> None:
        """Sleep t_sync, then serve `version`; a faulty version hangs or fails at its first try."""
        if self.opts.latency == "ps" and self.opts.t_sync:
            await self._beside_generation(self.opts.t_sync, self.opts.sync_share)
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

    @classmethod
    def shares_device(cls, options: dict[str, Any]) -> bool | None:
        """Whether generation and training share one device under these `backend:` options: they
        do where either slows the other."""
        opts = SimOptions.model_validate(options)
        return opts.train_share < 1.0 or opts.learner_share < 1.0

    @classmethod
    def decode_slots(cls, options: dict[str, Any]) -> int | None:
        """The most sequences the simulated engine decodes together under these options."""
        return SimOptions.model_validate(options).slots

    async def _beside_generation(self, seconds: float, share: float, learner: bool = False) -> None:
        """Take `seconds` during which generation decodes at `share` of its rate; with `learner`,
        they are seconds of learner work, which slows beside generation (`_learner_time`)."""
        engine = self._policy.engine
        if engine is not None:
            engine.set_speed(share)
        try:
            await (self._learner_time(seconds) if learner else asyncio.sleep(seconds))
        finally:
            if engine is not None:
                engine.set_speed(1.0)

    async def _learner_time(self, seconds: float) -> None:
        """Do `seconds` of learner work (its time alone), at learner_share of that speed while the
        engine decodes: the work advances at the current rate until it is done or the engine
        starts or stops decoding."""
        share, engine = self.opts.learner_share, self._policy.engine
        if share == 1.0 or engine is None:
            await asyncio.sleep(seconds)
            return
        loop = asyncio.get_running_loop()
        left = seconds
        while True:
            rate = share if engine.active else 1.0
            changed = engine.busy_changed()
            t0 = loop.time()
            await asyncio.wait([changed], timeout=left / rate)
            if not changed.done():
                changed.cancel()
                return
            left -= (loop.time() - t0) * rate
            if left <= 1e-12 * seconds:
                return

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
