"""`POST /v1/chat/completions`: the handler, its response body and its streamed chunks."""

from __future__ import annotations

import secrets
import time
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from rllm_async.gateway.api import API, forced_prefix, name_reply, note_forced
from rllm_async.gateway.conversation import keep_first_call, reply_calls
from rllm_async.gateway.protocol import ChatCompletionRequest, ResponseFormat
from rllm_async.gateway.sse import data_stream
from rllm_async.gateway.structured import constraint, format_error
from rllm_async.rollout import ChatTurn


async def chat_completions(api: API, request: Request) -> Response:
    """`POST /v1/chat/completions`: one `chat_turn` per choice, recorded in the session."""
    session = api.session(request)
    req = await api.body(request, ChatCompletionRequest)
    api.check_model(req.model)
    ctx = api.context(session)
    messages = [m.to_chat() for m in req.messages]
    tools = req.tool_schemas
    prefix = forced_prefix(ctx, req.forced_tool)
    kwargs = req.template_kwargs or None
    rule = api.constraint(ctx, req.forced_tool, tools, req.response_format)
    overrides = [{**api.sampling(req, session, i), **rule} for i in range(req.n)]
    turns = await api.run(
        request,
        session,
        lambda: [
            ctx.chat_turn(messages, tools=tools, prefix=prefix, template_kwargs=kwargs, **o)
            for o in overrides
        ],
    )
    if req.parallel_tool_calls is False:
        for turn, o in zip(turns, overrides, strict=True):
            stop = o.get("stop", ctx.sampling.stop)
            keep_first_call(
                ctx, turn, messages, tools=tools, prefix=prefix, template_kwargs=kwargs, stop=stop
            )
    headers = check_format(req.response_format, turns) | note_forced(req.forced_tool, turns)
    body = _body(req, turns, api.gw.model, api.gw.policy.tokenizer)
    name_reply(body["id"], [t.step for t in turns])
    if req.stream:
        return data_stream(_chunks(req, body), headers)
    return JSONResponse(body, headers=headers)


def _body(
    req: ChatCompletionRequest, turns: list[ChatTurn], model: str, tok: Any
) -> dict[str, Any]:
    choices = []
    for i, turn in enumerate(turns):
        message = dict(turn.message)
        if message.get("tool_calls"):
            message["tool_calls"] = reply_calls(turn, req.parallel_tool_calls is not False)
        if message.get("tool_calls") and not message["content"]:
            message["content"] = None
        choice: dict[str, Any] = {
            "index": i,
            "message": message,
            "logprobs": None,
            "finish_reason": turn.finish_reason,
        }
        if req.logprobs:
            choice["logprobs"] = {
                "content": _token_logprobs(tok, turn.step.completion_ids, turn.step.logprobs)
            }
        choices.append(choice)
    prompt_tokens = len(turns[0].step.prompt_ids)
    completion_tokens = sum(len(t.step.completion_ids) for t in turns)
    versions = [v for t in turns for v in t.step.versions]
    return {
        "id": f"chatcmpl-{secrets.token_hex(12)}",
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "system_fingerprint": f"policy-v{min(versions)}" if versions else None,
        "choices": choices,
        "usage": usage(prompt_tokens, completion_tokens),
    }


def _chunks(req: ChatCompletionRequest, body: dict[str, Any]) -> list[dict[str, Any]]:
    """The finished completion as `chat.completion.chunk`s: role, content, tool calls, finish."""
    head = {k: body[k] for k in ("id", "created", "model", "system_fingerprint")}
    head["object"] = "chat.completion.chunk"

    def chunk(
        index: int, delta: dict[str, Any], finish: str | None = None, logprobs: Any = None
    ) -> dict[str, Any]:
        return {
            **head,
            "choices": [
                {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
            ],
        }

    chunks = []
    for choice in body["choices"]:
        i, message = choice["index"], choice["message"]
        chunks.append(chunk(i, {"role": "assistant", "content": ""}))
        if message.get("reasoning_content"):
            chunks.append(chunk(i, {"reasoning_content": message["reasoning_content"]}))
        if message["content"] or choice["logprobs"]:
            chunks.append(
                chunk(i, {"content": message["content"] or ""}, logprobs=choice["logprobs"])
            )
        for k, call in enumerate(message.get("tool_calls") or ()):
            chunks.append(chunk(i, {"tool_calls": [{"index": k, **call}]}))
        chunks.append(chunk(i, {}, choice["finish_reason"]))
    if req.stream_options is not None and req.stream_options.include_usage:
        chunks.append({**head, "choices": [], "usage": body["usage"]})
    return chunks


def check_format(fmt: ResponseFormat | None, turns: list[ChatTurn]) -> dict[str, str]:
    """Check each reply against `response_format` (also enforced while sampling, unless the
    gateway only checks): the verdict goes into the recorded step's info and the headers,
    `X-Response-Format` (`valid` or `invalid`) and `X-Response-Format-Enforcement` (`enforced` or
    `checked`), one per choice."""
    if fmt is None or fmt.type == "text":
        return {}
    verdicts, enforcement = [], []
    for turn in turns:
        error = format_error(fmt, turn.message.get("content"))
        enforced = turn.step.info.get("structured") == constraint(fmt)
        turn.step.info["response_format"] = {"type": fmt.type, "error": error, "enforced": enforced}
        verdicts.append("valid" if error is None else "invalid")
        enforcement.append("enforced" if enforced else "checked")
    return {
        "X-Response-Format": ",".join(verdicts),
        "X-Response-Format-Enforcement": ",".join(enforcement),
    }


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def _token_logprobs(tok: Any, ids: list[int], logprobs: list[float]) -> list[dict[str, Any]]:
    """One entry per sampled token, the end-of-turn token included (only the sampled one: no top)."""
    out = []
    for token_id, logprob in zip(ids, logprobs, strict=True):
        text = tok.decode([token_id])
        out.append(
            {"token": text, "logprob": logprob, "bytes": list(text.encode()), "top_logprobs": []}
        )
    return out
