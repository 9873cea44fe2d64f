"""Reasoning through the gateway: `reasoning_content` beside the content, streamed as a delta, and
the reasoning tokens recorded for training."""

from __future__ import annotations

import asyncio
from typing import Any

import anthropic
import openai
import pytest

from rllm_async.rollout.reply_parser import reply_parser
from tests.gateway.test_gateway import CALC, KEY, serving
from tests.scripted import ScriptedPolicy

REPLY = '<think>6*7 needs the tool</think><tool_call>{"name": "calc", "arguments": {}}</tool_call>'


def test_reasoning_comes_back_as_reasoning_content_and_stays_in_the_tokens() -> None:
    policy = ScriptedPolicy(lambda prompt: REPLY)
    messages = [{"role": "user", "content": "6*7?"}]

    async def go() -> None:
        parser = reply_parser(policy.tok, "hermes", "think")
        async with serving(policy, parser=parser) as gateway:
            client = openai.AsyncOpenAI(base_url=f"{gateway.url}/v1", api_key=KEY)
            reply = await client.chat.completions.create(
                model="policy", messages=messages, tools=[CALC]
            )
            message = reply.choices[0].message
            assert message.model_extra == {"reasoning_content": "6*7 needs the tool"}
            assert message.content is None and message.tool_calls
            stream = await client.chat.completions.create(
                model="policy", messages=messages, tools=[CALC], stream=True
            )
            deltas = [c.choices[0].delta async for c in stream if c.choices]
            thoughts = [d.model_extra.get("reasoning_content") for d in deltas if d.model_extra]
            assert "6*7 needs the tool" in thoughts

    asyncio.run(go())
    _, completion = policy.calls[0]
    assert policy.text(completion).startswith("<think>6*7 needs the tool</think>")


@pytest.mark.parametrize("api", ["chat", "responses", "anthropic"])
def test_reasoning_sent_back_reaches_the_chat_template(api: str) -> None:
    """A Qwen3-like template renders the reasoning of an assistant message after the last user
    turn: sent back as chat's `reasoning_content`, a Responses `reasoning` item or an Anthropic
    `thinking` block, the prompt the policy gets holds it, as a direct rendering of the chat does."""
    from rllm_async.rollout.chat import render, template_messages
    from tests.rollout.test_tool_call_families import (
        FAMILIES,
        IDS,
        FamilyPolicy,
        family_tokenizer,
    )

    tok = family_tokenizer(FAMILIES[IDS.index("qwen3_think")])
    policy = FamilyPolicy(tok, ["<think>\nDone.\n</think>\n\nIt is 42."], ())
    call = {"id": "call_1", "type": "function", "function": {"name": "calc", "arguments": "{}"}}
    thought = {"role": "assistant", "content": "", "tool_calls": [call]}
    thought["reasoning_content"] = "6*7 needs the tool"
    chat = [
        {"role": "user", "content": "6*7?"},
        thought,
        {"role": "tool", "tool_call_id": "call_1", "content": "42"},
    ]

    async def go() -> str:
        async with serving(policy) as gateway:
            if api == "chat":
                client = openai.AsyncOpenAI(base_url=f"{gateway.url}/v1", api_key=KEY)
                reply = await client.chat.completions.create(model="policy", messages=chat)
                return reply.choices[0].message.content or ""
            if api == "responses":
                client = openai.AsyncOpenAI(base_url=f"{gateway.url}/v1", api_key=KEY)
                items: list[Any] = [
                    {"type": "message", "role": "user", "content": "6*7?"},
                    {
                        "type": "reasoning",
                        "id": "rs_1",
                        "summary": [],
                        "content": [{"type": "reasoning_text", "text": "6*7 needs the tool"}],
                    },
                    {
                        "type": "function_call",
                        "call_id": "call_1",
                        "name": "calc",
                        "arguments": "{}",
                    },
                    {"type": "function_call_output", "call_id": "call_1", "output": "42"},
                ]
                response = await client.responses.create(model="policy", input=items)
                return response.output_text
            client_a = anthropic.AsyncAnthropic(base_url=gateway.url, api_key=KEY)
            thinking = {"type": "thinking", "thinking": "6*7 needs the tool", "signature": ""}
            use = {"type": "tool_use", "id": "call_1", "name": "calc", "input": {}}
            result = {"type": "tool_result", "tool_use_id": "call_1", "content": "42"}
            message = await client_a.messages.create(
                model="policy",
                max_tokens=64,
                messages=[
                    {"role": "user", "content": "6*7?"},
                    {"role": "assistant", "content": [thinking, use]},
                    {"role": "user", "content": [result]},
                ],
            )
            return "".join(b.text for b in message.content if b.type == "text")

    assert asyncio.run(go()) == "It is 42."
    [(prompt, _)] = policy.calls
    assert prompt == render(tok, template_messages(chat), None)
    assert "<think>\n6*7 needs the tool\n</think>" in tok.decode(prompt)
