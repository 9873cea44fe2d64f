"""The Anthropic Messages API on the chat path: the handler, messages and content blocks as chat
messages, a chat turn as a `Message` (built with the `anthropic` package's types), and the SSE
events of a finished one."""

from __future__ import annotations

import json
import secrets
from typing import Any, Literal

from anthropic.types import (
    InputJSONDelta,
    Message,
    MessageDeltaUsage,
    RawContentBlockDeltaEvent,
    RawContentBlockStartEvent,
    RawContentBlockStopEvent,
    RawMessageDeltaEvent,
    RawMessageStartEvent,
    RawMessageStopEvent,
    TextBlock,
    TextDelta,
    ThinkingBlock,
    ThinkingDelta,
    ToolUseBlock,
    Usage,
)
from anthropic.types.raw_message_delta_event import Delta
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from rllm_async.gateway.api import API, forced_prefix, name_reply, note_forced
from rllm_async.gateway.conversation import ChatMessages, reply_calls
from rllm_async.gateway.errors import APIError
from rllm_async.gateway.protocol_anthropic import (
    CountTokensRequest,
    MessagesPrompt,
    MessagesRequest,
    TextBlockParam,
    ThinkingBlockParam,
    ToolResultBlockParam,
    ToolUseBlockParam,
)
from rllm_async.gateway.sse import typed_stream
from rllm_async.rollout import ChatTurn
from rllm_async.rollout.chat import render, template_messages


async def messages(api: API, request: Request) -> Response:
    """`POST /v1/messages`: one `chat_turn`, recorded as a chat completion is."""
    session = api.session(request)
    req = await api.body(request, MessagesRequest)
    api.check_model(req.model)
    sampling = api.temperature_top_p(req, session)
    sampling["max_tokens"] = req.max_tokens
    if req.stop_sequences:
        sampling["stop"] = tuple(req.stop_sequences)
    turn = await api.chat_turn(
        request,
        session,
        chat_messages(req),
        tools=req.tool_schemas,
        forced=req.forced_tool,
        template_kwargs={},
        sampling=sampling,
        prompt_param="messages",
        parallel=req.parallel_tool_use,
    )
    headers = note_forced(req.forced_tool, [turn])
    body = message_object(req, turn, model=api.gw.model, tok=api.gw.policy.tokenizer)
    name_reply(body.id, [turn.step])
    if req.stream:
        return typed_stream(stream_events(body), headers)
    return JSONResponse(body.model_dump(mode="json", exclude_unset=True), headers=headers)


async def count_tokens(api: API, request: Request) -> Response:
    """`POST /v1/messages/count_tokens`: the tokens of the prompt a `messages` call would render
    (the chat template's, a forced call's opening included); nothing is sampled or recorded."""
    session = api.session(request)
    req = await api.body(request, CountTokensRequest)
    api.check_model(req.model)
    tok = api.gw.policy.tokenizer
    try:
        ids = render(tok, template_messages(chat_messages(req)), req.tool_schemas)
    except Exception as e:  # templates raise anything, jinja2 errors included
        raise APIError(
            400,
            f"messages: the chat template refused the messages: {e}",
            param="messages",
            code="invalid_messages",
        ) from None
    prefix = forced_prefix(api.context(session), req.forced_tool)
    return JSONResponse({"input_tokens": len(ids) + len(tok.encode(prefix))})


def chat_messages(req: MessagesPrompt) -> list[dict[str, Any]]:
    """`system` and `messages` as chat messages: an assistant message's text, then its `tool_use`
    blocks as tool calls (one assistant turn, as the chat path recorded the reply); a user
    message's `tool_result` blocks as tool messages, then its text as a user message; an assistant
    message's `thinking` blocks as its `reasoning_content`."""
    chat = ChatMessages(req.system_text)
    for message in req.messages:
        blocks = message.content
        if isinstance(blocks, str):
            chat.say(message.role, blocks)
            continue
        text = "".join(b.text for b in blocks if isinstance(b, TextBlockParam))
        results = [b for b in blocks if isinstance(b, ToolResultBlockParam)]
        if message.role == "assistant":
            thinking = "".join(b.thinking for b in blocks if isinstance(b, ThinkingBlockParam))
            if thinking:
                chat.reason(thinking)
            chat.say("assistant", text)
        for block in blocks:
            if isinstance(block, ToolUseBlockParam):
                chat.call(block.id, block.name, json.dumps(block.input))
        for result in results:
            chat.result(result.tool_use_id, result.text)
        if message.role == "user" and (text or not results):
            chat.say("user", text)
    return chat.messages


