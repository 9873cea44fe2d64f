"""Tool calls as OpenAI-style dicts: what every family's parser (`rollout.tool_parsers`) returns.

A parser finds the call blocks of a reply (`Span`s, each with its calls or its error); `assemble`
cuts the well-formed blocks out of the text and keeps malformed ones visible, with their errors in
`ParsedReply.errors`. Arguments are decoded with `json.loads`, never evaluated.
"""

from __future__ import annotations

import contextlib
import json
import secrets
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

MAX_TOOL_CALL_CHARS = 65_536  # a longer block is malformed, not parsed
Tools = dict[str, dict[str, Any]]  # tool name -> the JSON schema of its parameters


@dataclass(slots=True)
class ParsedReply:
    """A reply split into its text, its reasoning and its OpenAI-style tool calls; `errors` name
    malformed calls, which stay in `content`."""

    content: str
    tool_calls: list[dict[str, Any]] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    reasoning: str | None = None


@dataclass(slots=True)
class Span:
    """A tool-call block of a reply, `text[start:end]`: its calls, or why it is malformed."""

    start: int
    end: int
    calls: list[tuple[str, dict[str, Any]]] = field(default_factory=list)
    error: str | None = None


def tool_schemas(tools: Sequence[dict[str, Any]] | None) -> Tools:
    """Parameter schemas by tool name, from OpenAI schemas (`{"type": "function", ...}`) or bare."""
    out: Tools = {}
    for tool in tools or ():
        spec = tool.get("function", tool) if isinstance(tool, dict) else None
        if isinstance(spec, dict) and isinstance(spec.get("name"), str):
            params = spec.get("parameters")
            out[spec["name"]] = params if isinstance(params, dict) else {}
    return out


def assemble(text: str, spans: list[Span], *, id_prefix: str = "call") -> ParsedReply:
    """The reply without its well-formed blocks, their calls (with fresh ids), and the errors."""
    calls: list[dict[str, Any]] = []
    errors: list[str] = []
    kept: list[str] = []
    pos = 0
    for span in spans:
        kept.append(text[pos : span.start])
        pos = span.end
        if span.error is not None:
            errors.append(span.error)
            kept.append(text[span.start : span.end])  # a malformed block stays visible
            continue
        calls.extend(
            openai_call(name, arguments, id_prefix=id_prefix) for name, arguments in span.calls
        )
    kept.append(text[pos:])
    content = "".join(kept)
    return ParsedReply(content.strip() if calls else content, calls, errors)


def openai_call(name: str, arguments: dict[str, Any], *, id_prefix: str = "call") -> dict[str, Any]:
    """An OpenAI-style tool call with a fresh id (unique: agents key their history on it)."""
    return {
        "id": f"{id_prefix}_{secrets.token_hex(8)}",
        "type": "function",
        "function": {"name": name, "arguments": json.dumps(arguments)},
    }


def decode_json(body: str) -> tuple[Any, str | None]:
    """`body` as JSON, or the error saying why it is not (too long, not JSON)."""
    if len(body) > MAX_TOOL_CALL_CHARS:
        return None, f"tool call longer than {MAX_TOOL_CALL_CHARS} characters"
    try:
        return json.loads(body), None
    except (ValueError, RecursionError) as e:
        return None, f"tool call is not valid JSON ({e})"


def checked_call(name: Any, arguments: Any, tools: Tools) -> tuple[str, dict[str, Any]] | str:
    """A call `(name, arguments)` to a known tool with an object of arguments, or the error."""
    if not isinstance(name, str):
        return 'tool call must name its tool: {"name": ..., "arguments": {...}}'
    if name not in tools:
        known = ", ".join(sorted(tools)) or "none"
        return f"unknown tool {name!r} (tools: {known})"
    if isinstance(arguments, str):
        with contextlib.suppress(ValueError, RecursionError):
            arguments = json.loads(arguments)
    if arguments is None:
        arguments = {}
    if not isinstance(arguments, dict):
        return f"arguments of {name!r} must be a JSON object"
    return name, arguments


def json_call_span(start: int, end: int, body: str, tools: Tools, args_key: str) -> Span:
    """The span of a block holding one JSON object `{"name": ..., args_key: {...}}`."""
    obj, error = decode_json(body)
    if error is None and not isinstance(obj, dict):
        error = f'tool call must be a JSON object {{"name": ..., "{args_key}": {{...}}}}'
    return (
        object_span(start, end, obj, tools, args_key)
        if error is None
        else Span(start, end, error=error)
    )


def object_span(start: int, end: int, obj: dict[str, Any], tools: Tools, args_key: str) -> Span:
    """The span of a decoded call object; its arguments under `args_key` (or `arguments`)."""
    call = checked_call(obj.get("name"), obj.get(args_key, obj.get("arguments")), tools)
    return Span(start, end, error=call) if isinstance(call, str) else Span(start, end, [call])
