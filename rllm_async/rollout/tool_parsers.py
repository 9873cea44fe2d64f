"""Tool-call parsers, one per model family: where each family writes its calls, and how a forced
call opens. Every parser returns a `ParsedReply` and never raises on model output.

| name | family | a call as the model writes it |
|---|---|---|
| `hermes` | Hermes, Qwen2.5, Qwen3 | `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` |
| `llama3_json` | Llama 3.1-3.3 | `{"name": ..., "parameters": {...}}` (after `<|python_tag|>` or alone; `;` between calls) |
| `mistral` | Mistral | `[TOOL_CALLS][{"name": ..., "arguments": {...}}]` or `[TOOL_CALLS]name[ARGS]{...}` |
| `qwen3_coder` | Qwen3-Coder | `<tool_call><function=name><parameter=x>...</parameter></function></tool_call>` |
| `deepseek_v3` | DeepSeek V3, V3.1, R1 | `<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>...<｜tool▁call▁end｜><｜tool▁calls▁end｜>` |
| `harmony` | gpt-oss | `<|channel|>commentary to=functions.name <|constrain|>json<|message|>{...}<|call|>` |
"""

from __future__ import annotations

import json
import re
from typing import Any, ClassVar

from rllm_async.rollout.tool_calls import (
    MAX_TOOL_CALL_CHARS,
    ParsedReply,
    Span,
    Tools,
    assemble,
    checked_call,
    decode_json,
    json_call_span,
    object_span,
    openai_call,
)

_JSON = json.JSONDecoder()


class ToolParser:
    """A family's tool-call syntax. `markers` are special tokens the parser reads, kept when the
    reply is decoded; `structured` parsers also read replies made without tools (harmony)."""

    name: ClassVar[str]
    markers: ClassVar[tuple[str, ...]] = ()
    structured: ClassVar[bool] = False

    def parse(self, text: str, tools: Tools, *, id_prefix: str = "call") -> ParsedReply:
        """`text` split into content and calls to `tools`; malformed calls are errors."""
        return assemble(text, self.spans(text, tools), id_prefix=id_prefix)

    def spans(self, text: str, tools: Tools) -> list[Span]:
        raise NotImplementedError

    def forced_prefix(self, name: str | None) -> str:
        """The opening of a call that a request forces: of `name`'s call, or of any call."""
        raise NotImplementedError


def _tagged_blocks(text: str, open_: str, close: str) -> list[tuple[int, int, str] | Span]:
    """`(start, end, body)` of each `open_ ... close` block; an unclosed one is an error span."""
    out: list[tuple[int, int, str] | Span] = []
    pos = 0
    while (start := text.find(open_, pos)) >= 0:
        body_start = start + len(open_)
        end = text.find(close, body_start)
        if end < 0:
            out.append(Span(start, len(text), error=f"unterminated {open_}: close it with {close}"))
            break
        pos = end + len(close)
        out.append((start, pos, text[body_start:end]))
    return out


class HermesParser(ToolParser):
    name = "hermes"

    def spans(self, text: str, tools: Tools) -> list[Span]:
        return [
            b if isinstance(b, Span) else json_call_span(b[0], b[1], b[2], tools, "arguments")
            for b in _tagged_blocks(text, "<tool_call>", "</tool_call>")
        ]

    def forced_prefix(self, name: str | None) -> str:
        opening = '<tool_call>{"name": "'
        return opening if name is None else f'{opening}{name}", "arguments": '


class Llama3JsonParser(ToolParser):
    """Llama 3.x JSON calls: the reply is the call (or `;`-separated calls), after an optional
    `<|python_tag|>`. Without the tag, a reply is a call only when it opens with `{"name"`."""

    name = "llama3_json"
    markers = ("<|python_tag|>",)
    _CALL = re.compile(r'\s*\{\s*"name"\s*:')

    def spans(self, text: str, tools: Tools) -> list[Span]:
        tag = text.find("<|python_tag|>")
        if tag >= 0:
            start, pos = tag, tag + len("<|python_tag|>")
        elif self._CALL.match(text):
            start = pos = len(text) - len(text.lstrip())
        else:
            return []
        spans: list[Span] = []
        while True:
            while pos < len(text) and text[pos] in " \t\r\n;":
                pos += 1
            if pos == len(text):
                break
            try:
                obj, end = _JSON.raw_decode(text, pos)
            except (ValueError, RecursionError) as e:
                if not spans:  # text after the calls stays content
                    spans.append(Span(start, len(text), error=f"tool call is not valid JSON ({e})"))
                break
            if not isinstance(obj, dict):
                error = 'tool call must be a JSON object {"name": ..., "parameters": {...}}'
                spans.append(Span(start, end, error=error))
            else:
                spans.append(object_span(start, end, obj, tools, "parameters"))
            start = pos = end
        return spans

    def forced_prefix(self, name: str | None) -> str:
        return '{"name": "' if name is None else f'{{"name": "{name}", "parameters": '


