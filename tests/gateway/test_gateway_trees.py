"""Child sessions: a black-box framework's subagents recorded as a tree of the rollout. Real
openai-agents runs (a handoff; an agent used as a tool) against a gateway on 127.0.0.1 over a
scripted policy, each agent on an `openai` client whose only difference is its `X-Agent-Role`
header; and a child session opened with a key of its own."""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
import openai
import pytest

from rllm_async.gateway import Gateway
from rllm_async.gateway.errors import APIError
from rllm_async.types import Episode, StepRef
from tests.gateway.test_gateway import KEY, serving
from tests.scripted import RecordingPolicy, ScriptedPolicy, context

HANDOFF = '<tool_call>{"name": "transfer_to_specialist", "arguments": {}}</tool_call>'
TRANSLATE = '<tool_call>{"name": "translate", "arguments": {"input": "hello"}}</tool_call>'


def reply(prompt: str) -> str:
    """Each agent is told apart by its instructions, which open its prompt."""
    if "TRIAGE" in prompt:
        return HANDOFF
    if "SPECIALIST" in prompt:
        return "the specialist's answer"
    if "TRANSLATOR" in prompt:
        return "HOLA"
    if "ORCHESTRATOR" in prompt:
        return "done: HOLA" if "HOLA" in prompt else TRANSLATE
    return "?"


def _model(base_url: str, key: str, role: str | None) -> Any:
    import agents

    headers = {"X-Agent-Role": role} if role else None
    client = openai.AsyncOpenAI(base_url=base_url, api_key=key, default_headers=headers)
    return agents.OpenAIChatCompletionsModel(model="policy", openai_client=client)


async def _run(agent_fn: Any) -> tuple[Any, Episode, RecordingPolicy, dict[str, Any]]:
    policy = RecordingPolicy(ScriptedPolicy(reply))
    gateway: Gateway
    async with serving(policy, constraints="check") as gateway:
        ctx = context(policy)
        session = gateway.session(ctx)
        result = await agent_fn(f"{gateway.url}/v1", session.key)
        records = session.records()
        gateway.sessions.close(session.id)
        return result, ctx.build_episode(1.0), policy, records


def _exact(episode: Episode, policy: RecordingPolicy) -> None:
    """Every recorded step is one call the policy answered, token for token, and every call is."""
    recorded = sorted(
        (s.prompt_ids, s.completion_ids) for t in episode.trajectories for s in t.steps
    )
    assert recorded == sorted((p, out.ids) for p, out in policy.calls)
    for t in episode.trajectories:
        for s in t.steps:
            assert len(s.logprobs) == len(s.versions) == len(s.completion_ids)


def test_an_openai_agents_handoff_is_recorded_as_a_child_of_the_call_that_handed_off() -> None:
    import agents

    agents.set_tracing_disabled(True)

    async def agent(base_url: str, key: str) -> Any:
        specialist = agents.Agent(
            name="specialist", instructions="SPECIALIST", model=_model(base_url, key, "specialist")
        )
        triage = agents.Agent(
            name="triage",
            instructions="TRIAGE",
            handoffs=[specialist],
            model=_model(base_url, key, None),
        )
        return (await agents.Runner.run(triage, "help me", max_turns=4)).final_output

    result, episode, policy, records = asyncio.run(_run(agent))
    assert result == "the specialist's answer"
    root, child = episode.trajectories
    assert (root.name, child.name) == ("default", "specialist")
    assert root.parent is None and len(root.steps) == 1
    assert child.parent == StepRef("default", 0, "spawn") and len(child.steps) == 1
    assert "transfer_to_specialist" in policy.inner.text(root.steps[0].completion_ids)
    # The specialist's prompt carries the conversation so far, as prompt tokens of its own.
    assert "help me" in policy.inner.text(child.steps[0].prompt_ids)
    _exact(episode, policy)
    assert [t.reward for t in episode.trajectories] == [1.0, 1.0]
    assert records["tree"] == {
        "default": {"role": "default", "parent": None},
        child.node_id: {
            "role": "specialist",
            "parent": {"node": "default", "step": 0, "kind": "spawn"},
        },
    }
    assert records["calls"] == 2


def test_an_agent_used_as_a_tool_is_recorded_as_a_child_and_its_caller_goes_on() -> None:
    import agents

    agents.set_tracing_disabled(True)

    async def agent(base_url: str, key: str) -> Any:
        translator = agents.Agent(
            name="translator", instructions="TRANSLATOR", model=_model(base_url, key, "translator")
        )
        orchestrator = agents.Agent(
            name="orchestrator",
            instructions="ORCHESTRATOR",
            tools=[translator.as_tool(tool_name="translate", tool_description="Translate.")],
            model=_model(base_url, key, None),
        )
        return (await agents.Runner.run(orchestrator, "say hello", max_turns=4)).final_output

    result, episode, policy, _ = asyncio.run(_run(agent))
    assert result == "done: HOLA"
    root, child = episode.trajectories
    assert [len(root.steps), len(child.steps)] == [2, 1]
    assert child.name == "translator" and child.parent == StepRef("default", 0, "spawn")
    assert root.steps[1].info["extended"]  # the orchestrator's conversation goes on, exact
    _exact(episode, policy)


def test_a_child_session_with_its_own_key_and_its_own_reward() -> None:
    """`POST /sessions/{id}/children`: a child with its own base URL and key, linked to the
    parent's latest step; its reward (online) is its own credit and closes it alone."""

    async def go() -> tuple[Episode, dict[str, Any]]:
        policy = RecordingPolicy(ScriptedPolicy(reply))
        gateway: Gateway
        async with serving(policy, constraints="check") as gateway:
            ctx = context(policy)
            session = gateway.session(ctx)
            url = gateway.url
            async with openai.AsyncOpenAI(base_url=f"{url}/v1", api_key=session.key) as root:
                await root.chat.completions.create(
                    model="policy", messages=[{"role": "user", "content": "ORCHESTRATOR go"}]
                )
            async with httpx.AsyncClient(headers={"Authorization": f"Bearer {session.key}"}) as h:
                r = await h.post(f"{url}/sessions/{session.id}/children", json={"role": "critic"})
            assert r.status_code == 201, r.text
            opened = r.json()
            assert opened["parent"] == {"session": session.id, "node": "default", "step": 0}
            async with openai.AsyncOpenAI(base_url=opened["base_url"], api_key=KEY) as sub:
                await sub.chat.completions.create(
                    model="policy", messages=[{"role": "user", "content": "TRANSLATOR x"}]
                )
            async with httpx.AsyncClient(headers={"Authorization": f"Bearer {KEY}"}) as h:
                r = await h.post(f"{url}/sessions/{opened['id']}/reward", json={"reward": 0.25})
            # A child's reward is its branch's own credit; it closes the child alone.
            assert r.status_code == 200, r.text
            with pytest.raises(APIError, match="already has its reward"):
                gateway.sessions.get(opened["id"])
            assert not session.closed
            records = session.records()
            gateway.sessions.close(session.id)
            return ctx.build_episode(1.0), records

    episode, records = asyncio.run(go())
    _, child = episode.trajectories
    assert child.name == "critic" and child.parent == StepRef("default", 0, "spawn")
    assert [t.reward for t in episode.trajectories] == [1.0, 0.25]
    assert set(records["trajectories"]) == {"default", child.node_id}
