"""SingleTurnWorkflow: prompt -> one completion -> reward function."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from rllm_async.rollout import RolloutContext
from rllm_async.types import Episode
from rllm_async.workflows.base import Workflow
from rllm_async.workflows.callables import load_rewards, score_all
from rllm_async.workflows.prompt import task_messages

RewardFn = Callable[[dict[str, Any], str], "float | tuple[float, bool]"]


class SingleTurnWorkflow(Workflow):
    """Ask the task's prompt once and score the reply with `reward_fn(task, text)`.

    `reward_fn` is an import path ("package.module:function", "path/to/file.py:function") or a
    callable returning a reward or `(reward, is_correct)`; or a list of them, each optionally
    `{fn, weight, name}`, whose weighted sum is the reward, each one logged as
    `episode/reward/<name>`. A reward function parses the text, never executes it.

    A task's prompt is a string, or a list of chat messages (the conversational format) used as
    the opening chat itself. With `json_schema`, the reply is sampled under that JSON schema
    (constrained decoding: docs/constrained_decoding.md), so every reply parses and the reward
    can judge its content alone.
    """

    def __init__(
        self,
        reward_fn: str | RewardFn | list[Any],
        prompt_key: str = "prompt",
        system_prompt: str | None = None,
        json_schema: dict[str, Any] | None = None,
    ) -> None:
        self.rewards = load_rewards(reward_fn, "workflow.args.reward_fn")
        self.prompt_key = prompt_key
        self.system_prompt = system_prompt
        self.sampling: dict[str, Any] = {}
        if json_schema is not None:
            self.sampling["structured"] = json.dumps({"json": json_schema})

    async def run(self, task: dict[str, Any], ctx: RolloutContext) -> Episode:
        messages = task_messages(task, self.prompt_key, self.system_prompt)
        reply = await ctx.chat(messages, **self.sampling)
        reward, correct, parts = score_all(self.rewards, task, reply["content"])
        ctx.set_reward(reward)
        episode = ctx.build_episode(None)
        episode.is_correct = correct
        if len(parts) > 1:
            episode.metrics.update({f"reward/{name}": value for name, value in parts.items()})
        return episode
