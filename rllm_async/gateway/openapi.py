"""The gateway's OpenAPI 3.1 document, built from the request models (served at `/openapi.json`)."""

from __future__ import annotations

import functools
from typing import Any

from pydantic import BaseModel

from rllm_async.gateway.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    OpenChildRequest,
    OpenSessionRequest,
    RewardRequest,
)
from rllm_async.gateway.protocol_anthropic import CountTokensRequest, MessagesRequest
from rllm_async.gateway.protocol_responses import ResponseRequest

_REF = "#/components/schemas/{model}"
_ERROR = {"$ref": "#/components/schemas/Error"}
_ANTHROPIC_ERROR = {"$ref": "#/components/schemas/AnthropicError"}
_ERROR_SCHEMA = {
    "type": "object",
    "required": ["error"],
    "properties": {
        "error": {
            "type": "object",
            "required": ["message", "type"],
            "properties": {
                "message": {"type": "string"},
                "type": {"type": "string"},
                "param": {"type": ["string", "null"]},
                "code": {"type": ["string", "null"]},
            },
        }
    },
}
_ANTHROPIC_ERROR_SCHEMA = {
    "type": "object",
    "required": ["type", "error"],
    "properties": {
        "type": {"const": "error"},
        "error": {
            "type": "object",
            "required": ["type", "message"],
            "properties": {"type": {"type": "string"}, "message": {"type": "string"}},
        },
    },
}


def _operation(
    summary: str, body: type[BaseModel] | None = None, error: dict[str, str] = _ERROR
) -> dict[str, Any]:
    op: dict[str, Any] = {
        "summary": summary,
        "responses": {
            "200": {"description": "OK", "content": {"application/json": {}}},
            "default": {
                "description": "an error",
                "content": {"application/json": {"schema": error}},
            },
        },
    }
    if body is not None:
        op["requestBody"] = {
            "required": True,
            "content": {"application/json": {"schema": {"$ref": _REF.format(model=body.__name__)}}},
        }
    return op


_SESSION = {"name": "sid", "in": "path", "required": True, "schema": {"type": "string"}}


@functools.cache
def openapi_document() -> dict[str, Any]:
    """Paths, request schemas and the error schema of every route."""
    schemas: dict[str, Any] = {"Error": _ERROR_SCHEMA, "AnthropicError": _ANTHROPIC_ERROR_SCHEMA}
    models = (
        ChatCompletionRequest,
        CompletionRequest,
        ResponseRequest,
        MessagesRequest,
        CountTokensRequest,
    )
    for model in (*models, OpenSessionRequest, RewardRequest, OpenChildRequest):
        schema = model.model_json_schema(ref_template=_REF)
        schemas.update(schema.pop("$defs", {}))
        schemas[model.__name__] = schema
    v1 = {
        "/v1/models": {"get": _operation("the served model")},
        "/v1/chat/completions": {"post": _operation("a chat completion", ChatCompletionRequest)},
        "/v1/completions": {"post": _operation("a text completion", CompletionRequest)},
        "/v1/responses": {"post": _operation("a response (Responses API)", ResponseRequest)},
        "/v1/messages": {
            "post": _operation(
                "a message (Anthropic Messages API)", MessagesRequest, _ANTHROPIC_ERROR
            )
        },
        "/v1/messages/count_tokens": {
            "post": _operation(
                "a prompt's token count (Anthropic Messages API)",
                CountTokensRequest,
                _ANTHROPIC_ERROR,
            )
        },
    }
    paths: dict[str, Any] = {
        "/health": {"get": _operation("liveness and open sessions")},
        "/sessions": {"post": _operation("open a session (standalone serve)", OpenSessionRequest)},
        "/sessions/{sid}": {
            "parameters": [_SESSION],
            "get": _operation("the session's recorded calls"),
            "delete": _operation("close a session (standalone serve)"),
        },
        "/sessions/{sid}/reward": {
            "parameters": [_SESSION],
            "post": _operation("report the episode's reward; closes the session", RewardRequest),
        },
        "/sessions/{sid}/children": {
            "parameters": [_SESSION],
            "post": _operation("open a child session for a subagent of a role", OpenChildRequest),
        },
        **v1,
    }
    for path, item in v1.items():
        paths["/sessions/{sid}" + path] = {"parameters": [_SESSION], **item}
    return {
        "openapi": "3.1.0",
        "info": {"title": "rllm-async gateway", "version": "1"},
        "paths": paths,
        "components": {"schemas": schemas},
    }
