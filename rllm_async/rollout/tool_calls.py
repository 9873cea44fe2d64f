"""Tool-call parsing: the reply's text split into content and OpenAI-style `tool_calls`.

The syntax (the built-in character models, and Qwen/Hermes-style HF models): the model writes
one block per call anywhere in its reply,

    <tool_call>{"name": "calc", "arguments": {"expr": "3*4"}}</tool_call>

Blocks are decoded with `json.loads` (never evaluated). A block that is not valid JSON, not an
object with a known `name` and an object of `arguments`, or not closed, is a malformed call: it
stays in the reply's text and is reported in `ParsedReply.errors`.
"""

from __future__ import annotations

import contextlib
import json
import secrets
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

TOOL_CALL_OPEN = "<tool_call>"
TOOL_CALL_CLOSE = "</tool_call>"
MAX_TOOL_CALL_CHARS = 65_536  # a longer block is malformed, not parsed


@dataclass(slots=True)
class ParsedReply:
    """A reply split into its text and its OpenAI-style tool calls; `errors` name malformed calls."""

    content: str
    tool_calls: list[dict[str, Any]] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)


def tool_names(tools: Sequence[dict[str, Any]] | None) -> set[str]:
    """Names of tools given as OpenAI schemas (`{"type": "function", "function": {...}}`) or bare."""
    names = set()
    for tool in tools or ():
        spec = tool.get("function", tool) if isinstance(tool, dict) else None
        if isinstance(spec, dict) and isinstance(spec.get("name"), str):
            names.add(spec["name"])
    return names


def parse_tool_calls(text: str, names: set[str], *, id_prefix: str = "call") -> ParsedReply:
    """Split `text` into content and tool calls to the tools in `names`; never raises."""
    calls: list[dict[str, Any]] = []
    errors: list[str] = []
    kept: list[str] = []
    pos = 0
    while (start := text.find(TOOL_CALL_OPEN, pos)) >= 0:
        body_start = start + len(TOOL_CALL_OPEN)
        end = text.find(TOOL_CALL_CLOSE, body_start)
        if end < 0:
            errors.append(f"unterminated {TOOL_CALL_OPEN}: close it with {TOOL_CALL_CLOSE}")
            break
        kept.append(text[pos:start])
        pos = end + len(TOOL_CALL_CLOSE)
        call, error = _decode_call(text[body_start:end], names)
        if error is not None:
            errors.append(error)
            kept.append(text[start:pos])  # a malformed block stays visible in the text
            continue
        name, arguments = call
        calls.append(
            {
                "id": f"{id_prefix}_{secrets.token_hex(8)}",  # unique: agents key history on it
                "type": "function",
                "function": {"name": name, "arguments": json.dumps(arguments)},
            }
        )
    kept.append(text[pos:])
    content = "".join(kept)
    return ParsedReply(content.strip() if calls else content, calls, errors)


def forced_call_prefix(name: str | None) -> str:
    """The opening of a tool call that a request forces: of `name`'s call, or of any call."""
    opening = f'{TOOL_CALL_OPEN}{{"name": "'
    return opening if name is None else f'{opening}{name}", "arguments": '


def _decode_call(body: str, names: set[str]) -> tuple[Any, str | None]:
    if len(body) > MAX_TOOL_CALL_CHARS:
        return None, f"tool call longer than {MAX_TOOL_CALL_CHARS} characters"
    try:
        obj = json.loads(body)
    except (ValueError, RecursionError) as e:
        return None, f"tool call is not valid JSON ({e})"
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None, 'tool call must be a JSON object {"name": ..., "arguments": {...}}'
    if obj["name"] not in names:
        known = ", ".join(sorted(names)) or "none"
        return None, f"unknown tool {obj['name']!r} (tools: {known})"
    arguments = obj.get("arguments", {})
    if isinstance(arguments, str):
        with contextlib.suppress(ValueError, RecursionError):
            arguments = json.loads(arguments)
    if not isinstance(arguments, dict):
        return None, f"arguments of {obj['name']!r} must be a JSON object"
    return (obj["name"], arguments), None
