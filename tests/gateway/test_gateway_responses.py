"""`POST /v1/responses` through a real server on 127.0.0.1: the official `openai` client (plain,
a function-tool loop, streaming) and openai-agents' default Responses model; every call recorded
in a session as chat completions are, the tool loop as one token-in/token-out sequence."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import httpx
import openai
from openai.types.responses import (
    Response,
    ResponseFunctionToolCall,
    ResponseReasoningItem,
    ResponseStreamEvent,
)
from pydantic import TypeAdapter

from rllm_async.protocols import SamplingParams
from rllm_async.rollout import RolloutContext
from rllm_async.rollout.reply_parser import reply_parser
from tests.gateway.frameworks import FINAL, RESULT, Answer, calc_agent, reply
from tests.gateway.test_gateway import KEY, serving
from tests.scripted import ScriptedPolicy, context

CALC = {
    "type": "function",
    "name": "calc",
    "description": "evaluate a product",
    "parameters": {"type": "object", "properties": {"expr": {"type": "string"}}},
}
EVENTS: TypeAdapter[ResponseStreamEvent] = TypeAdapter(ResponseStreamEvent)


def test_plain_text_input_with_instructions() -> None:
    policy = ScriptedPolicy(lambda p: "fine, thanks")

    async def go() -> None:
        async with serving(policy) as gateway:
            session = gateway.session(context(policy))
            client = openai.AsyncOpenAI(base_url=f"{gateway.url}/v1", api_key=session.key)
            r = await client.responses.create(
                model="policy", input="how are you?", instructions="Be brief."
            )
            assert isinstance(r, Response) and r.status == "completed"
            assert r.output_text == "fine, thanks" and r.instructions == "Be brief."
            assert r.usage is not None and r.usage.output_tokens == len("fine, thanks") + 1
            [step] = session.ctx.trajectory().steps
            assert policy.text(step.prompt_ids) == (
                "<|system|>Be brief.<|end|><|user|>how are you?<|end|><|assistant|>"
            )
            assert r.usage.input_tokens == len(step.prompt_ids)
            assert step.messages == [
                {"role": "system", "content": "Be brief."},
                {"role": "user", "content": "how are you?"},
            ]

    asyncio.run(go())


def test_a_function_call_loop_extends_the_recorded_tokens() -> None:
    policy = ScriptedPolicy(reply)

    async def go() -> None:
        async with serving(policy) as gateway:
            session = gateway.session(context(policy))
            client = openai.AsyncOpenAI(base_url=gateway.session_url(session.id), api_key=KEY)
            items: list[Any] = [{"role": "user", "content": "6*7?"}]
            r = await client.responses.create(model="policy", input=items, tools=[CALC])
            [call] = r.output
            assert isinstance(call, ResponseFunctionToolCall)
            assert call.name == "calc" and json.loads(call.arguments) == {"expr": "6*7"}
            assert call.call_id.startswith("call_") and (call.id or "").startswith("fc_")
            items += [item.model_dump(exclude_none=True) for item in r.output]
            items.append(
                {"type": "function_call_output", "call_id": call.call_id, "output": RESULT}
            )
            r = await client.responses.create(model="policy", input=items, tools=[CALC])
            assert r.output_text == FINAL and r.status == "completed"
            first, second = session.ctx.trajectory().steps
            assert second.info["extended"]
            assert second.prompt_ids[: len(first.prompt_ids)] == first.prompt_ids
            assert f"<|tool|>{RESULT}<|end|>" in policy.text(second.prompt_ids)
            assert second.messages[-1] == {
                "role": "tool",
                "content": RESULT,
                "tool_call_id": call.call_id,
            }

    asyncio.run(go())


def test_streaming_sends_the_responses_event_sequence() -> None:
    policy = ScriptedPolicy(lambda p: 'ok <tool_call>{"name": "calc", "arguments": {}}</tool_call>')

    async def go() -> None:
        async with serving(policy) as gateway:
            client = openai.AsyncOpenAI(base_url=f"{gateway.url}/v1", api_key=KEY)
            stream = await client.responses.create(
                model="policy", input="go", tools=[CALC], stream=True
            )
            events = [e async for e in stream]
            assert [e.type for e in events] == [
                "response.created",
                "response.in_progress",
                "response.output_item.added",
                "response.content_part.added",
                "response.output_text.delta",
                "response.output_text.done",
                "response.content_part.done",
                "response.output_item.done",
                "response.output_item.added",
                "response.function_call_arguments.delta",
                "response.function_call_arguments.done",
                "response.output_item.done",
                "response.completed",
            ]
            assert [e.sequence_number for e in events] == list(range(len(events)))
            for event in events:  # each one validates as the type it names
                EVENTS.validate_python(event.model_dump())
            final = events[-1].response  # type: ignore[union-attr]
            assert final.output_text == "ok" and final.output[1].type == "function_call"
            async with client.responses.stream(model="policy", input="go", tools=[CALC]) as s:
                deltas = [e.delta async for e in s if e.type == "response.output_text.delta"]
                done = await s.get_final_response()
            assert deltas == ["ok"] and done.output_text == "ok"
            assert done.output[1].type == "function_call" and done.output[1].arguments == "{}"

    asyncio.run(go())


def test_max_output_tokens_makes_an_incomplete_response() -> None:
    policy = ScriptedPolicy(lambda p: "a long answer")

    async def go() -> None:
        async with serving(policy) as gateway:
            client = openai.AsyncOpenAI(base_url=f"{gateway.url}/v1", api_key=KEY)
            r = await client.responses.create(model="policy", input="q", max_output_tokens=3)
            assert r.status == "incomplete" and r.output_text == "a l"
            assert r.incomplete_details is not None
            assert r.incomplete_details.reason == "max_output_tokens"
            stream = await client.responses.create(
                model="policy", input="q", max_output_tokens=3, stream=True
            )
            assert [e.type async for e in stream][-1] == "response.incomplete"

    asyncio.run(go())


def test_reasoning_is_an_output_item_and_ignored_when_sent_back() -> None:
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
            client = openai.AsyncOpenAI(base_url=f"{gateway.url}/v1", api_key=session.key)
            items: list[Any] = [{"role": "user", "content": "6*7?"}]
            r = await client.responses.create(model="policy", input=items)
            thought, _ = r.output
            assert isinstance(thought, ResponseReasoningItem) and thought.content is not None
            assert thought.content[0].text == "6 times 7" and r.output_text == "42"
            items += [item.model_dump(exclude_none=True) for item in r.output]
            items.append({"role": "user", "content": "and 6*8?"})
            await client.responses.create(model="policy", input=items)
            assert session.ctx.trajectory().steps[1].info["extended"]
            stream = await client.responses.create(model="policy", input="q", stream=True)
            kinds = [e.type async for e in stream]
            assert kinds[2:6] == [
                "response.output_item.added",
                "response.reasoning_text.delta",
                "response.reasoning_text.done",
                "response.output_item.done",
            ]

    asyncio.run(go())


REFUSED: list[tuple[dict[str, Any], str]] = [
    ({"previous_response_id": "resp_1"}, "previous_response_id"),
    ({"conversation": "conv_1"}, "conversation"),
    ({"background": True}, "background"),
    ({"tools": [{"type": "web_search"}]}, "tools.0.type"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"include": ["reasoning.encrypted_content"]}, "include"),
    ({"input": [{"type": "item_reference", "id": "x"}]}, "input.0"),
    ({"input": [{"role": "user", "content": [{"type": "input_image"}]}]}, "input.0.content.0.type"),
    ({"prompt": {"id": "pmpt_1"}}, "prompt"),
    ({"context_management": [{"type": "compaction"}]}, "context_management"),
    ({"background_options": {"completion_window": "2h"}}, "background_options"),
    ({"truncation": "auto"}, "truncation"),
    ({"text": {"format": {"type": "json_schema"}}}, "text.format.name"),
    ({"temperature": 0.5}, "temperature"),  # the session's temperature is the trainer's
]


def test_unsupported_fields_are_refused_with_their_param() -> None:
    policy = ScriptedPolicy(lambda p: "x")

    async def go() -> None:
        async with serving(policy) as gateway:
            ctx = context(policy, temperature=1.0)
            session = gateway.session(ctx)
            url = f"{gateway.url}/v1/responses"
            headers = {"Authorization": f"Bearer {KEY}", "X-Session-Id": session.id}
            async with httpx.AsyncClient(headers=headers, timeout=30) as http:
                for extra, param in REFUSED:
                    r = await http.post(url, json={"model": "policy", "input": "q", **extra})
                    assert r.status_code == 400, (extra, r.text)
                    error = r.json()["error"]
                    assert error["param"] == param and error["type"] == "invalid_request_error"
                ignored = {"store": False, "max_tool_calls": 3, "image": {}, "access_programs": {}}
                r = await http.post(url, json={"model": "policy", "input": "q", **ignored})
                assert r.status_code == 200 and Response.model_validate(r.json())
            assert len(session.ctx.trajectory().steps) == 1  # recorded by the header's session

    asyncio.run(go())


def test_openai_agents_default_responses_model_runs_a_tool_loop() -> None:
    import agents

    policy = ScriptedPolicy(reply)

    async def go() -> tuple[Any, list[Any]]:
        async with serving(policy, constraints="check") as gateway:
            session = gateway.session(context(policy))
            client = openai.AsyncOpenAI(base_url=f"{gateway.url}/v1", api_key=session.key)
            model = agents.OpenAIResponsesModel(model="policy", openai_client=client)
            bot = calc_agent(model)
            result = await agents.Runner.run(bot, "6*7?", max_turns=4)
            streamed = agents.Runner.run_streamed(bot, "6*7?", max_turns=4)
            async for _ in streamed.stream_events():
                pass
            assert streamed.final_output == Answer(answer=42)
            return result.final_output, session.ctx.trajectory().steps

    result, steps = asyncio.run(go())
    assert result == Answer(answer=42)
    assert len(steps) == 4 and steps[1].info["extended"] and steps[3].info["extended"]
    assert steps[1].info["response_format"] == {
        "type": "json_schema",
        "error": None,
        "enforced": False,
    }
