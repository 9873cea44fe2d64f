"""Tool-call parsers, one per model family: where each family writes its calls, and how a forced
call opens and goes on (the grammar a forced call is sampled under). Every parser returns a
`ParsedReply` and never raises on model output. It runs past 400 lines because each family's
syntax, read and written, stays in one place.

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
from collections.abc import Callable
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
from rllm_async.rollout.tool_grammar import (
    Tokens,
    arguments,
    free_text,
    literal,
    marker_tokens,
    quoted,
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

    # What follows the name in `forced_prefix(None)` up to the arguments (so that
    # `forced_prefix(name) == forced_prefix(None) + name + between`), what closes one call after
    # them, and whether the name is written inside a JSON string.
    between: ClassVar[str] = ""
    close: ClassVar[str] = ""
    json_name: ClassVar[bool] = True

    def grammar_tokens(self, encode: Callable[[str], list[int]]) -> dict[str, int]:
        """The markers a tokenizer (its `encode`) writes as one token, which a grammar names by
        id (`forced_grammar`'s `tokens`)."""
        return marker_tokens((*self.markers, "<tool_call>", "</tool_call>"), encode)

    def forced_grammar(self, name: str | None, tools: Tools, tokens: Tokens | None = None) -> str:
        """The grammar (llguidance's Lark) of the rest of a reply after `forced_prefix(name)`: the
        name (one of `tools`' when `name` is None), arguments following the tool's parameter
        schema, the closing of one call, and nothing after. `tokens` are the markers written as
        one token (`grammar_tokens`)."""
        tokens = tokens or {}
        rules: list[str] = []
        if name is not None:
            return f"start: {self._rest(name, tools.get(name), tokens, rules)}\n" + "".join(rules)
        if not tools:
            raise ValueError("forcing a call to any tool needs at least one tool")
        calls = []
        for i, (tool, schema) in enumerate(tools.items()):
            written = json.dumps(tool, ensure_ascii=False)[1:-1] if self.json_name else tool
            head = literal(written + self.between, tokens)
            rules.append(f"call_{i}: {head} {self._rest(tool, schema, tokens, rules)}\n")
            calls.append(f"call_{i}")
        return f"start: {' | '.join(calls)}\n" + "".join(rules)

    def _rest(self, name: str, schema: Any, tokens: Tokens, rules: list[str]) -> str:
        """The arguments of `name`'s call and its closing (extra rules appended to `rules`)."""
        return f"{arguments(schema)} {literal(self.close, tokens)}"


def _tagged_blocks(
    text: str, open_: str, close: str, json_body: bool = False
) -> list[tuple[int, int, str] | Span]:
    """`(start, end, body)` of each `open_ ... close` block; an unclosed one is an error span.
    With `json_body`, a block whose body is JSON closes after it (its strings may hold `close`)."""
    out: list[tuple[int, int, str] | Span] = []
    pos = 0
    while (start := text.find(open_, pos)) >= 0:
        body_start = start + len(open_)
        end = text.find(close, body_start)
        if json_body and end >= 0:
            end = _after_json(text, body_start, close, end)
        if end < 0:
            out.append(Span(start, len(text), error=f"unterminated {open_}: close it with {close}"))
            break
        pos = end + len(close)
        out.append((start, pos, text[body_start:end]))
    return out


def _after_json(text: str, pos: int, close: str, default: int) -> int:
    """Where `close` follows the JSON value at `pos` (after whitespace), else `default`."""
    try:
        _, end = _JSON.raw_decode(text, len(text) - len(text[pos:].lstrip()))
    except (ValueError, RecursionError):
        return default
    end += len(text[end:]) - len(text[end:].lstrip())
    return end if text.startswith(close, end) else default


class HermesParser(ToolParser):
    name = "hermes"
    between, close = '", "arguments": ', "}</tool_call>"

    def spans(self, text: str, tools: Tools) -> list[Span]:
        return [
            b if isinstance(b, Span) else json_call_span(b[0], b[1], b[2], tools, "arguments")
            for b in _tagged_blocks(text, "<tool_call>", "</tool_call>", json_body=True)
        ]

    def forced_prefix(self, name: str | None) -> str:
        opening = '<tool_call>{"name": "'
        return opening if name is None else f'{opening}{name}", "arguments": '


class Llama3JsonParser(ToolParser):
    """Llama 3.x JSON calls: the reply is the call (or `;`-separated calls), after an optional
    `<|python_tag|>`. Without the tag, a reply is a call only when it opens with `{"name"`."""

    name = "llama3_json"
    markers = ("<|python_tag|>",)
    between, close = '", "parameters": ', "}"
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
    between, close = '", "arguments": ', "}]"
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
    between, close, json_name = ">\n", "</function>\n</tool_call>", False
    _FUNCTION = re.compile(r"\s*<function=([^>\n]{1,64})>(.*?)</function>\s*", re.DOTALL)
    _PARAMETER = re.compile(r"<parameter=([^>\n]{1,64})>(.*?)</parameter>", re.DOTALL)
    _TEXT = "TEXT"  # a string parameter's text: nothing that would close a block

    def _rest(self, name: str, schema: Any, tokens: Tokens, rules: list[str]) -> str:
        """Each declared parameter in the schema's order (the required ones present), as its
        type says: text for strings (one of the values, for an `enum`), else JSON."""
        schema = schema if isinstance(schema, dict) else {}
        props = schema.get("properties")
        required = set(schema.get("required") or ())
        items = []
        for key, prop in (props if isinstance(props, dict) else {}).items():
            rule, opening = f"p_{len(rules)}", quoted(f"<parameter={key}>\n")
            rules.append(f"{rule}: {opening} {self._value(prop, rules)}\n")
            items.append(rule if key in required else f"{rule}?")
        return " ".join([*items, literal(self.close, tokens)])

    def _value(self, prop: Any, rules: list[str]) -> str:
        end = "\n</parameter>\n"
        prop = prop if isinstance(prop, dict) else {}
        if prop.get("type") not in (None, "string"):  # what `_typed` decodes as JSON
            return f"{arguments(prop)} {quoted(end)}"
        options = prop.get("enum", [prop["const"]] if "const" in prop else None)
        if isinstance(options, list) and options and all(isinstance(o, str) for o in options):
            return f"({' | '.join(quoted(o) for o in options)}) {quoted(end)}"
        low, high = prop.get("minLength", 0), prop.get("maxLength")
        text = f"text_{low}_{high if isinstance(high, int) else 'n'}"
        if not any(r.startswith(f"{text}[lazy]") for r in rules):
            forbidden = ("</parameter>", "</function>", "</tool_call>")
            terminal = f"{self._TEXT}_{len(rules)}"
            rules.append(free_text(terminal, end, forbidden, low, high))
            rules.append(f"{text}[lazy]: {terminal}\n")
        return text

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
    between, close, json_name = "\n```json\n", f"\n```{CALL_END}{END}", False
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
    between, close, json_name = " <|constrain|>json<|message|>", "<|call|>", False
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
