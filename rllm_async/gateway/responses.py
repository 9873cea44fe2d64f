"""The Responses API on the chat path: the handler, input items as chat messages, a chat turn as
a `Response` (built with the `openai` package's models), and the SSE events of a finished one."""

from __future__ import annotations

import secrets
import time
from typing import Any

from openai.types.responses import (
    FunctionTool,
    Response,
    ResponseCompletedEvent,
    ResponseContentPartAddedEvent,
    ResponseContentPartDoneEvent,
    ResponseCreatedEvent,
    ResponseFunctionCallArgumentsDeltaEvent,
    ResponseFunctionCallArgumentsDoneEvent,
    ResponseFunctionToolCall,
    ResponseIncompleteEvent,
    ResponseInProgressEvent,
    ResponseOutputItemAddedEvent,
    ResponseOutputItemDoneEvent,
    ResponseOutputMessage,
    ResponseOutputText,
    ResponseReasoningItem,
    ResponseReasoningTextDeltaEvent,
    ResponseReasoningTextDoneEvent,
    ResponseStreamEvent,
    ResponseTextDeltaEvent,
    ResponseTextDoneEvent,
    ResponseUsage,
    Tool,
)
from openai.types.responses.response import IncompleteDetails
from openai.types.responses.response_reasoning_item import Content as ReasoningText
from openai.types.responses.response_usage import InputTokensDetails, OutputTokensDetails
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.responses import Response as HTTPResponse

from rllm_async.gateway.api import API, name_reply, note_forced
from rllm_async.gateway.chat_completions import check_format
from rllm_async.gateway.conversation import ChatMessages, reply_calls
from rllm_async.gateway.protocol_responses import (
    FunctionCallItem,
    FunctionCallOutputItem,
    FunctionToolChoice,
    InputMessage,
    ReasoningItem,
    ResponseRequest,
)
from rllm_async.gateway.sse import typed_stream
from rllm_async.rollout import ChatTurn


async def responses(api: API, request: Request) -> HTTPResponse:
    """`POST /v1/responses`: one `chat_turn`, recorded as a chat completion is."""
    session = api.session(request)
    req = await api.body(request, ResponseRequest)
    api.check_model(req.model)
    sampling = api.temperature_top_p(req, session)
    if req.max_output_tokens is not None:
        sampling["max_tokens"] = req.max_output_tokens
    turn = await api.chat_turn(
        request,
        session,
        chat_messages(req),
        tools=req.tool_schemas,
        forced=req.forced_tool,
        template_kwargs=req.template_kwargs,
        sampling=sampling,
        prompt_param="input",
        parallel=req.parallel_tool_calls is not False,
        response_format=req.response_format,
        format_param="text.format",
    )
    headers = check_format(req.response_format, [turn]) | note_forced(req.forced_tool, [turn])
    base = api.context(session).sampling
    body = response_object(
        req,
        turn,
        model=api.gw.model,
        temperature=sampling.get("temperature", base.temperature),
        top_p=sampling.get("top_p", base.top_p),
    )
    name_reply(body.id, [turn.step])
    if req.stream:
        return typed_stream(stream_events(body), headers)
    return JSONResponse(body.model_dump(mode="json", exclude_unset=True), headers=headers)


def chat_messages(req: ResponseRequest) -> list[dict[str, Any]]:
    """`instructions` and `input` as chat messages: a reply's message and the `function_call`
    items after it are one assistant turn; a `function_call_output` is a tool message; a
    `reasoning` item is the next assistant message's `reasoning_content`."""
    chat = ChatMessages(req.instructions)
    items = (
        [InputMessage(role="user", content=req.input)] if isinstance(req.input, str) else req.input
    )
    for item in items:
        if isinstance(item, InputMessage):
            chat.say(item.role, item.text)
        elif isinstance(item, FunctionCallItem):
            chat.call(item.call_id, item.name, item.arguments)
        elif isinstance(item, FunctionCallOutputItem):
            chat.result(item.call_id, item.text)
        elif isinstance(item, ReasoningItem) and item.text:
            chat.reason(item.text)
    return chat.messages


