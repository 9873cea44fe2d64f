"""Pieces of the grammars that constrain a forced tool call (`ToolParser.forced_grammar`), in
llguidance's Lark dialect (`rllm_async.grammar`): literals, special tokens and embedded schemas.

A marker that the policy's tokenizer writes as one token (`tokens`: its text -> its id) is referred
to by id (`<[id]>`): llguidance's literals never match a special token, and it counts every added
token of a Hugging Face tokenizer as special (Qwen's `</tool_call>` too), while an id matches it
whether the tokenizer calls it special or not.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from rllm_async.grammar import embedded_schema

Tokens = Mapping[str, int]  # marker text -> the one token id the tokenizer writes it with


def marker_tokens(markers: Iterable[str], encode: Callable[[str], list[int]]) -> dict[str, int]:
    """Each of `markers` that `encode` writes as one token, with its id."""
    return {m: ids[0] for m in markers if len(ids := encode(m)) == 1}


def literal(text: str, tokens: Tokens) -> str:
    """`text` as a sequence of Lark items: its markers in `tokens` by id, the rest quoted."""
    if not text:
        return ""
    if not tokens:
        return quoted(text)
    markers = re.compile("|".join(re.escape(m) for m in sorted(tokens, key=len, reverse=True)))
    items: list[str] = []
    pos = 0
    for m in markers.finditer(text):
        if m.start() > pos:
            items.append(quoted(text[pos : m.start()]))
        items.append(f"<[{tokens[m.group(0)]}]>")
        pos = m.end()
    if pos < len(text):
        items.append(quoted(text[pos:]))
    return " ".join(items)


def quoted(text: str) -> str:
    """A Lark string literal of `text`."""
    return json.dumps(text, ensure_ascii=False)


def arguments(schema: Any) -> str:
    """A JSON value following `schema` (an object when the tool declares no parameters)."""
    if not isinstance(schema, dict) or not schema:
        schema = {"type": "object"}
    return "%json" + json.dumps(embedded_schema(schema), ensure_ascii=False)


def free_text(name: str, close: str, forbidden: tuple[str, ...], low: Any, high: Any) -> str:
    """Lark terminal `name`: text without `forbidden` (of `low` to `high` characters, where these
    are counts), then `close`; to be matched lazily, up to the first `close` (a greedy lexeme would
    swallow the start of `close` and never end)."""
    low = low if isinstance(low, int) and low >= 0 else 0
    count = f"{{{low},{high}}}" if isinstance(high, int) and high >= low else f"{{{low},}}"
    body = "|".join(re.escape(f) for f in forbidden).replace("/", "\\/")
    return (
        f"{name}_BODY: /(?s:.){count}/ & ~/(?s:.*)({body})(?s:.*)/\n"
        f"{name}: {name}_BODY {quoted(close)}\n"
    )
