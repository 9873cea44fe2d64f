"""EnvWorkflow: the model acts in an `Env` (reset/step, sync or async) for up to `max_turns` turns."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any, Protocol

from rllm_async.infra import infra_failure
from rllm_async.rollout import COMPACT_PROMPT, SUMMARY_TEMPLATE, ContextLengthError, RolloutContext
from rllm_async.types import Episode, Termination
from rllm_async.workflows.base import Workflow
from rllm_async.workflows.callables import load, maybe_await
from rllm_async.workflows.compaction import Compaction
from rllm_async.workflows.prompt import opening_messages

StepResult = tuple[str, float, bool]


class Env(Protocol):
    """An environment for one rollout: text observations in, the model's reply text as the action.

    Either method may be async. An env may also have `is_correct` (read when the episode ends) and
    `close()` (called when it ends, however it ends). An env whose own machinery fails (a sandbox
    died, a server is unreachable) raises `rllm_async.infra.InfraError` (or a registered type):
    the rollout is then marked infra-failed, neither scored nor trained; anything else it raises
    fails the rollout as an error.
    """

    def reset(self, task: dict[str, Any]) -> str | Awaitable[str]: ...

    def step(self, action: str) -> StepResult | Awaitable[StepResult]: ...


class EnvWorkflow(Workflow):
    """Show the env's observation, take the model's reply as the action, and repeat until the env
    says done or `max_turns` actions were taken.

    `env` is a factory (a class or function, or its import path) called with `env_args` for each
    rollout. Each step's reward is that model call's step reward (`ctx.set_step_reward`), so the
    trajectory's reward is their sum. Observations after the first are `observation_role` turns.

    With `compact_at` (a token budget), a conversation whose next prompt would be longer is
    compacted first (`RolloutContext.compact`): the policy summarizes it when asked
    `compact_prompt` (in at most `compact_max_tokens` tokens), the summary is trained as a step of
    the episode, and the game goes on from the opening turns and the summary.
    """

    def __init__(
        self,
        env: str | Callable[..., Env],
        env_args: dict[str, Any] | None = None,
        max_turns: int = 8,
        system_prompt: str | None = None,
        observation_role: str = "user",
        deadline_grace_s: float = 1.0,
        compact_at: int | None = None,
        compact_prompt: str = COMPACT_PROMPT,
        compact_max_tokens: int | None = None,
        summary_template: str = SUMMARY_TEMPLATE,
    ) -> None:
        if max_turns < 1:
            raise ValueError("max_turns must be at least 1")
        self.compaction = Compaction.of(
            compact_at, compact_prompt, compact_max_tokens, summary_template
        )
        self.make_env: Callable[..., Env] = load(env, "workflow.args.env")
        self.env_args = dict(env_args or {})
        self.max_turns = max_turns
        self.system_prompt = system_prompt
        self.observation_role = observation_role
        self.deadline_grace_s = deadline_grace_s

    async def run(self, task: dict[str, Any], ctx: RolloutContext) -> Episode:
        env = self.make_env(**self.env_args)
        termination = Termination.MAX_TURNS
        correct: Any = None
        compactions = 0
        try:
            observation = await maybe_await(env.reset(task))
            messages = opening_messages(observation, self.system_prompt)
            try:
                async with ctx.timeout(self.deadline_grace_s):  # a TIMEOUT, scored and trained
                    for _ in range(self.max_turns):
                        if self.compaction is not None:
                            compacted = await self.compaction.apply(ctx, messages)
                            compactions += compacted is not messages
                            messages = compacted
                        reply = await ctx.chat(messages)
                        observation, reward, done = await maybe_await(env.step(reply["content"]))
                        ctx.set_step_reward(reward)
                        if done:
                            termination = Termination.DONE
                            break
                        messages.append(reply)
                        messages.append({"role": self.observation_role, "content": observation})
            except TimeoutError:
                termination = Termination.TIMEOUT
            except ContextLengthError:
                termination = Termination.TRUNCATED
            correct = getattr(env, "is_correct", None)
        except Exception as e:
            cause = infra_failure(e)
            if cause is None:
                raise
            # Not the model's doing: the rollout is left out of its group (the runner sees it).
            name = type(env).__name__
            ctx.mark_infra_failed(f"env {name}: {type(cause).__name__}: {cause}")
            termination = Termination.ERROR
        finally:
            close = getattr(env, "close", None)
            if close is not None:
                await maybe_await(close())
        episode = ctx.build_episode(None)
        episode.is_correct = None if correct is None else bool(correct)
        episode.termination = termination
        episode.error = ctx.infra_failure
        episode.metrics["turns"] = float(len(ctx.trajectory().steps) - compactions)
        if self.compaction is not None:
            episode.metrics["compactions"] = float(compactions)
        return episode
