"""SingleTurnWorkflow: prompt -> one completion -> reward function."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from rllm_async.imports import import_object
from rllm_async.rollout import RolloutContext
from rllm_async.types import Episode
from rllm_async.workflows.base import Workflow

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
        self.reward_fn: RewardFn = (
            import_object(reward_fn, "workflow.args.reward_fn")
            if isinstance(reward_fn, str)
            else reward_fn
        )
        self.prompt_key = prompt_key
        self.system_prompt = system_prompt

    async def run(self, task: dict[str, Any], ctx: RolloutContext) -> Episode:
        if self.prompt_key not in task:
            raise KeyError(
                f"task {task.get('id')!r} has no '{self.prompt_key}' field; set "
                "workflow.args.prompt_key to the field that holds the prompt"
            )
        messages = [{"role": "user", "content": str(task[self.prompt_key])}]
        if self.system_prompt:
            messages.insert(0, {"role": "system", "content": self.system_prompt})
        reply = await ctx.chat(messages)
        scored = self.reward_fn(task, reply["content"])
        reward, correct = scored if isinstance(scored, tuple) else (scored, None)
        ctx.set_reward(float(reward))
        episode = ctx.build_episode(None)
        episode.is_correct = correct
        return episode
