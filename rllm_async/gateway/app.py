"""The gateway's HTTP app (Starlette): its routes, plain and session-scoped, and the small
endpoints (health, models, sessions); each API's handler lives in its own module."""

from __future__ import annotations

import logging

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from rllm_async.gateway.anthropic import count_tokens, messages
from rllm_async.gateway.api import API, GatewayState
from rllm_async.gateway.chat_completions import chat_completions
from rllm_async.gateway.completions import completions
from rllm_async.gateway.errors import APIError, anthropic_error_response, error_response
from rllm_async.gateway.openapi import openapi_document
from rllm_async.gateway.protocol import OpenChildRequest, OpenSessionRequest, RewardRequest
from rllm_async.gateway.responses import responses

log = logging.getLogger("rllm_async.gateway")


def build_app(gateway: GatewayState) -> Starlette:
    """The ASGI app of `gateway`; every route answers JSON, errors included."""
    api = API(gateway)
    v1 = [
        ("/v1/models", api.endpoint(_models), ["GET"]),
        ("/v1/chat/completions", api.endpoint(chat_completions), ["POST"]),
        ("/v1/completions", api.endpoint(completions), ["POST"]),
        ("/v1/responses", api.endpoint(responses), ["POST"]),
        ("/v1/messages", api.endpoint(messages, errors=anthropic_error_response), ["POST"]),
        (
            "/v1/messages/count_tokens",
            api.endpoint(count_tokens, errors=anthropic_error_response),
            ["POST"],
        ),
    ]
    routes = [
        Route("/health", api.endpoint(_health, auth=False), methods=["GET"]),
        Route("/openapi.json", api.endpoint(_openapi, auth=False), methods=["GET"]),
        Route("/sessions", api.endpoint(_open_session), methods=["POST"]),
        Route("/sessions/{sid}", api.endpoint(_get_session), methods=["GET"]),
        Route("/sessions/{sid}", api.endpoint(_delete_session), methods=["DELETE"]),
        Route("/sessions/{sid}/reward", api.endpoint(_reward), methods=["POST"]),
        Route("/sessions/{sid}/children", api.endpoint(_open_child), methods=["POST"]),
        *(Route(path, fn, methods=m) for path, fn, m in v1),
        *(Route("/sessions/{sid}" + path, fn, methods=m) for path, fn, m in v1),
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


async def _health(api: API, request: Request) -> Response:
    body = {
        "status": "ok",
        "model": api.gw.model,
        "sessions": len(api.gw.sessions),
        "paused": api.gw.paused,
    }
    return JSONResponse(body)


async def _openapi(api: API, request: Request) -> Response:
    return JSONResponse(openapi_document())


async def _models(api: API, request: Request) -> Response:
    api.session(request)
    card = {
        "id": api.gw.model,
        "object": "model",
        "created": api.gw.created,
        "owned_by": "rllm-async",
    }
    return JSONResponse({"object": "list", "data": [card]})


async def _open_session(api: API, request: Request) -> Response:
    if not api.gw.open_sessions:
        raise APIError(
            403, "sessions are opened by the trainer on this gateway", code="sessions_managed"
        )
    req = await api.body(request, OpenSessionRequest)
    session = api.gw.open_session(req.ttl_s, req.task)
    body = {
        "id": session.id,
        "base_url": api.gw.session_url(session.id, request),
        "api_key": session.key,
        "task": session.task,
    }
    return JSONResponse(body, status_code=201)


async def _open_child(api: API, request: Request) -> Response:
    """A child session for a subagent, with its own id, base URL and API key; allowed wherever
    its parent's calls are (trainer-managed sessions included)."""
    parent = api.session(request, role=False)
    assert parent is not None
    req = await api.body(request, OpenChildRequest)
    child = api.gw.sessions.open_child(parent, req.role)
    tip = child.ctx.trajectory().parent
    body = {
        "id": child.id,
        "base_url": api.gw.session_url(child.id, request),
        "api_key": child.key,
        "role": req.role,
        "parent": {"session": parent.id, "node": tip.node, "step": tip.step} if tip else None,
    }
    return JSONResponse(body, status_code=201)


async def _reward(api: API, request: Request) -> Response:
    if not api.gw.open_sessions:
        raise APIError(
            403,
            "rewards are computed by the trainer's workflow on this gateway",
            code="sessions_managed",
        )
    api.session(request)  # the API key, when it is a session's, must be this one's
    req = await api.body(request, RewardRequest)
    session = api.gw.reward(request.path_params["sid"], req.reward, req.task, req.response_id)
    body = {
        "id": session.id,
        "reward": session.reward,
        "task": session.task,
        "calls": session.calls,
    }
    if req.response_id is not None:  # a reply's reward; the session's own is still to come
        body |= {"response_id": req.response_id, "reward": req.reward}
    return JSONResponse(body)


async def _get_session(api: API, request: Request) -> Response:
    session = api.session(request)
    assert session is not None
    return JSONResponse(session.records())


async def _delete_session(api: API, request: Request) -> Response:
    if not api.gw.open_sessions:
        raise APIError(
            403, "sessions are closed by the trainer on this gateway", code="sessions_managed"
        )
    session = api.gw.sessions.close(request.path_params["sid"])
    if session is None:
        raise APIError(
            404, f"no open session {request.path_params['sid']!r}", code="session_not_found"
        )
    return JSONResponse({"id": session.id, "deleted": True, "calls": session.calls})
