"""Chat plumbing shared by `RolloutContext.chat` and the gateway: tool calls and token-in/token-out.

Tool-call syntax (the built-in character models, and Qwen/Hermes-style HF models): the model writes
one block per call anywhere in its reply,

    <tool_call>{"name": "calc", "arguments": {"expr": "3*4"}}</tool_call>

Blocks are decoded with `json.loads` (never evaluated). A block that is not valid JSON, not an
object with a known `name` and an object of `arguments`, or not closed, is a malformed call: it
stays in the reply's text and is reported in `ParsedReply.errors`.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from rllm_async.backends.base import Tokenizer

TOOL_CALL_OPEN = "<tool_call>"
TOOL_CALL_CLOSE = "</tool_call>"
MAX_TOOL_CALL_CHARS = 65_536  # a longer block is malformed, not parsed
_BASE = ({"role": "user", "content": "x"}, {"role": "assistant", "content": "y"})


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
                "id": f"{id_prefix}_{len(calls)}",
                "type": "function",
                "function": {"name": name, "arguments": json.dumps(arguments)},
            }
        )
    kept.append(text[pos:])
    content = "".join(kept)
    return ParsedReply(content.strip() if calls else content, calls, errors)


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


def cut_at_stop(text: str, stops: Sequence[str] | str) -> str:
    """The reply's text up to its first stop sequence, as the OpenAI API returns it."""
    for stop in (stops,) if isinstance(stops, str) else stops:
        if stop and (i := text.find(stop)) >= 0:
            text = text[:i]
    return text


def template_messages(messages: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Messages as chat templates expect them: tool-call arguments as objects, not JSON strings."""
    out = []
    for msg in messages:
        calls = msg.get("tool_calls")
        if calls:
            msg = {**msg, "tool_calls": [_template_call(c) for c in calls]}
        out.append(msg)
    return out


def _template_call(call: Any) -> Any:
    fn = call.get("function", call) if isinstance(call, dict) else None
    if not isinstance(fn, dict):
        return call
    arguments = fn.get("arguments", {})
    if isinstance(arguments, str):
        with contextlib.suppress(ValueError, RecursionError):
            arguments = json.loads(arguments)
    return {**call, "function": {**fn, "arguments": arguments}}


def message_key(msg: dict[str, Any]) -> tuple[Any, ...]:
    """What makes two chat messages the same turn (ignoring fields clients add, such as `refusal`)."""
    calls = tuple(
        json.dumps(c.get("function", c) if isinstance(c, dict) else c, sort_keys=True, default=str)
        for c in template_messages([msg])[0].get("tool_calls") or ()
    )
    return (msg.get("role"), message_text(msg.get("content")), msg.get("tool_call_id"), calls)


def message_text(content: Any) -> str:
    """The text of a message's content: a string, None, or a list of `{"type": "text"}` parts."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(p.get("text", "") for p in content if isinstance(p, dict))
    return str(content)


def continuation_ids(
    tok: Tokenizer,
    completion_ids: Sequence[int],
    new_messages: Sequence[dict[str, Any]],
    tools: Sequence[dict[str, Any]] | None,
) -> list[int]:
    """Tokens that follow an assistant turn's exact `completion_ids` to render `new_messages`.

    The template renders a fixed two-turn chat with and without the new messages; the difference is
    the new turns. The tokens the template puts after an assistant turn's EOS (a newline, for
    ChatML) come first, preceded by the EOS itself when the completion did not end with it
    (a length- or stop-string-truncated reply).
    """
    tools_arg = list(tools) if tools else None
    base = tok.apply_chat_template(list(_BASE), tools=tools_arg, add_generation_prompt=False)
    full = tok.apply_chat_template(
        [*_BASE, *template_messages(new_messages)], tools=tools_arg, add_generation_prompt=True
    )
    if full[: len(base)] != base:
        raise ValueError("the chat template does not render new turns as a suffix of the history")
    eos = tok.eos_token_id
    trailer = base[_last_index(base, eos) + 1 :] if eos in base else []
    closing = [] if completion_ids and completion_ids[-1] == eos else [eos]
    return [*closing, *trailer, *full[len(base) :]]


def _last_index(ids: list[int], value: int) -> int:
    return len(ids) - 1 - ids[::-1].index(value)


@dataclass(slots=True)
class _Tip:
    keys: tuple[tuple[Any, ...], ...]  # the call's messages plus the reply it produced
    tools: str
    prompt_ids: list[int]
    completion_ids: list[int]


class ChatHistory:
    """The token-in/token-out memory of one actor: every reply and the exact tokens behind it."""

    def __init__(self) -> None:
        self._tips: list[_Tip] = []

    def add(
        self,
        messages: Sequence[dict[str, Any]],
        reply: dict[str, Any],
        tools: Sequence[dict[str, Any]] | None,
        prompt_ids: list[int],
        completion_ids: list[int],
    ) -> None:
        keys = tuple(message_key(m) for m in (*messages, reply))
        self._tips.append(_Tip(keys, _tools_key(tools), prompt_ids, completion_ids))

    def prompt(
        self,
        tok: Tokenizer,
        messages: Sequence[dict[str, Any]],
        tools: Sequence[dict[str, Any]] | None,
    ) -> tuple[list[int], bool]:
        """The prompt for `messages`: an earlier reply's exact tokens extended by the new turns
        when `messages` continue that reply's chat (True), else a fresh rendering (False)."""
        keys = tuple(message_key(m) for m in messages)
        tools_key = _tools_key(tools)
        best = None
        for tip in self._tips:
            n = len(tip.keys)
            longer = best is None or n > len(best.keys)
            if longer and tip.tools == tools_key and n <= len(keys) and keys[:n] == tip.keys:
                best = tip
        if best is not None:
            try:
                tail = continuation_ids(tok, best.completion_ids, messages[len(best.keys) :], tools)
            except ValueError:
                pass  # a template that cannot render a suffix: render the whole chat
            else:
                return [*best.prompt_ids, *best.completion_ids, *tail], True
        rendered = tok.apply_chat_template(
            template_messages(messages), tools=list(tools) if tools else None
        )
        return list(rendered), False


def _tools_key(tools: Sequence[dict[str, Any]] | None) -> str:
    return json.dumps(list(tools or ()), sort_keys=True, default=str)
