"""The workflow API: `Workflow.run(task, ctx)` and the `RolloutContext` that records its model calls."""

from __future__ import annotations

import asyncio
import copy
from abc import ABC, abstractmethod
from collections.abc import Awaitable, Callable
from typing import Any

from rllm_async.backends.base import Completion, PolicyClient, SamplingParams
from rllm_async.types import Episode, Step, Termination, Trajectory


class Workflow(ABC):
    """How one rollout of one task goes. Subclasses take their config `args` as keyword arguments.

    `run` returns an Episode, a float (one trajectory with that reward), or None (the trajectories
    recorded on `ctx` with the rewards given through `ctx.set_reward`).
    """

    @abstractmethod
    async def run(self, task: dict[str, Any], ctx: RolloutContext) -> Episode | float | None: ...


class RolloutContext:
    """The policy as one rollout sees it: every call is recorded as a Step of the calling actor.

    With `pin=True` the first call fixes the policy version for the whole episode; a `version`
    acquired by the caller (evaluation) pins every call to it. Every call waits while the
    coordinator has paused model calls for a weight sync (`wait_unpaused`).
    """

    def __init__(
        self,
        policy: PolicyClient,
        *,
        sampling: SamplingParams,
        pin: bool,
        wait_unpaused: Callable[[], Awaitable[None]],
        deadline: float,
        task_id: str,
        rollout_index: int = 0,
        attempt: int = 0,
        version: int | None = None,
    ) -> None:
        self.policy = policy
        self.sampling = sampling
        self.deadline = deadline
        self.task_id = task_id
        self.rollout_index = rollout_index
        self.attempt = attempt
        self._pin = pin or version is not None
        self._wait_unpaused = wait_unpaused
        self._version = version
        self._owns_version = False
        self._trajectories: dict[str, Trajectory] = {}

    @property
    def time_left(self) -> float:
        """Seconds until this episode's deadline, on the event loop's clock."""
        return self.deadline - asyncio.get_running_loop().time()

    @property
    def pinned_version(self) -> int | None:
        return self._version

    @property
    def num_completion_tokens(self) -> int:
        """Tokens sampled so far in this rollout, by every actor."""
        return sum(t.num_completion_tokens for t in self._trajectories.values())

    def trajectory(self, actor: str = "default") -> Trajectory:
        traj = self._trajectories.get(actor)
        if traj is None:
            traj = self._trajectories[actor] = Trajectory(name=actor)
        return traj

    async def generate(
        self,
        prompt_ids: list[int],
        *,
        actor: str = "default",
        messages: list[dict[str, Any]] | None = None,
        **sampling: Any,
    ) -> Completion:
        """Sample a completion for exact prompt tokens and record it as a Step of `actor`."""
        await self._wait_unpaused()
        if self._pin and self._version is None:
            self._version = self.policy.acquire()
            self._owns_version = True
        params = self.sampling.updated(**sampling)
        out = await self.policy.generate(prompt_ids, params, version=self._version)
        self.trajectory(actor).steps.append(
            Step(
                prompt_ids=list(prompt_ids),
                completion_ids=out.ids,
                logprobs=out.logprobs,
                versions=out.versions,
                messages=copy.deepcopy(messages) if messages is not None else None,
                info={"finish_reason": out.finish_reason},
            )
        )
        return out

    async def chat(
        self,
        messages: list[dict[str, Any]],
        *,
        tools: list[dict[str, Any]] | None = None,
        actor: str = "default",
        **sampling: Any,
    ) -> dict[str, Any]:
        """Render `messages` with the policy's chat template, sample, and return the reply message.

        The step keeps a deep copy of `messages` as they were at this call.
        """
        tok = self.policy.tokenizer
        prompt_ids = tok.apply_chat_template(messages, tools=tools, add_generation_prompt=True)
        out = await self.generate(prompt_ids, actor=actor, messages=messages, **sampling)
        return {"role": "assistant", "content": tok.decode(out.ids)}

    def set_reward(self, reward: float, actor: str = "default") -> None:
        self.trajectory(actor).reward = float(reward)

    def set_step_reward(self, reward: float, actor: str = "default") -> None:
        """Reward the latest step of `actor` (per-step rewards for multi-turn workflows)."""
        self.trajectory(actor).steps[-1].reward = float(reward)

    def close(self) -> None:
        """Release the pinned snapshot; called once by the trainer when the rollout ends."""
        if self._owns_version and self._version is not None:
            self.policy.release(self._version)
            self._owns_version = False

    def build_episode(self, result: Episode | float | None) -> Episode:
        """Turn what `Workflow.run` returned into an Episode holding this context's trajectories."""
        if isinstance(result, Episode):
            if not result.trajectories:
                result.trajectories = list(self._trajectories.values())
            return result
        trajs = list(self._trajectories.values())
        if result is not None:
            if not isinstance(result, (int, float)):
                raise TypeError(
                    f"Workflow.run must return an Episode, a float or None, got {type(result).__name__}"
                )
            if len(trajs) > 1:
                raise TypeError(
                    "Workflow.run returned a float but recorded several actors; return an Episode "
                    "or use ctx.set_reward(reward, actor=...) and return None"
                )
            for t in trajs:
                t.reward = float(result)
        reward = float(result) if result is not None else sum(t.reward for t in trajs)
        return Episode(
            task_id=self.task_id, trajectories=trajs, reward=reward, termination=Termination.DONE
        )
