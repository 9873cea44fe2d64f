"""A short training run through the gateway with a real agent framework as the agent: each rollout
is an openai-agents `Agent` (its Responses model or its chat-completions model, a function tool
and a typed output) on `openai_client(...)`. A scripted sampler decides per rollout whether the
agent uses the tool, so groups differ in reward; the local backend's tiny model trains on the
tokens the gateway recorded."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import agents

from rllm_async import UnifiedTrainer
from rllm_async.backends.local import LocalBackend
from rllm_async.config import config_from_dict
from rllm_async.protocols import Backend, PolicyClient
from rllm_async.rollout import RolloutContext
from rllm_async.types import Episode
from rllm_async.workflows import OpenAIAgentWorkflow
from rllm_async.workflows.openai_agent import openai_client
from tests.gateway.frameworks import RESULT, Answer, calc_agent
from tests.scripted import ScriptedPolicy

CALL = '<tool_call>{"name": "calc", "arguments": {"expr": "6*7"}}</tool_call>'


def sampler(seed: int) -> ScriptedPolicy:
    """Calls `calc` or guesses (a coin flip) until the tool's result is in the prompt; answers 42
    after it, 0 without it."""
    rng = random.Random(seed)

    def reply(prompt: str) -> str:
        if RESULT in prompt:
            return '{"answer": 42}'
        return CALL if rng.random() < 0.5 else '{"answer": 0}'

    return ScriptedPolicy(reply)


class ScriptedSampling:
    """The local backend's learner behind a scripted sampler on the same character tokenizer: the
    tiny model trains on the exact tokens the gateway recorded."""

    def __init__(self, learner: LocalBackend, policy: ScriptedPolicy) -> None:
        self.learner = learner
        self._policy = policy
        self.trained_tokens = 0
        self.advantaged = 0  # trajectories trained with a nonzero advantage

    def policy(self) -> PolicyClient:
        return self._policy

    async def forward_backward(self, groups: list[Any], loss: Any) -> dict[str, float]:
        self.trained_tokens += sum(g.num_completion_tokens for g in groups)
        self.advantaged += sum(a != 0 for g in groups for a in g.advantages)
        return await self.learner.forward_backward(groups, loss)

    async def optim_step(self) -> dict[str, float]:
        return await self.learner.optim_step()

    async def on_policy_updated(self, version: int) -> None:
        await self.learner.on_policy_updated(version)
        self._policy.version = version

    async def save(self, path: Path) -> None:
        await self.learner.save(path)

    async def load(self, path: Path) -> None:
        await self.learner.load(path)

    async def close(self) -> None:
        await self.learner.close()


async def agent(base_url: str, api_key: str, task: dict[str, Any]) -> float:
    """An openai-agents Agent on the workflow's shared HTTP client; its reward is a right answer."""
    client = openai_client(base_url, api_key)
    if task["api"] == "responses":
        model: Any = agents.OpenAIResponsesModel(model="policy", openai_client=client)
    else:
        model = agents.OpenAIChatCompletionsModel(model="policy", openai_client=client)
    result = await agents.Runner.run(calc_agent(model), task["prompt"], max_turns=4)
    return float(result.final_output == Answer(answer=42))


class Recorded(OpenAIAgentWorkflow):
    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.episodes: list[Episode] = []

    async def run(self, task: dict[str, Any], ctx: RolloutContext) -> Episode:
        episode = await super().run(task, ctx)
        self.episodes.append(episode)
        return episode


def test_training_an_openai_agents_agent_through_the_gateway(tmp_path: Path) -> None:
    config = config_from_dict(
        {
            "name": "agents",
            "run_dir": str(tmp_path),
            "backend": {"name": "local", "model": "tiny", "max_seq_len": 1024},
            "rollout": {"group_size": 4, "max_tokens": 96, "max_concurrency": 8},
            "train": {"total_steps": 3, "groups_per_step": 2},
            "algorithm": {"filter_zero_variance": False},
            "checkpoint": {"resume": "never", "at_end": False},
            "logging": {"progress_bar": False},
        }
    )
    policy = sampler(seed=0)
    backend = ScriptedSampling(LocalBackend.from_config(config), policy)
    assert isinstance(backend, Backend)
    workflow = Recorded(agent=agent, constraints="check")  # the scripted sampler cannot enforce
    tasks = [
        {"id": str(i), "prompt": "6*7?", "api": ("responses", "chat")[i % 2]} for i in range(12)
    ]
    trainer = UnifiedTrainer(config, backend=backend, workflow=workflow, train_tasks=tasks)
    records = trainer.run()

    assert len(records) == 3 and all(r["loss/num_tokens"] > 0 for r in records)
    assert backend.trained_tokens > 0 and backend.advantaged > 0
    assert policy.version >= 3  # every step synced new weights
    used_tool = [e for e in workflow.episodes if len(e.trajectories[0].steps) == 2]
    guessed = [e for e in workflow.episodes if len(e.trajectories[0].steps) == 1]
    assert used_tool and guessed  # both outcomes happen
    for episode in used_tool:  # rebuilt from the gateway's records, one token sequence
        first, second = episode.trajectories[0].steps
        assert second.info["extended"] and episode.trajectories[0].reward == 1.0
        assert second.prompt_ids[: len(first.prompt_ids) + len(first.completion_ids)] == (
            first.prompt_ids + first.completion_ids
        )
        assert policy.text(first.completion_ids).startswith(CALL)
        assert f"<|tool|>{RESULT}<|end|>" in policy.text(second.prompt_ids)
    for episode in guessed:
        assert episode.trajectories[0].reward == 0.0
    for episode in workflow.episodes:
        steps = episode.trajectories[0].steps
        # the typed output, as both models ask for it: checked JSON on the answering call
        assert steps[-1].info["response_format"] == {
            "type": "json_schema",
            "error": None,
            "enforced": False,
        }
        assert all(len(s.logprobs) == len(s.versions) == len(s.completion_ids) for s in steps)