def message_object(req: MessagesRequest, turn: ChatTurn, *, model: str, tok: Any) -> Message:
    """The chat turn as a `Message`: a `thinking` block when the policy's reply parser found
    reasoning, a `text` block when the reply has text, then one `tool_use` block per call."""
    reply = turn.message
    content: list[Any] = []
    if reply.get("reasoning_content"):
        content.append(
            ThinkingBlock(type="thinking", thinking=reply["reasoning_content"], signature="")
        )
    if reply.get("content"):
        content.append(TextBlock(type="text", text=reply["content"]))
    calls = reply_calls(turn, req.parallel_tool_use)
    for call in calls:
        function = call["function"]
        content.append(
            ToolUseBlock(
                type="tool_use",
                id=call["id"],
                name=function["name"],
                input=json.loads(function["arguments"]),
            )
        )
    step = turn.step
    stop = _stop_sequence(tok.decode(step.completion_ids), req.stop_sequences or ())
    reason: Literal["tool_use", "max_tokens", "end_turn", "stop_sequence"]
    if calls:
        reason = "tool_use"
    elif turn.finish_reason == "length":
        reason = "max_tokens"
    else:
        reason = "end_turn" if stop is None else "stop_sequence"
    return Message(
        id=f"msg_{secrets.token_hex(12)}",
        type="message",
        role="assistant",
        model=model,
        content=content,
        stop_reason=reason,
        stop_sequence=stop if reason == "stop_sequence" else None,
        usage=Usage(input_tokens=len(step.prompt_ids), output_tokens=len(step.completion_ids)),
    )


def _stop_sequence(text: str, stops: tuple[str, ...] | list[str]) -> str | None:
    """The stop sequence that ended `text` (the first in it), if any."""
    found = [(i, s) for s in stops if (i := text.find(s)) >= 0]
    return min(found)[1] if found else None


def stream_events(message: Message) -> list[Any]:
    """A finished message as the Messages API streams one: `message_start`, per content block
    `content_block_start`, one delta (`thinking_delta`, `text_delta` or `input_json_delta`) and
    `content_block_stop`, then `message_delta` (the stop reason) and `message_stop`."""
    usage = message.usage
    start = message.model_copy(
        update={
            "content": [],
            "stop_reason": None,
            "stop_sequence": None,
            "usage": Usage(input_tokens=usage.input_tokens, output_tokens=0),
        }
    )
    events: list[Any] = [RawMessageStartEvent(type="message_start", message=start)]
    for index, block in enumerate(message.content):
        if isinstance(block, ThinkingBlock):
            empty: Any = block.model_copy(update={"thinking": ""})
            delta: Any = ThinkingDelta(type="thinking_delta", thinking=block.thinking)
        elif isinstance(block, TextBlock):
            empty = block.model_copy(update={"text": ""})
            delta = TextDelta(type="text_delta", text=block.text)
        else:
            assert isinstance(block, ToolUseBlock)
            empty = block.model_copy(update={"input": {}})
            delta = InputJSONDelta(type="input_json_delta", partial_json=json.dumps(block.input))
        events += [
            RawContentBlockStartEvent(type="content_block_start", index=index, content_block=empty),
            RawContentBlockDeltaEvent(type="content_block_delta", index=index, delta=delta),
            RawContentBlockStopEvent(type="content_block_stop", index=index),
        ]
    events += [
        RawMessageDeltaEvent(
            type="message_delta",
            delta=Delta(stop_reason=message.stop_reason, stop_sequence=message.stop_sequence),
            usage=MessageDeltaUsage(output_tokens=usage.output_tokens),
        ),
        RawMessageStopEvent(type="message_stop"),
    ]
    return events
