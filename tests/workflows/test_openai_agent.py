"""Training through the gateway: an `openai`-client agent, one real HTTP round trip per call."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from rllm_async import UnifiedTrainer
from rllm_async.config import config_from_dict
from rllm_async.rollout import RolloutContext
from rllm_async.types import Episode
from rllm_async.workflows import OpenAIAgentWorkflow
from rllm_async.workflows.openai_agent import openai_client

openai = pytest.importorskip("openai")


async def agent(base_url: str, api_key: str, task: dict[str, Any]) -> float:
    """Two turns of chat on the workflow's shared HTTP client (the session named by the API key,
    the base URL the same for every rollout); in between, a garbage body, a call naming an unknown
    session and a prompt over the context, each answered with its error while training goes on."""
    assert base_url.endswith("/v1") and "/sessions/" not in base_url
    client = openai_client(base_url, api_key, max_retries=0)
    messages: list[Any] = [{"role": "user", "content": task["prompt"]}]
    first = await client.chat.completions.create(model="policy", messages=messages)
    async with httpx.AsyncClient(headers={"Authorization": f"Bearer {api_key}"}) as http:
        bad = await http.post(f"{base_url}/chat/completions", content=b"{oops")
        assert bad.status_code == 400
        gone = await http.post(
            f"{base_url}/chat/completions", json={}, headers={"X-Session-Id": "nope"}
        )
        assert gone.status_code == 404
    with pytest.raises(openai.BadRequestError, match="context"):
        await client.chat.completions.create(
            model="policy", messages=[{"role": "user", "content": "x" * 100}]
        )
    messages += [first.choices[0].message.model_dump(exclude_none=True)]
    messages += [{"role": "user", "content": "again"}]
    second = await client.chat.completions.create(model="policy", messages=messages)
    text = (first.choices[0].message.content or "") + (second.choices[0].message.content or "")
    return sum(ch.isdigit() for ch in text) / max(1, len(text))


class Recorded(OpenAIAgentWorkflow):
    """Keeps every episode and the most sessions ever open at once."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.episodes: list[Episode] = []
        self.most_open = 0
        self.http_clients: set[int] = set()

    async def run(self, task: dict[str, Any], ctx: RolloutContext) -> Episode:
        episode = await super().run(task, ctx)
        assert self.gateway is not None
        self.most_open = max(self.most_open, len(self.gateway.sessions))
        self.http_clients.add(id(self.http))
        self.episodes.append(episode)
        return episode


def test_training_through_the_gateway_rebuilds_trajectories_from_its_records(tmp_path) -> None:
    config = config_from_dict(
        {
            "name": "gateway",
            "run_dir": str(tmp_path),
            "backend": {"name": "local", "model": "tiny", "max_seq_len": 64},
            "rollout": {"group_size": 4, "max_tokens": 6, "max_concurrency": 8},
            "train": {"total_steps": 3, "groups_per_step": 2},
            "algorithm": {"filter_zero_variance": False},
            "checkpoint": {"resume": "never", "at_end": False},
            "logging": {"progress_bar": False},
        }
    )
    workflow = Recorded(agent=agent)
    trainer = UnifiedTrainer(
        config,
        workflow=workflow,
        train_tasks=[{"id": str(i), "prompt": f"n={i}"} for i in range(12)],
    )
    records = trainer.run()
    assert len(records) == 3 and all(r["loss/num_tokens"] > 0 for r in records)
    assert len(workflow.episodes) >= 24
    for episode in workflow.episodes:
        [traj] = episode.trajectories
        first, second = traj.steps
        assert second.info["extended"]  # token-in/token-out across two HTTP requests
        assert second.prompt_ids[: len(first.prompt_ids) + len(first.completion_ids)] == (
            first.prompt_ids + first.completion_ids
        )
        assert all(len(s.logprobs) == len(s.versions) == len(s.completion_ids) for s in traj.steps)
        assert episode.metrics["calls"] == 3  # the oversized one counts, and recorded nothing
    assert 1 <= workflow.most_open <= 8  # sessions are freed as their episodes end
    assert len(workflow.http_clients) == 1  # one HTTP client served every rollout
    assert workflow.gateway is None and workflow.http is None  # stopped when training ended


def test_the_gateway_is_ready_after_start_and_gone_after_close() -> None:
    import asyncio

    from tests.scripted import ScriptedPolicy, context

    async def go() -> None:
        policy = ScriptedPolicy(lambda prompt: "hi")
        workflow = OpenAIAgentWorkflow(agent)
        with pytest.raises(RuntimeError, match=r"before start\(policy\)"):
            await workflow.run({"id": "t", "prompt": "p"}, context(policy))
        await workflow.start(policy)
        assert workflow.gateway is not None
        url = workflow.gateway.url
        async with httpx.AsyncClient() as http:  # answering before any rollout ran
            assert (await http.get(f"{url}/health")).status_code == 200
        await workflow.close()
        assert workflow.gateway is None
        async with httpx.AsyncClient() as http:
            with pytest.raises(httpx.ConnectError):
                await http.get(f"{url}/health")

    asyncio.run(go())
