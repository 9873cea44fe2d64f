"""How a workflow is run: built from config, and one rollout of one task with retries and deadline.

Training and evaluation both run their rollouts through `run_rollout`.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from rllm_async.config import Config, ConfigError
from rllm_async.imports import import_object
from rllm_async.infra import infra_failure
from rllm_async.protocols import PolicyClient, SamplingParams
from rllm_async.rollout import CallMeter, Pause, RolloutContext
from rllm_async.rollout.reply_parser import ReplyParser, reply_parser
from rllm_async.types import Episode
from rllm_async.workflows.base import Workflow


@dataclass(slots=True)
class Rollout:
    """What one rollout came to: its episode, None when every attempt failed (why the last
    failed attempt failed in `last_error`; `infra_failed` when that was an infrastructure failure,
    not the model's: `rllm_async.infra`)."""

    episode: Episode | None
    last_error: str = ""
    infra_failed: bool = False


async def run_rollout(
    workflow: Workflow,
    task: dict[str, Any],
    policy: PolicyClient,
    *,
    sampling: SamplingParams,
    pin: bool,
    timeout_s: float,
    retries: int,
    pause: Pause,
    report: Callable[[dict[str, float]], None] = lambda metrics: None,
    rollout_index: int = 0,
    version: int | None = None,
    parser: ReplyParser | None = None,
    meter: CallMeter | None = None,
) -> Rollout:
    """Run one rollout of `task`, each attempt under its own `timeout_s` deadline, retrying
    failures `retries` times; every model call waits out `pause`; `version` pins every call to
    that policy version; `parser` reads the
    replies (by default, in the family of the policy's checkpoint); `meter` is told when each
    model call begins and ends. The metrics of each retry and failed attempt go to `report` as
    they happen.

    An attempt whose infrastructure failed (the workflow raised an `InfraError` or a registered
    type, or called `ctx.mark_infra_failed`) is retried like one that raised: a dead sandbox or
    a dropped connection is usually transient, and a fresh attempt gives the group its member
    back. Its episode, if the workflow returned one, is never scored."""
    loop = asyncio.get_running_loop()
    out = Rollout(None)
    for attempt in range(retries + 1):
        if attempt:
            report({"rollout/retries": 1})
        ctx = RolloutContext(
            policy,
            sampling=sampling,
            pin=pin,
            version=version,
            pause=pause,
            deadline=loop.time() + timeout_s,
            task_id=task["id"],
            rollout_index=rollout_index,
            attempt=attempt,
            parser=parser,
            meter=meter,
        )
        episode: Episode | None = None
        error: Exception | None = None
        try:
            async with ctx.timeout():
                result = await workflow.run(task, ctx)
            if ctx.infra_failure is None:
                episode = ctx.build_episode(result)
        except Exception as e:
            error = e
        finally:
            ctx.close()
        cause = None if error is None else infra_failure(error)
        out.infra_failed = ctx.infra_failure is not None or cause is not None
        if out.infra_failed:
            out.last_error = ctx.infra_failure or f"{type(cause).__name__}: {cause}"
            report(_failed("rollout/infra_errors", ctx.num_completion_tokens))
            continue
        if isinstance(error, TimeoutError):
            out.last_error = f"rollout timed out after rollout.timeout_s={timeout_s}s"
            report(_failed("rollout/timeouts", ctx.num_completion_tokens))
            continue
        if error is not None or episode is None:
            out.last_error = f"{type(error).__name__}: {error}"
            report(_failed("rollout/errors", ctx.num_completion_tokens))
            continue
        episode.task_id = task["id"]
        out.episode = episode
        return out
    return out


def _failed(kind: str, tokens: int) -> dict[str, float]:
    """The metrics of a failed attempt: its kind, and its tokens, wasted."""
    return {kind: 1, "tokens/generated": tokens, "tokens/wasted": tokens}


def configured_parser(config: Config, policy: PolicyClient) -> ReplyParser:
    """The reader of `policy`'s replies that `rollout.tool_parser` and `reasoning_parser` choose."""
    ro = config.rollout
    return reply_parser(policy.tokenizer, ro.tool_parser, ro.reasoning_parser)


def build_workflow(config: Config) -> Workflow:
    """The workflow `workflow.cls` names, built with `workflow.args`."""
    cls = import_object(config.workflow.cls, "workflow.cls")
    if not (isinstance(cls, type) and issubclass(cls, Workflow)):
        raise ConfigError(f"workflow.cls: {config.workflow.cls} is not a Workflow subclass")
    try:
        return cls(**config.workflow.args)
    except TypeError as e:
        raise ConfigError(f"workflow.args for {config.workflow.cls}: {e}") from None
