"""Real agent frameworks from PyPI, each running its tool-calling loop to the end against a gateway
on 127.0.0.1 over a scripted policy; every call is recorded in a session named by its API key."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

import openai
import pytest

from rllm_async.gateway import Gateway
from tests.gateway.frameworks import FINAL, Answer, calc, calc_agent, reply
from tests.gateway.test_gateway import serving
from tests.scripted import ScriptedPolicy, context


async def run_in_session(agent: Callable[[str, str], Awaitable[Any]]) -> tuple[Any, list[Any]]:
    """`agent(base_url, api_key)` against a session named by its key; its result and the steps.
    The scripted policy cannot constrain decoding: the gateway only checks (`constraints`)."""
    policy = ScriptedPolicy(reply)
    gateway: Gateway
    async with serving(policy, constraints="check") as gateway:
        session = gateway.session(context(policy))
        result = await agent(f"{gateway.url}/v1", session.key)
        return result, session.ctx.trajectory().steps


def test_openai_agents_chat_completions_model_with_tools_and_output_type() -> None:
    import agents

    async def agent(base_url: str, key: str) -> Any:
        client = openai.AsyncOpenAI(base_url=base_url, api_key=key)
        model = agents.OpenAIChatCompletionsModel(model="policy", openai_client=client)
        return (await agents.Runner.run(calc_agent(model), "6*7?", max_turns=4)).final_output

    result, steps = asyncio.run(run_in_session(agent))
    assert result == Answer(answer=42)
    assert len(steps) == 2 and steps[1].info["extended"]
    assert steps[1].info["response_format"] == {
        "type": "json_schema",
        "error": None,
        "enforced": False,
    }


def test_langgraph_react_agent_and_structured_output() -> None:
    import langchain_openai
    from langchain_core.tools import tool
    from langgraph import prebuilt

    async def agent(base_url: str, key: str) -> Any:
        llm = langchain_openai.ChatOpenAI(model="policy", base_url=base_url, api_key=key)
        graph = prebuilt.create_react_agent(llm, [tool(calc)])
        out = await graph.ainvoke({"messages": [("user", "6*7?")]})
        structured = [
            await llm.with_structured_output(Answer, method=method).ainvoke("6*7?")
            for method in ("json_schema", "function_calling", "json_mode")
        ]
        return out["messages"][-1].content, structured

    (final, structured), steps = asyncio.run(run_in_session(agent))
    assert final == FINAL and structured == [Answer(answer=42)] * 3
    assert len(steps) == 5 and steps[1].info["extended"]
    assert steps[3].info["forced_prefix"].endswith('"name": "Answer", "arguments": ')


def test_smolagents_tool_calling_agent_with_its_defaults() -> None:
    import smolagents

    async def agent(base_url: str, key: str) -> Any:
        model = smolagents.OpenAIServerModel(model_id="policy", api_base=base_url, api_key=key)
        bot = smolagents.ToolCallingAgent(tools=[smolagents.tool(calc)], model=model)
        return await asyncio.to_thread(bot.run, "6*7?")

    result, steps = asyncio.run(run_in_session(agent))
    assert str(result) == "42"
    # tool_choice="required" on every step: the opening of the call is prompt, never sampled.
    assert len(steps) == 2 and all("forced_prefix" in s.info for s in steps)


def test_litellm_tool_loop(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # no fetch of prices at import
    import litellm

    tools = [
        {
            "type": "function",
            "function": {
                "name": "calc",
                "parameters": {"type": "object", "properties": {"expr": {"type": "string"}}},
            },
        }
    ]

    async def agent(base_url: str, key: str) -> Any:
        messages: list[Any] = [{"role": "user", "content": "6*7?"}]
        options = {"model": "openai/policy", "api_base": base_url, "api_key": key, "tools": tools}
        r = await litellm.acompletion(messages=messages, tool_choice="required", **options)
        [call] = r.choices[0].message.tool_calls
        messages += [r.choices[0].message.model_dump(exclude_none=True)]
        messages += [{"role": "tool", "tool_call_id": call.id, "content": calc("6*7")}]
        r = await litellm.acompletion(messages=messages, **options)
        return r.choices[0].message.content

    result, steps = asyncio.run(run_in_session(agent))
    assert result == FINAL and len(steps) == 2 and steps[1].info["extended"]
