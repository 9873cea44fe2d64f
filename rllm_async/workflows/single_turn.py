"""SingleTurnWorkflow: prompt -> one completion -> reward function."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from rllm_async.rollout import RolloutContext
from rllm_async.types import Episode
from rllm_async.workflows.base import Workflow
from rllm_async.workflows.callables import load, score
from rllm_async.workflows.prompt import task_messages

RewardFn = Callable[[dict[str, Any], str], "float | tuple[float, bool]"]


class SingleTurnWorkflow(Workflow):
    """Ask the task's prompt once and score the reply with `reward_fn(task, text)`.

    `reward_fn` is an import path ("package.module:function") or a callable; it returns a reward,
    or `(reward, is_correct)`. It must parse the text, never execute it.
    """

    def __init__(
        self,
        reward_fn: str | RewardFn,
        prompt_key: str = "prompt",
        system_prompt: str | None = None,
    ) -> None:
        self.reward_fn: RewardFn = load(reward_fn, "workflow.args.reward_fn")
        self.prompt_key = prompt_key
        self.system_prompt = system_prompt

    async def run(self, task: dict[str, Any], ctx: RolloutContext) -> Episode:
        messages = task_messages(task, self.prompt_key, self.system_prompt)
        reply = await ctx.chat(messages)
        reward, correct = score(self.reward_fn, task, reply["content"])
        ctx.set_reward(reward)
        episode = ctx.build_episode(None)
        episode.is_correct = correct
        return episode
