"""The gateway's HTTP API (Starlette): OpenAI-compatible endpoints, plain and session-scoped."""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import secrets
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, Protocol, TypeVar

from pydantic import BaseModel, ValidationError
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from rllm_async.backends.base import Completion, PolicyClient
from rllm_async.gateway.errors import APIError, error_response, invalid
from rllm_async.gateway.openapi import openapi_document
from rllm_async.gateway.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    OpenSessionRequest,
    ResponseFormat,
    ResponseRequest,
    SamplingFields,
)
from rllm_async.gateway.responses import chat_messages, response_object, stream_events
from rllm_async.gateway.sessions import Session, SessionStore
from rllm_async.gateway.structured import format_error
from rllm_async.rollout import ChatTemplateError, ChatTurn, ContextLengthError, RolloutContext
from rllm_async.rollout.chat import cut_at_stop

log = logging.getLogger("rllm_async.gateway")
SESSION_HEADER = "x-session-id"
M = TypeVar("M", bound=BaseModel)
T = TypeVar("T")
Handler = Callable[[Request], Awaitable[Response]]


class GatewayState(Protocol):
    """What the handlers read of the gateway they serve (`rllm_async.gateway.server.Gateway`)."""

    policy: PolicyClient
    model: str
    api_key: str | None
    open_sessions: bool
    max_body_bytes: int
    created: int
    sessions: SessionStore

    def open_session(self, ttl_s: float | None = None) -> Session: ...

    def scratch_context(self) -> RolloutContext: ...

    def session_url(self, session_id: str, request: Request | None = None) -> str: ...


def build_app(gateway: GatewayState) -> Starlette:
    """The ASGI app of `gateway`; every route answers JSON, errors included."""
    api = _API(gateway)
    v1 = [
        ("/v1/models", api.models, ["GET"]),
        ("/v1/chat/completions", api.chat, ["POST"]),
        ("/v1/completions", api.completions, ["POST"]),
        ("/v1/responses", api.responses, ["POST"]),
    ]
    routes = [
        Route("/health", api.endpoint(api.health, auth=False), methods=["GET"]),
        Route("/openapi.json", api.endpoint(api.openapi, auth=False), methods=["GET"]),
        Route("/sessions", api.endpoint(api.open_session), methods=["POST"]),
        Route("/sessions/{sid}", api.endpoint(api.get_session), methods=["GET"]),
        Route("/sessions/{sid}", api.endpoint(api.delete_session), methods=["DELETE"]),
        *(Route(path, api.endpoint(fn), methods=m) for path, fn, m in v1),
        *(Route("/sessions/{sid}" + path, api.endpoint(fn), methods=m) for path, fn, m in v1),
    ]
    return Starlette(
        routes=routes,
        exception_handlers={HTTPException: _http_error, Exception: _server_error},
    )


async def _http_error(request: Request, exc: Exception) -> Response:
    status = exc.status_code if isinstance(exc, HTTPException) else 500
    what = "no such route" if status == 404 else "method not allowed" if status == 405 else "error"
    return error_response(status, f"{what}: {request.method} {request.url.path}")


async def _server_error(request: Request, exc: Exception) -> Response:
    log.exception("gateway: unexpected error on %s %s", request.method, request.url.path)
    return error_response(500, "internal error: see the gateway's log", code="internal_error")


