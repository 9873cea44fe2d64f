"""OpenAI-style JSON errors: `{"error": {"message", "type", "param", "code"}}` with an HTTP status."""

from __future__ import annotations

from typing import Any, Protocol

from pydantic import ValidationError
from starlette.responses import JSONResponse

from rllm_async.gateway.protocol import FieldError

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    409: "conflict_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    503: "service_unavailable_error",
}


class ErrorShape(Protocol):
    """Builds an API's error body (OpenAI's `error_response`, or Anthropic's)."""

    def __call__(
        self, status: int, message: str, *, param: str | None = None, code: str | None = None
    ) -> JSONResponse: ...


class APIError(Exception):
    """An error the client is told about; `status` is the HTTP status."""

    def __init__(
        self, status: int, message: str, *, param: str | None = None, code: str | None = None
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code


def error_response(
    status: int, message: str, *, param: str | None = None, code: str | None = None
) -> JSONResponse:
    """The JSON body the official clients parse into their `APIError` classes."""
    body: dict[str, Any] = {
        "error": {
            "message": message,
            "type": _TYPES.get(status, "invalid_request_error"),
            "param": param,
            "code": code,
        }
    }
    return JSONResponse(body, status_code=status)


_ANTHROPIC_TYPES = {
    **_TYPES,
    409: "invalid_request_error",
    413: "request_too_large",
    500: "api_error",
    503: "overloaded_error",
}


def anthropic_error_response(
    status: int, message: str, *, param: str | None = None, code: str | None = None
) -> JSONResponse:
    """The Anthropic API's error body, `{"type": "error", "error": {"type", "message"}}`, which
    the `anthropic` client raises as its `APIStatusError` subclasses (`param` is in `message`)."""
    kind = _ANTHROPIC_TYPES.get(status, "invalid_request_error")
    body = {"type": "error", "error": {"type": kind, "message": message}}
    return JSONResponse(body, status_code=status)


def invalid(e: ValidationError) -> APIError:
    """A 400 naming the invalid parameter of a request body: a validator's `FieldError` names its
    own; otherwise the deepest error's location, without the union members pydantic tried."""
    errors = e.errors(include_url=False)
    first = max(errors, key=lambda err: len(_param_path(err["loc"])))
    cause = (first.get("ctx") or {}).get("error")
    if isinstance(cause, FieldError):
        return APIError(400, str(cause), param=cause.param, code="invalid_parameter")
    param = ".".join(_param_path(first["loc"])) or None
    message = first["msg"]
    if first["type"] == "extra_forbidden":
        message = "unrecognized request argument (this server does not support it)"
    elif first["type"] == "union_tag_invalid":
        message = f"type {first['ctx']['tag']!r} is not supported"
    return APIError(
        400, f"{param}: {message}" if param else message, param=param, code="invalid_parameter"
    )


def _param_path(loc: tuple[int | str, ...]) -> list[str]:
    """A location as the client names it: `str`, `list[TextPart]`, `NamedToolChoice`, ... are the
    union members pydantic tried, not fields (which are lower case)."""
    return [
        str(p)
        for p in loc
        if not (isinstance(p, str) and (p in _TAGS or "[" in p or p[:1].isupper()))
    ]


_TAGS = {"str", "int", "float", "bool", "none", "dict", "list", "literal"}
