"""`POST /v1/messages` through a real server on 127.0.0.1 with the official `anthropic` client:
plain, a tool loop whose second turn extends the first's tokens, forced tool calls, streaming
(every event validating as the `anthropic` package's types), thinking blocks, stop reasons and
refusals in the Anthropic error shape; every call recorded in a session as chat completions are."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import anthropic
import httpx
import pytest
from anthropic.types import Message, RawMessageStreamEvent
from pydantic import TypeAdapter

from rllm_async.protocols import SamplingParams
from rllm_async.rollout import RolloutContext
from rllm_async.rollout.reply_parser import reply_parser
from rllm_async.rollout.tool_parsers import HermesParser
from rllm_async.workflows import OpenAIAgentWorkflow
from rllm_async.workflows.openai_agent import anthropic_client
from tests.gateway.frameworks import FINAL, RESULT, reply
from tests.gateway.test_gateway import KEY, serving
from tests.scripted import ScriptedPolicy, context

CALC = {
    "name": "calc",
    "description": "evaluate a product",
    "input_schema": {"type": "object", "properties": {"expr": {"type": "string"}}},
}
EVENTS: TypeAdapter[RawMessageStreamEvent] = TypeAdapter(RawMessageStreamEvent)


def test_plain_message_with_a_system_prompt() -> None:
    policy = ScriptedPolicy(lambda p: "fine, thanks")

    async def go() -> None:
        async with serving(policy) as gateway:
            session = gateway.session(context(policy))
            client = anthropic.AsyncAnthropic(base_url=gateway.url, api_key=session.key)
            raw = await client.messages.with_raw_response.create(
                model="policy",
                max_tokens=64,
                system="Be brief.",
                messages=[{"role": "user", "content": "how are you?"}],
            )
            r = Message.model_validate(
                json.loads(raw.http_response.text)
            )  # the body validates as is
            assert r.stop_reason == "end_turn" and r.stop_sequence is None
            [text] = r.content
            assert text.type == "text" and text.text == "fine, thanks"
            [step] = session.ctx.trajectory().steps
            assert policy.text(step.prompt_ids) == (
                "<|system|>Be brief.<|end|><|user|>how are you?<|end|><|assistant|>"
            )
            assert r.usage.input_tokens == len(step.prompt_ids)
            assert r.usage.output_tokens == len(step.completion_ids)

    asyncio.run(go())


def test_a_tool_loop_extends_the_recorded_tokens() -> None:
    policy = ScriptedPolicy(reply)

    async def go() -> None:
        async with serving(policy) as gateway:
            session = gateway.session(context(policy))
            # the session-path variant, with the gateway's own key
            client = anthropic.AsyncAnthropic(
                base_url=f"{gateway.url}/sessions/{session.id}", api_key=KEY
            )
            messages: list[Any] = [{"role": "user", "content": "6*7?"}]
            r = await client.messages.create(
                model="policy", max_tokens=128, messages=messages, tools=[CALC]
            )
            assert r.stop_reason == "tool_use"
            [call] = r.content
            assert call.type == "tool_use" and call.name == "calc"
            assert call.input == {"expr": "6*7"} and call.id.startswith("call_")
            messages += [
                {"role": "assistant", "content": r.content},
                {
                    "role": "user",
                    "content": [{"type": "tool_result", "tool_use_id": call.id, "content": RESULT}],
                },
            ]
            r = await client.messages.create(
                model="policy", max_tokens=128, messages=messages, tools=[CALC]
            )
            assert r.stop_reason == "end_turn" and r.content[0].type == "text"
            assert r.content[0].text == FINAL
            first, second = session.ctx.trajectory().steps
            assert second.info["extended"]
            assert second.prompt_ids[: len(first.prompt_ids) + len(first.completion_ids)] == (
                first.prompt_ids + first.completion_ids
            )
            assert second.messages[-1] == {
                "role": "tool",
                "content": RESULT,
                "tool_call_id": call.id,
            }

    asyncio.run(go())


def test_forced_tool_choices_open_the_call_in_the_prompt() -> None:
    policy = ScriptedPolicy(reply)

    async def go() -> None:
        async with serving(policy, constraints="check") as gateway:
            session = gateway.session(context(policy))
            client = anthropic.AsyncAnthropic(base_url=gateway.url, api_key=session.key)
            for choice in ({"type": "tool", "name": "calc"}, {"type": "any"}):
                r = await client.messages.create(
                    model="policy",
                    max_tokens=128,
                    messages=[{"role": "user", "content": "go"}],
                    tools=[CALC],
                    tool_choice=choice,  # type: ignore[arg-type]
                )
                assert r.stop_reason == "tool_use" and r.content[0].type == "tool_use"
                assert r.content[0].input == {"expr": "6*7"}
            named, anyone = session.ctx.trajectory().steps
            assert named.info["forced_prefix"].endswith('"name": "calc", "arguments": ')
            assert anyone.info["forced_prefix"].endswith('<tool_call>{"name": "')

    asyncio.run(go())


def test_streaming_sends_the_messages_event_sequence() -> None:
    policy = ScriptedPolicy(
        lambda p: 'ok <tool_call>{"name": "calc", "arguments": {"expr": "6*7"}}</tool_call>'
    )

    async def go() -> None:
        async with serving(policy) as gateway:
            client = anthropic.AsyncAnthropic(base_url=gateway.url, api_key=KEY)
            request: dict[str, Any] = {
                "model": "policy",
                "max_tokens": 128,
                "messages": [{"role": "user", "content": "go"}],
                "tools": [CALC],
            }
            stream = await client.messages.create(**request, stream=True)
            events = [e async for e in stream]
            assert [e.type for e in events] == [
                "message_start",
                "content_block_start",
                "content_block_delta",
                "content_block_stop",
                "content_block_start",
                "content_block_delta",
                "content_block_stop",
                "message_delta",
                "message_stop",
            ]
            for event in events:  # each one validates as the type it names
                EVENTS.validate_python(event.model_dump())
            assert events[2].delta.type == "text_delta"  # type: ignore[union-attr]
            assert events[5].delta.type == "input_json_delta"  # type: ignore[union-attr]
            assert events[7].delta.stop_reason == "tool_use"  # type: ignore[union-attr]
            async with client.messages.stream(**request) as s:
                texts = [t async for t in s.text_stream]
                final = await s.get_final_message()
            assert texts == ["ok"] and final.stop_reason == "tool_use"
            text, call = final.content
            assert text.type == "text" and text.text == "ok"
            assert call.type == "tool_use" and call.input == {"expr": "6*7"}

    asyncio.run(go())


def test_reasoning_is_a_thinking_block_and_left_out_when_sent_back() -> None:
    policy = ScriptedPolicy(lambda p: "<think>6 times 7</think>42")

    async def go() -> None:
        async with serving(policy) as gateway:
            ctx = RolloutContext(
                policy,
                sampling=SamplingParams(max_tokens=64),
                pin=True,
                deadline=1e9,
                task_id="t",
                parser=reply_parser(policy.tok, reasoning_parser="think"),
            )
            session = gateway.session(ctx)
            client = anthropic.AsyncAnthropic(base_url=gateway.url, api_key=session.key)
            messages: list[Any] = [{"role": "user", "content": "6*7?"}]
            r = await client.messages.create(model="policy", max_tokens=64, messages=messages)
            thought, text = r.content
            assert thought.type == "thinking" and thought.thinking == "6 times 7"
            assert text.type == "text" and text.text == "42"
            messages += [
                {"role": "assistant", "content": r.content},
                {"role": "user", "content": "and 6*8?"},
            ]
            await client.messages.create(model="policy", max_tokens=64, messages=messages)
            assert session.ctx.trajectory().steps[1].info["extended"]
            stream = await client.messages.create(
                model="policy", max_tokens=64, messages=messages[:1], stream=True
            )
            deltas = [e.delta.type async for e in stream if e.type == "content_block_delta"]
            assert deltas == ["thinking_delta", "text_delta"]

    asyncio.run(go())


def test_stop_reasons_for_stop_sequences_and_max_tokens() -> None:
    policy = ScriptedPolicy(lambda p: "a long answer")

    async def go() -> None:
        async with serving(policy) as gateway:
            client = anthropic.AsyncAnthropic(base_url=gateway.url, api_key=KEY)
            question: list[Any] = [{"role": "user", "content": "q"}]
            r = await client.messages.create(
                model="policy", max_tokens=64, messages=question, stop_sequences=["x", "long"]
            )
            assert r.stop_reason == "stop_sequence" and r.stop_sequence == "long"
            assert r.content[0].type == "text" and r.content[0].text == "a "
            r = await client.messages.create(model="policy", max_tokens=3, messages=question)
            assert r.stop_reason == "max_tokens" and r.content[0].type == "text"
            assert r.content[0].text == "a l"

    asyncio.run(go())


REFUSED: list[tuple[dict[str, Any], str]] = [
    ({"top_k": 5}, "top_k"),
    ({"temperature": 0.5}, "temperature"),  # the session's temperature is the trainer's
    ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "tools.0.type"),
    ({"tools": [CALC], "tool_choice": {"type": "tool", "name": "nope"}}, "tool_choice"),
    ({"tool_choice": {"type": "any"}}, "tool_choice"),
    (
        {"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]},
        "messages.0.content.0",
    ),
    ({"max_tokens": 0}, "max_tokens"),
    ({"mcp_servers": []}, "mcp_servers"),
    ({"output_config": {}}, "output_config"),
]


def test_refusals_come_in_the_anthropic_error_shape() -> None:
    policy = ScriptedPolicy(lambda p: "x", max_context_tokens=64)

    async def go() -> None:
        async with serving(policy) as gateway:
            session = gateway.session(context(policy, temperature=1.0))
            url = f"{gateway.url}/v1/messages"
            base = {
                "model": "policy",
                "max_tokens": 8,
                "messages": [{"role": "user", "content": "q"}],
            }
            headers = {"x-api-key": KEY, "X-Session-Id": session.id}
            async with httpx.AsyncClient(headers=headers, timeout=30) as http:
                for extra, param in REFUSED:
                    r = await http.post(url, json={**base, **extra})
                    assert r.status_code == 400, (extra, r.text)
                    body = r.json()
                    assert body["type"] == "error" and set(body["error"]) == {"type", "message"}
                    assert body["error"]["type"] == "invalid_request_error"
                    assert body["error"]["message"].startswith(param), (param, body)
                ignored = {"metadata": {"user_id": "u"}, "speed": "fast", "inference_geo": "us"}
                ignored |= {"diagnostics": {}, "user_profile_id": "p", "workspace_id": "w"}
                r = await http.post(url, json={**base, **ignored})
                assert r.status_code == 200 and Message.model_validate(r.json())
                r = await http.post(url, json={**base, "model": "claude"})
                assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"
                r = await http.post(url, json=base, headers={"x-api-key": "wrong"})
                assert r.status_code == 401
                assert r.json()["error"]["type"] == "authentication_error"
            assert len(session.ctx.trajectory().steps) == 1  # recorded by the header's session
            client = anthropic.AsyncAnthropic(base_url=gateway.url, api_key=KEY, max_retries=0)
            with pytest.raises(anthropic.BadRequestError, match="context") as e:
                await client.messages.create(
                    model="policy", max_tokens=8, messages=[{"role": "user", "content": "x" * 99}]
                )
            assert e.value.body["error"]["type"] == "invalid_request_error"  # type: ignore[index]

    asyncio.run(go())


def test_count_tokens_counts_the_prompt_a_message_call_renders() -> None:
    policy = ScriptedPolicy(lambda p: "42")

    async def go() -> None:
        async with serving(policy) as gateway:
            session = gateway.session(context(policy))
            client = anthropic.AsyncAnthropic(base_url=gateway.url, api_key=session.key)
            chat: Any = [{"role": "user", "content": "6*7?"}]
            prompt: Any = {"messages": chat, "system": "Be brief.", "tools": [CALC]}
            counted = await client.messages.count_tokens(model="policy", **prompt)
            forced = await client.messages.count_tokens(
                model="policy", **prompt, tool_choice={"type": "tool", "name": "calc"}
            )
            plain = await client.messages.count_tokens(model="policy", messages=chat)
            await client.messages.create(model="policy", max_tokens=8, **prompt)
            [step] = session.ctx.trajectory().steps  # counting samples and records nothing
            assert counted.input_tokens == len(step.prompt_ids)
            opening = HermesParser().forced_prefix("calc")
            assert forced.input_tokens == counted.input_tokens + len(opening)
            assert 0 < plain.input_tokens < counted.input_tokens
            with pytest.raises(anthropic.NotFoundError):
                await client.messages.count_tokens(model="claude", messages=chat)
            with pytest.raises(anthropic.BadRequestError, match="max_tokens"):
                await client.messages.count_tokens(
                    model="policy", messages=chat, extra_body={"max_tokens": 8}
                )

    asyncio.run(go())


def test_anthropic_client_shares_the_workflows_http_client() -> None:
    """`anthropic_client(base_url, api_key)` takes the agent's `/v1` base URL and the session's key,
    on one HTTP client for every rollout; its calls are the rollout's steps."""
    policy = ScriptedPolicy(lambda p: "42")
    clients: list[Any] = []

    async def agent(base_url: str, api_key: str, task: dict[str, Any]) -> float:
        client = anthropic_client(base_url, api_key, max_retries=0)
        clients.append(client)
        m = await client.messages.create(
            model="policy", max_tokens=8, messages=[{"role": "user", "content": task["q"]}]
        )
        return float(m.content[0].type == "text" and m.content[0].text == "42")

    async def go() -> None:
        workflow = OpenAIAgentWorkflow(agent)
        await workflow.start(policy)
        try:
            ctxs = [context(policy), context(policy)]
            episodes = [await workflow.run({"q": "6*7?"}, ctx) for ctx in ctxs]
            shared = workflow.anthropic_http
        finally:
            await workflow.close()
        assert [e.reward for e in episodes] == [1.0, 1.0]
        assert [len(c.trajectory().steps) for c in ctxs] == [1, 1]
        assert shared is not None and all(c._client is shared for c in clients)

    asyncio.run(go())