class MistralParser(ToolParser):
    """`[TOOL_CALLS]` then a JSON list of calls (v3 tokenizers) or `name[ARGS]{...}` (v11+)."""

    name = "mistral"
    markers = ("[TOOL_CALLS]", "[ARGS]", "[CALL_ID]")
    _NAMED = re.compile(
        r"\s*([A-Za-z0-9_.\-]{1,64})\s*(?:\[CALL_ID\]\s*[A-Za-z0-9]+\s*)?\[ARGS\]\s*"
    )

    def spans(self, text: str, tools: Tools) -> list[Span]:
        spans: list[Span] = []
        pos = 0
        while (start := text.find("[TOOL_CALLS]", pos)) >= 0:
            body = start + len("[TOOL_CALLS]")
            named = self._NAMED.match(text, body)
            first = body + len(text[body:]) - len(text[body:].lstrip())
            try:
                obj, pos = _JSON.raw_decode(text, named.end() if named else first)
            except (ValueError, RecursionError) as e:
                spans.append(Span(start, len(text), error=f"tool call is not valid JSON ({e})"))
                break
            if pos - start > MAX_TOOL_CALL_CHARS:
                spans.append(Span(start, pos, error=f"tool call longer than {MAX_TOOL_CALL_CHARS}"))
            elif named:
                call = checked_call(named.group(1), obj, tools)
                spans.append(
                    Span(start, pos, error=call)
                    if isinstance(call, str)
                    else Span(start, pos, [call])
                )
            elif isinstance(obj, list) and obj and all(isinstance(o, dict) for o in obj):
                parts = [object_span(start, pos, o, tools, "arguments") for o in obj]
                bad = next((p.error for p in parts if p.error is not None), None)
                calls = [c for p in parts for c in p.calls]
                spans.append(Span(start, pos, error=bad) if bad else Span(start, pos, calls))
            else:
                error = 'tool calls must be a JSON list [{"name": ..., "arguments": {...}}]'
                spans.append(Span(start, pos, error=error))
        return spans

    def forced_prefix(self, name: str | None) -> str:
        opening = '[TOOL_CALLS][{"name": "'
        return opening if name is None else f'{opening}{name}", "arguments": '


class Qwen3CoderParser(ToolParser):
    """XML calls; a parameter's text is decoded as JSON when its schema's type is not `string`."""

    name = "qwen3_coder"
    _FUNCTION = re.compile(r"\s*<function=([^>\n]{1,64})>(.*?)</function>\s*", re.DOTALL)
    _PARAMETER = re.compile(r"<parameter=([^>\n]{1,64})>(.*?)</parameter>", re.DOTALL)

    def spans(self, text: str, tools: Tools) -> list[Span]:
        spans: list[Span] = []
        for block in _tagged_blocks(text, "<tool_call>", "</tool_call>"):
            if isinstance(block, Span):
                spans.append(block)
                continue
            start, end, body = block
            fn = self._FUNCTION.fullmatch(body)
            if len(body) > MAX_TOOL_CALL_CHARS:
                error = f"tool call longer than {MAX_TOOL_CALL_CHARS} characters"
            elif fn is None:
                error = "tool call must be <function=name><parameter=x>...</parameter></function>"
            else:
                name = fn.group(1).strip()
                props = tools.get(name, {}).get("properties", {})
                args = {
                    key.strip(): _typed(value, props.get(key.strip()))
                    for key, value in self._PARAMETER.findall(fn.group(2))
                }
                call = checked_call(name, args, tools)
                if not isinstance(call, str):
                    spans.append(Span(start, end, [call]))
                    continue
                error = call
            spans.append(Span(start, end, error=error))
        return spans

    def forced_prefix(self, name: str | None) -> str:
        return "<tool_call>\n<function=" + ("" if name is None else f"{name}>\n")


