"""SimWorkflow: one model call of a simulated length and reward, for the `sim` backend's runs."""

from __future__ import annotations

import asyncio
import math
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from rllm_async.algorithms.sim_workload import (
    LEN_CAP,
    LEN_MEDIAN,
    LEN_SIGMA,
    drift_factor,
    rollout_length,
    rollout_uniforms,
    task_difficulty,
    uniforms,
)
from rllm_async.config import validate_options
from rllm_async.rollout import RolloutContext
from rllm_async.types import Episode
from rllm_async.workflows.base import Workflow


class SimWorkflowError(RuntimeError):
    """An injected workflow failure (`exception_rate`, `fail_tasks`)."""


class RecordedRollout(BaseModel):
    """A rollout of a recorded run: its completion tokens, model calls, and seconds outside them."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    completion: int = Field(ge=1)
    turns: int = Field(default=1, ge=1)
    tool_s: float = Field(default=0.0, ge=0.0)


class RecordedGroup(BaseModel):
    """A group of a recorded run: its rollouts, and whether it was filtered (None: not known)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    rollouts: list[RecordedRollout] = Field(min_length=1)
    filtered: bool | None = None


class SimWorkflowArgs(BaseModel):
    """The `workflow.args` of SimWorkflow."""

    model_config = ConfigDict(extra="forbid")

    seed: int = 0
    len_median: float = Field(default=LEN_MEDIAN, gt=0.0)
    len_sigma: float = Field(default=LEN_SIGMA, ge=0.0)
    len_cap: int = Field(default=LEN_CAP, ge=1)
    # Recorded groups to draw from instead of the lognormal (`rllm-async plan`): each task draws
    # one, and its rollouts take the group's in turn, each replayed as its turns' model calls
    # (its tokens split evenly) with its time outside them shared out after each.
    groups: list[RecordedGroup] = Field(default_factory=list)
    # Filtered tasks reward every rollout 0, so the zero-variance filter drops their groups; the
    # other tasks' rollouts alternate 1 and 0 (`rllm-async plan`). A task filters as its recorded
    # group did, or where that is not known, at this rate (fixed by the task's id).
    filter_rate: float = Field(default=0.0, ge=0.0, le=1.0)
    exception_rate: float = Field(default=0.0, ge=0.0, le=1.0)
    hang_rate: float = Field(default=0.0, ge=0.0, le=1.0)
    reward_delay_s: float = Field(default=0.0, ge=0.0)
    fail_tasks: list[str] = Field(default_factory=list)
    version_slope: float = 0.02  # logit gain in success probability per policy version
    # A drifting workload: over `drift_steps` policy versions (0: none) the median length grows
    # `len_growth` times and the tool seconds of a rollout (`tool_s`, after its model call) go
    # to `tool_s * tool_growth`; linearly, or at once at drift_steps (`drift_shape: step`).
    # A rollout drifts by the version it starts on.
    drift_steps: int = Field(default=0, ge=0)
    drift_shape: Literal["linear", "step"] = "linear"
    len_growth: float = Field(default=1.0, gt=0.0)
    tool_s: float = Field(default=0.0, ge=0.0)
    tool_growth: float = Field(default=1.0, ge=0.0)


def synthetic_tasks(n: int, seed: int = 0) -> list[dict[str, Any]]:
    """n synthetic tasks for SimWorkflow (`data.train.generator`)."""
    if n < 1:
        raise ValueError(f"synthetic_tasks needs n >= 1, got {n}")
    ids = [f"sim-{seed}-{i}" for i in range(n)]
    return [
        {"id": tid, "prompt": f"Simulated task {i}.", "p0": task_difficulty(tid)}
        for i, tid in enumerate(ids)
    ]


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
        u_len, u_hang, u_exc, u_reward = rollout_uniforms(
            a.seed, task_id, ctx.rollout_index, ctx.attempt
        )
        group = None
        if a.groups:
            group = a.groups[int(uniforms(a.seed, task_id, "group", n=1)[0] * len(a.groups))]
            recorded = group.rollouts[ctx.rollout_index % len(group.rollouts)]
            calls = min(recorded.turns, recorded.completion)
            per_call, longer = divmod(recorded.completion, calls)
            lengths = [per_call + (i < longer) for i in range(calls)]
            outside = recorded.tool_s / calls
        else:
            version = float(getattr(ctx.policy, "version", 0))
            grow = drift_factor(version, a.drift_steps, a.len_growth, a.drift_shape)
            lengths = [rollout_length(u_len, a.len_median * grow, a.len_sigma, a.len_cap)]
            outside = a.tool_s * drift_factor(version, a.drift_steps, a.tool_growth, a.drift_shape)
        prompt = ctx.policy.tokenizer.encode(str(task.get("prompt", task_id)))
        for length in lengths:
            out = await ctx.generate(prompt, max_tokens=length)
            if outside:
                await asyncio.sleep(outside)
        if u_hang < a.hang_rate:
            await asyncio.get_running_loop().create_future()  # never resolves
        if u_exc < a.exception_rate:
            raise SimWorkflowError(f"injected failure (exception_rate={a.exception_rate})")
        if a.reward_delay_s:
            await asyncio.sleep(a.reward_delay_s)
        if a.filter_rate:
            filtered = group.filtered if group is not None else None
            if filtered is None:
                filtered = uniforms(a.seed, task_id, "filter", n=1)[0] < a.filter_rate
            return 0.0 if filtered else float(ctx.rollout_index % 2)
        p0 = float(task["p0"]) if "p0" in task else task_difficulty(task_id)
        version = sum(out.versions) / len(out.versions)
        logit = math.log(p0 / (1.0 - p0)) + a.version_slope * version
        return 1.0 if u_reward < 0.5 * (1.0 + math.tanh(logit / 2)) else 0.0  # sigmoid