def response_object(
    req: ResponseRequest, turn: ChatTurn, *, model: str, temperature: float, top_p: float
) -> Response:
    """The chat turn as a completed `Response` (`incomplete` when it hit `max_output_tokens`):
    its reasoning, its text and its function calls, each an output item."""
    message = turn.message
    output: list[Any] = []
    if message.get("reasoning_content"):
        thought = ReasoningText(type="reasoning_text", text=message["reasoning_content"])
        output.append(
            ResponseReasoningItem(
                id=f"rs_{secrets.token_hex(12)}",
                type="reasoning",
                summary=[],
                content=[thought],
                status="completed",
            )
        )
    if message.get("content"):
        text = ResponseOutputText(type="output_text", text=message["content"], annotations=[])
        output.append(
            ResponseOutputMessage(
                id=f"msg_{secrets.token_hex(12)}",
                type="message",
                role="assistant",
                status="completed",
                content=[text],
            )
        )
    for call in reply_calls(turn, req.parallel_tool_calls is not False):
        output.append(
            ResponseFunctionToolCall(
                id=f"fc_{secrets.token_hex(12)}",
                type="function_call",
                call_id=call["id"],
                name=call["function"]["name"],
                arguments=call["function"]["arguments"],
                status="completed",
            )
        )
    step = turn.step
    incomplete = turn.finish_reason == "length"
    tools: list[Tool] = [
        FunctionTool(
            type="function",
            name=t.name,
            description=t.description,
            parameters=t.parameters,
            strict=t.strict,
        )
        for t in req.tools or ()
    ]
    tool_choice: Any = req.tool_choice or "auto"
    if isinstance(tool_choice, FunctionToolChoice):
        tool_choice = tool_choice.model_dump()
    return Response(
        id=f"resp_{secrets.token_hex(12)}",
        object="response",
        created_at=int(time.time()),
        model=model,
        status="incomplete" if incomplete else "completed",
        incomplete_details=IncompleteDetails(reason="max_output_tokens") if incomplete else None,
        error=None,
        instructions=req.instructions,
        metadata=req.metadata or {},
        output=output,
        parallel_tool_calls=req.parallel_tool_calls is not False,
        tool_choice=tool_choice,
        tools=tools,
        temperature=temperature,
        top_p=top_p,
        max_output_tokens=req.max_output_tokens,
        usage=ResponseUsage(
            input_tokens=len(step.prompt_ids),
            input_tokens_details=InputTokensDetails(cached_tokens=0, cache_write_tokens=0),
            output_tokens=len(step.completion_ids),
            output_tokens_details=OutputTokensDetails(reasoning_tokens=0),
            total_tokens=len(step.prompt_ids) + len(step.completion_ids),
        ),
    )


def stream_events(response: Response) -> list[ResponseStreamEvent]:
    """A finished response as the Responses API streams one: created, in progress, each output
    item (added, its reasoning, text or arguments as one delta, done), then completed or
    incomplete."""
    pending = response.model_copy(update={"status": "in_progress", "output": [], "usage": None})
    events: list[Any] = [
        ResponseCreatedEvent(type="response.created", response=pending, sequence_number=0),
        ResponseInProgressEvent(type="response.in_progress", response=pending, sequence_number=0),
    ]
    for index, item in enumerate(response.output):
        if isinstance(item, ResponseOutputMessage):
            events += _message_events(index, item)
        elif isinstance(item, ResponseReasoningItem):
            events += _reasoning_events(index, item)
        else:
            assert isinstance(item, ResponseFunctionToolCall)
            events += _call_events(index, item)
    if response.status == "incomplete":
        events.append(
            ResponseIncompleteEvent(
                type="response.incomplete", response=response, sequence_number=0
            )
        )
    else:
        events.append(
            ResponseCompletedEvent(type="response.completed", response=response, sequence_number=0)
        )
    for n, event in enumerate(events):
        event.sequence_number = n
    return events


def _item_events(index: int, item: Any, opening: dict[str, Any], inner: list[Any]) -> list[Any]:
    """An output item's events: added (in progress, with `opening`'s fields emptied), `inner`,
    done."""
    started = item.model_copy(update={"status": "in_progress", **opening})
    return [
        ResponseOutputItemAddedEvent(
            type="response.output_item.added", item=started, output_index=index, sequence_number=0
        ),
        *inner,
        ResponseOutputItemDoneEvent(
            type="response.output_item.done", item=item, output_index=index, sequence_number=0
        ),
    ]


def _message_events(index: int, item: ResponseOutputMessage) -> list[Any]:
    [part] = item.content
    assert isinstance(part, ResponseOutputText)
    empty = part.model_copy(update={"text": ""})
    at: dict[str, Any] = {"item_id": item.id, "output_index": index, "sequence_number": 0}
    inner = [
        ResponseContentPartAddedEvent(
            type="response.content_part.added", content_index=0, part=empty, **at
        ),
        ResponseTextDeltaEvent(
            type="response.output_text.delta", content_index=0, delta=part.text, logprobs=[], **at
        ),
        ResponseTextDoneEvent(
            type="response.output_text.done", content_index=0, text=part.text, logprobs=[], **at
        ),
        ResponseContentPartDoneEvent(
            type="response.content_part.done", content_index=0, part=part, **at
        ),
    ]
    return _item_events(index, item, {"content": []}, inner)


def _reasoning_events(index: int, item: ResponseReasoningItem) -> list[Any]:
    [thought] = item.content or []
    at: dict[str, Any] = {"item_id": item.id, "output_index": index, "sequence_number": 0}
    inner = [
        ResponseReasoningTextDeltaEvent(
            type="response.reasoning_text.delta", content_index=0, delta=thought.text, **at
        ),
        ResponseReasoningTextDoneEvent(
            type="response.reasoning_text.done", content_index=0, text=thought.text, **at
        ),
    ]
    return _item_events(index, item, {"content": []}, inner)


def _call_events(index: int, item: ResponseFunctionToolCall) -> list[Any]:
    assert item.id is not None
    at: dict[str, Any] = {"item_id": item.id, "output_index": index, "sequence_number": 0}
    inner = [
        ResponseFunctionCallArgumentsDeltaEvent(
            type="response.function_call_arguments.delta", delta=item.arguments, **at
        ),
        ResponseFunctionCallArgumentsDoneEvent(
            type="response.function_call_arguments.done", arguments=item.arguments, **at
        ),
    ]
    return _item_events(index, item, {"arguments": ""}, inner)