def _typed(value: str, schema: Any) -> Any:
    """A parameter's text, decoded as JSON unless its schema says string (or it is not JSON)."""
    value = value.removeprefix("\n").removesuffix("\n")
    kind = schema.get("type") if isinstance(schema, dict) else None
    if kind in (None, "string"):
        return value
    try:
        return json.loads(value)
    except (ValueError, RecursionError):
        return value


class DeepSeekV3Parser(ToolParser):
    """V3 (`function<｜tool▁sep｜>name` and a ```json block) and V3.1 (`name<｜tool▁sep｜>{...}`)."""

    name = "deepseek_v3"
    BEGIN, END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
    CALL, CALL_END, SEP = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"
    markers = (BEGIN, END, CALL, CALL_END, SEP)
    _FENCED = re.compile(r"\s*([^\n]{1,64})\n```(?:json)?\n(.*)\n```\s*", re.DOTALL)

    def spans(self, text: str, tools: Tools) -> list[Span]:
        spans: list[Span] = []
        for block in _tagged_blocks(text, self.BEGIN, self.END):
            if isinstance(block, Span):
                spans.append(block)
                continue
            start, end, body = block
            results = [
                (c.error or "") if isinstance(c, Span) else self._call(c[2], tools)
                for c in _tagged_blocks(body, self.CALL, self.CALL_END)
            ]
            error = next((r for r in results if isinstance(r, str)), None)
            if not results:
                error = f"no {self.CALL} in the tool-call block"
            calls = [r for r in results if not isinstance(r, str)]
            spans.append(
                Span(start, end, error=error) if error is not None else Span(start, end, calls)
            )
        return spans

    def _call(self, body: str, tools: Tools) -> tuple[str, dict[str, Any]] | str:
        kind, sep, rest = body.partition(self.SEP)
        if not sep:
            return f"{self.SEP} missing in a tool call"
        fenced = self._FENCED.fullmatch(rest) if kind.strip() == "function" else None
        name, args = (fenced.group(1), fenced.group(2)) if fenced else (kind, rest)
        obj, error = decode_json(args)
        return error if error is not None else checked_call(name.strip(), obj, tools)

    def forced_prefix(self, name: str | None) -> str:
        opening = f"{self.BEGIN}{self.CALL}function{self.SEP}"
        return opening if name is None else f"{opening}{name}\n```json\n"


class HarmonyParser(ToolParser):
    """gpt-oss's harmony messages: `analysis` is reasoning, a message to `functions.NAME` a call
    with a JSON body, any other (`final`) content. Read with or without tools."""

    name = "harmony"
    markers = ("<|start|>", "<|end|>", "<|channel|>", "<|message|>", "<|call|>", "<|constrain|>")
    structured = True
    _MESSAGE = re.compile(
        r"(?:<\|start\|>)?(.*?)<\|message\|>(.*?)(?:<\|end\|>|<\|call\|>|<\|return\|>|$)", re.DOTALL
    )
    _CHANNEL = re.compile(r"<\|channel\|>\s*(\w+)")
    _RECIPIENT = re.compile(r"to=functions\.([A-Za-z0-9_\-]{1,64})")

    def parse(self, text: str, tools: Tools, *, id_prefix: str = "call") -> ParsedReply:
        if "<|message|>" not in text:
            return ParsedReply(text)
        reasoning: list[str] = []
        content: list[str] = []
        out = ParsedReply("")
        for m in self._MESSAGE.finditer(text):
            header, body = m.group(1), m.group(2)
            channel = self._CHANNEL.search(header)
            recipient = self._RECIPIENT.search(header)
            if recipient is None:
                is_analysis = channel is not None and channel.group(1) == "analysis"
                (reasoning if is_analysis else content).append(body)
                continue
            obj, error = decode_json(body)
            call = checked_call(recipient.group(1), obj, tools) if error is None else error
            if isinstance(call, str):
                out.errors.append(call)
                content.append(m.group(0))  # a malformed call stays visible
            else:
                out.tool_calls.append(openai_call(*call, id_prefix=id_prefix))
        out.content = "".join(content).strip()
        out.reasoning = "\n".join(reasoning).strip() if reasoning else None
        return out

    def forced_prefix(self, name: str | None) -> str:
        opening = "<|channel|>commentary to=functions."
        return opening if name is None else f"{opening}{name} <|constrain|>json<|message|>"


TOOL_PARSERS: dict[str, ToolParser] = {
    p.name: p
    for p in (
        HermesParser(),
        Llama3JsonParser(),
        MistralParser(),
        Qwen3CoderParser(),
        DeepSeekV3Parser(),
        HarmonyParser(),
    )
}
