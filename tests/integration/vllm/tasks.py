"""A task set for runs on the random tiny model: the reward is a property of the reply that varies
from sample to sample (its length's parity), so that groups have signal and steps are taken; and
a two-turn env whose workflow records each episode's token sequences."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from rllm_async.rollout import RolloutContext
from rllm_async.types import Episode
from rllm_async.workflows.env import EnvWorkflow


def generator(n: int = 64) -> list[dict[str, Any]]:
    return [{"id": f"p{i}", "prompt": f"what is {i} plus {i % 7}?"} for i in range(n)]


def reward(task: dict[str, Any], text: str) -> float:
    return float(len(text) % 2)


class TwoTurnEnv:
    """An env that asks a follow-up once: two model calls per episode, rewarded by the length
    parity of each reply."""

    def __init__(self) -> None:
        self.turns = 0

    def reset(self, task: dict[str, Any]) -> str:
        return str(task["prompt"])

    def step(self, action: str) -> tuple[str, float, bool]:
        self.turns += 1
        return "and once more?", float(len(action) % 2), self.turns >= 2


class RecordingEnvWorkflow(EnvWorkflow):
    """`EnvWorkflow` that appends each episode's steps and training sequences, as JSON lines, to
    the file `record`, for a test to read after the run."""

    def __init__(self, record: str, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.record = Path(record)

    async def run(self, task: dict[str, Any], ctx: RolloutContext) -> Episode:
        episode = await super().run(task, ctx)
        [traj] = episode.trajectories
        line = {
            "steps": [[s.prompt_ids, s.completion_ids, s.logprobs] for s in traj.steps],
            "sequences": [[q.tokens, q.loss_mask, q.logprobs] for q in traj.sequences()],
        }
        with self.record.open("a") as f:
            f.write(json.dumps(line) + "\n")
        return episode