class _API:
    """The handlers; each one either answers or raises `APIError`."""

    def __init__(self, gateway: GatewayState) -> None:
        self.gw = gateway

    def endpoint(self, fn: Handler, *, auth: bool = True) -> Handler:
        async def run(request: Request) -> Response:
            try:
                request.state.keyed = self._authorize(request) if auth else None
                return await fn(request)
            except APIError as e:
                return e.response()
            except Exception:
                # A request never takes the server (or a trainer in the same process) down.
                log.exception("gateway: unexpected error on %s %s", request.method, request.url)
                return error_response(500, "internal error: see the gateway's log")

        return run

    def _authorize(self, request: Request) -> Session | None:
        """Check the API key: the gateway's, or a session's (which names that session)."""
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        bearer = token.strip() if scheme.lower() == "bearer" else ""
        keyed = self.gw.sessions.by_key(bearer) if bearer else None
        key = self.gw.api_key
        if (
            keyed is None
            and key is not None
            and not hmac.compare_digest(bearer.encode(), key.encode())
        ):
            raise APIError(
                401, "missing or wrong API key (Authorization: Bearer KEY)", code="invalid_api_key"
            )
        return keyed

    # -- reading requests -----------------------------------------------------------------------

    async def _body(self, request: Request, model: type[M]) -> M:
        limit = self.gw.max_body_bytes
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise APIError(413, f"request body over {limit} bytes", code="body_too_large")
            chunks.append(chunk)
        try:
            data = json.loads(b"".join(chunks) or b"{}")
        except (ValueError, RecursionError):
            raise APIError(400, "the body is not valid JSON", code="invalid_json") from None
        if not isinstance(data, dict):
            raise APIError(400, "the body must be a JSON object", code="invalid_json")
        try:
            return model.model_validate(data)
        except ValidationError as e:
            raise invalid(e) from None
        except RecursionError:
            raise APIError(400, "the body is nested too deeply", code="invalid_json") from None

    def _session(self, request: Request) -> Session | None:
        """The session a call records into: named by the path, the `X-Session-Id` header or the
        API key (one of them, or several that agree), else none."""
        keyed: Session | None = request.state.keyed
        sid = request.path_params.get("sid") or request.headers.get(SESSION_HEADER)
        if sid is None:
            return keyed
        session = self.gw.sessions.get(sid)
        if keyed is not None and keyed is not session:
            raise APIError(
                403, "the API key belongs to another session", code="session_key_mismatch"
            )
        return session

    def _check_model(self, name: str) -> None:
        if name != self.gw.model:
            raise APIError(
                404,
                f"the model {name!r} does not exist here; this gateway serves {self.gw.model!r}",
                param="model",
                code="model_not_found",
            )

    def _sampling(self, req: SamplingFields, session: Session | None, index: int) -> dict[str, Any]:
        """Sampling overrides for one choice; a locked session keeps its temperature and top_p."""
        out = self._temperature_top_p(req, session)
        if (limit := getattr(req, "token_limit", None)) is not None:
            out["max_tokens"] = limit
        if req.stop is not None:
            out["stop"] = req.stops
        if req.seed is not None:
            out["seed"] = (req.seed + index) % (2**63)
        return out

    def _temperature_top_p(
        self, req: SamplingFields | ResponseRequest, session: Session | None
    ) -> dict[str, Any]:
        """The request's temperature and top_p; a locked session refuses values other than its own."""
        out: dict[str, Any] = {}
        if session is not None and session.locked:
            base = session.ctx.sampling
            for name in ("temperature", "top_p"):
                value = getattr(req, name)
                if value is not None and value != getattr(base, name):
                    raise APIError(
                        400,
                        f"{name}={value}: this session samples with {name}={getattr(base, name)}, "
                        "which the trainer's loss assumes; leave it unset",
                        param=name,
                        code="invalid_parameter",
                    )
        else:
            out.update(
                {k: v for k in ("temperature", "top_p") if (v := getattr(req, k)) is not None}
            )
        return out

    async def _run(
        self,
        session: Session | None,
        make: Callable[[], list[Awaitable[T]]],
        prompt_param: str = "messages",
    ) -> list[T]:
        """Run one request's model calls; map what can go wrong to the client's errors."""

        async def run_all() -> list[T]:
            tasks = [asyncio.ensure_future(c) for c in make()]
            try:
                return list(await asyncio.gather(*tasks))
            finally:
                for task in tasks:  # the others, when one failed
                    task.cancel()

        try:
            return await (run_all() if session is None else session.call(run_all))
        except ContextLengthError as e:
            raise APIError(
                400, str(e), param=prompt_param, code="context_length_exceeded"
            ) from None
        except ChatTemplateError as e:
            raise APIError(400, str(e), param=prompt_param, code="invalid_messages") from None
        except RuntimeError as e:
            raise APIError(
                503, f"the policy is unavailable: {e}", code="policy_unavailable"
            ) from None

    # -- endpoints ------------------------------------------------------------------------------

    async def health(self, request: Request) -> Response:
        return JSONResponse(
            {"status": "ok", "model": self.gw.model, "sessions": len(self.gw.sessions)}
        )

    async def openapi(self, request: Request) -> Response:
        return JSONResponse(openapi_document())

    async def models(self, request: Request) -> Response:
        self._session(request)
        card = {
            "id": self.gw.model,
            "object": "model",
            "created": self.gw.created,
            "owned_by": "rllm-async",
        }
        return JSONResponse({"object": "list", "data": [card]})

    async def open_session(self, request: Request) -> Response:
        if not self.gw.open_sessions:
            raise APIError(
                403, "sessions are opened by the trainer on this gateway", code="sessions_managed"
            )
        req = await self._body(request, OpenSessionRequest)
        session = self.gw.open_session(req.ttl_s)
        body = {
            "id": session.id,
            "base_url": self.gw.session_url(session.id, request),
            "api_key": session.key,
        }
        return JSONResponse(body, status_code=201)

    async def get_session(self, request: Request) -> Response:
        session = self._session(request)
        assert session is not None
        return JSONResponse(session.records())

    async def delete_session(self, request: Request) -> Response:
        if not self.gw.open_sessions:
            raise APIError(
                403, "sessions are closed by the trainer on this gateway", code="sessions_managed"
            )
        session = self.gw.sessions.close(request.path_params["sid"])
        if session is None:
            raise APIError(
                404, f"no open session {request.path_params['sid']!r}", code="session_not_found"
            )
        return JSONResponse({"id": session.id, "deleted": True, "calls": session.calls})

    async def chat(self, request: Request) -> Response:
        session = self._session(request)
        req = await self._body(request, ChatCompletionRequest)
        self._check_model(req.model)
        ctx = session.ctx if session is not None else self.gw.scratch_context()
        messages = [m.to_chat() for m in req.messages]
        tools = req.tool_schemas
        forced = req.forced_tool
        prefix = "" if forced is False else ctx.tool_call_prefix(None if forced is True else forced)
        kwargs = req.template_kwargs or None
        overrides = [self._sampling(req, session, i) for i in range(req.n)]
        turns = await self._run(
            session,
            lambda: [
                ctx.chat_turn(messages, tools=tools, prefix=prefix, template_kwargs=kwargs, **o)
                for o in overrides
            ],
        )
        headers = _check_format(req.response_format, turns)
        body = self._chat_body(req, turns)
        if req.stream:
            return _sse(self._chat_chunks(req, body), headers)
        return JSONResponse(body, headers=headers)

    async def completions(self, request: Request) -> Response:
        session = self._session(request)
        req = await self._body(request, CompletionRequest)
        self._check_model(req.model)
        ctx = session.ctx if session is not None else self.gw.scratch_context()
        tok = ctx.policy.tokenizer
        if isinstance(req.prompt, str):
            prompt = tok.encode(req.prompt)
        else:
            vocab = getattr(tok, "vocab_size", None)
            if not isinstance(vocab, int):
                raise APIError(
                    400,
                    "token-id prompts are not supported by this policy's tokenizer",
                    param="prompt",
                )
            if any(not 0 <= t < vocab for t in req.prompt):
                raise APIError(400, f"prompt: token ids must be in [0, {vocab})", param="prompt")
            prompt = list(req.prompt)
        if not prompt:
            raise APIError(400, "prompt: encodes to no tokens", param="prompt")
        overrides = [self._sampling(req, session, i) for i in range(req.n)]
        outs = await self._run(session, lambda: [ctx.generate(prompt, **o) for o in overrides])
        body = self._completion_body(req, prompt, outs, tok)
        if req.stream:
            return _sse(self._completion_chunks(body))
        return JSONResponse(body)

    async def responses(self, request: Request) -> Response:
        session = self._session(request)
        req = await self._body(request, ResponseRequest)
        self._check_model(req.model)
        ctx = session.ctx if session is not None else self.gw.scratch_context()
        messages = chat_messages(req)
        forced = req.forced_tool
        prefix = "" if forced is False else ctx.tool_call_prefix(None if forced is True else forced)
        sampling = self._temperature_top_p(req, session)
        if req.max_output_tokens is not None:
            sampling["max_tokens"] = req.max_output_tokens
        [turn] = await self._run(
            session,
            lambda: [
                ctx.chat_turn(
                    messages,
                    tools=req.tool_schemas,
                    prefix=prefix,
                    template_kwargs=req.template_kwargs or None,
                    **sampling,
                )
            ],
            prompt_param="input",
        )
        headers = _check_format(req.response_format, [turn])
        body = response_object(
            req,
            turn,
            model=self.gw.model,
            temperature=sampling.get("temperature", ctx.sampling.temperature),
            top_p=sampling.get("top_p", ctx.sampling.top_p),
        )
        if not req.stream:
            return JSONResponse(body.model_dump(mode="json", exclude_unset=True), headers=headers)
        frames = [
            f"event: {e.type}\ndata: {e.model_dump_json(exclude_unset=True)}\n\n"
            for e in stream_events(body)
        ]
        return _event_stream(frames, headers)

    # -- response bodies ------------------------------------------------------------------------

    def _chat_body(self, req: ChatCompletionRequest, turns: list[ChatTurn]) -> dict[str, Any]:
        tok = self.gw.policy.tokenizer
        choices = []
        for i, turn in enumerate(turns):
            message = dict(turn.message)
            if message.get("tool_calls") and req.parallel_tool_calls is False:
                message["tool_calls"] = message["tool_calls"][:1]
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
            "model": self.gw.model,
            "system_fingerprint": f"policy-v{min(versions)}" if versions else None,
            "choices": choices,
            "usage": _usage(prompt_tokens, completion_tokens),
        }

    def _completion_body(
        self, req: CompletionRequest, prompt: list[int], outs: list[Completion], tok: Any
    ) -> dict[str, Any]:
        choices = []
        for i, out in enumerate(outs):
            text = cut_at_stop(tok.decode(out.ids), req.stops)
            choice: dict[str, Any] = {
                "index": i,
                "text": text,
                "logprobs": None,
                "finish_reason": out.finish_reason,
            }
            if req.logprobs is not None:
                tokens = [tok.decode([t]) for t in out.ids]
                offsets = [sum(len(t) for t in tokens[:k]) for k in range(len(tokens))]
                choice["logprobs"] = {
                    "tokens": tokens,
                    "token_logprobs": out.logprobs,
                    "top_logprobs": None,
                    "text_offset": offsets,
                }
            choices.append(choice)
        return {
            "id": f"cmpl-{secrets.token_hex(12)}",
            "object": "text_completion",
            "created": int(time.time()),
            "model": self.gw.model,
            "choices": choices,
            "usage": _usage(len(prompt), sum(len(o.ids) for o in outs)),
        }

    def _chat_chunks(
        self, req: ChatCompletionRequest, body: dict[str, Any]
    ) -> list[dict[str, Any]]:
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

    def _completion_chunks(self, body: dict[str, Any]) -> list[dict[str, Any]]:
        head = {k: body[k] for k in ("id", "object", "created", "model")}
        return [{**head, "choices": [choice]} for choice in body["choices"]]


def _check_format(fmt: ResponseFormat | None, turns: list[ChatTurn]) -> dict[str, str]:
    """Check each reply against `response_format` (not enforced while sampling): the verdict goes
    into the recorded step's info and the `X-Response-Format` header (`valid` or `invalid`)."""
    if fmt is None or fmt.type == "text":
        return {}
    verdicts = []
    for turn in turns:
        error = format_error(fmt, turn.message.get("content"))
        turn.step.info["response_format"] = {"type": fmt.type, "error": error}
        verdicts.append("valid" if error is None else "invalid")
    return {"X-Response-Format": ",".join(verdicts)}


def _usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
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


def _sse(chunks: list[dict[str, Any]], headers: dict[str, str] | None = None) -> StreamingResponse:
    frames = [f"data: {json.dumps(chunk)}\n\n" for chunk in chunks]
    return _event_stream([*frames, "data: [DONE]\n\n"], headers)


def _event_stream(frames: list[str], headers: dict[str, str] | None = None) -> StreamingResponse:
    async def events() -> AsyncIterator[str]:
        for frame in frames:
            yield frame

    return StreamingResponse(
        events(),
        media_type="text/event-stream",
        headers={"Cache-Control": "no-cache", **(headers or {})},
    )
