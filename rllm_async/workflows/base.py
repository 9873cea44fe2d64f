"""The workflow API: `Workflow.run(task, ctx)`, how one rollout of one task goes."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, ClassVar

from rllm_async.metrics import Reduce
from rllm_async.protocols import PolicyClient
from rllm_async.rollout import RolloutContext
from rllm_async.types import Episode


class Workflow(ABC):
    """How one rollout of one task goes. Subclasses take their config `args` as keyword arguments.

    `run` returns an Episode, a float (one trajectory with that reward), or None (the trajectories
    recorded on `ctx` with the rewards given through `ctx.set_reward`).

    Numbers a returned Episode reports in `metrics` reach each step's record as `episode/<key>`,
    averaged over the step's episodes that report the key; `metric_reductions` declares another
    reduction for a key (`sum`, `min`, `max` or `last`).
    """

    metric_reductions: ClassVar[dict[str, Reduce]] = {}

    @abstractmethod
    async def run(self, task: dict[str, Any], ctx: RolloutContext) -> Episode | float | None: ...

    async def start(self, policy: PolicyClient) -> None:
        """Start what every `run` shares (a server, a pool) for rollouts that sample from
        `policy`; the trainer calls it once before the first rollout."""
        return None

    async def close(self) -> None:
        """Release what `start` started; the trainer calls it once at the end."""
        return None

    def step_metrics(self) -> dict[str, float]:
        """Figures of the workflow's own, not of any one episode (counts since the last call,
        levels now); the trainer takes them once per step into its record as `workflow/<key>`."""
        return {}
