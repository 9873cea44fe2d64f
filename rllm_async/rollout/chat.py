"""Chat plumbing shared by `RolloutContext.chat` and the gateway: rendering and token-in/token-out.

A later turn's prompt extends the exact tokens of an earlier reply (`ChatHistory`); only the new
messages are rendered (`continuation_ids`). Tool-call parsing is in `rllm_async.rollout.tool_calls`.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from rllm_async.protocols import Tokenizer

_USER = {"role": "user", "content": "x"}


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


def render(
    tok: Tokenizer,
    messages: list[dict[str, Any]],
    tools: Sequence[dict[str, Any]] | None,
    template_kwargs: dict[str, Any] | None = None,
    *,
    add_generation_prompt: bool = True,
) -> list[int]:
    """The chat template's tokens; `template_kwargs` (e.g. `reasoning_effort`) go to it when given."""
    tools_arg = list(tools) if tools else None
    extra = template_kwargs or {}
    return list(
        tok.apply_chat_template(
            messages, tools=tools_arg, add_generation_prompt=add_generation_prompt, **extra
        )
    )


def continuation_ids(
    tok: Tokenizer,
    reply: dict[str, Any],
    completion_ids: Sequence[int],
    new_messages: Sequence[dict[str, Any]],
    tools: Sequence[dict[str, Any]] | None,
    template_kwargs: dict[str, Any] | None = None,
) -> list[int]:
    """Tokens that follow an assistant turn's exact `completion_ids` to render `new_messages`.

    The template renders a fixed user turn and a stand-in for `reply` (its tool calls, which
    templates such as gpt-oss's name in the tool turns that answer them) with and without the new
    messages; what follows the reply's end-of-turn token in the longer rendering is the new turns,
    preceded by what the template puts after an assistant turn (a newline, for ChatML). The
    end-of-turn token is the EOS or the special token the completion ended on (gpt-oss's `<|call|>`
    after a call), found by rank, so a template that renders the reply differently once turns
    follow it (Qwen3 drops its empty `<think>` block) still gives the new turns only. The EOS
    itself comes first when the completion did not end with a special token (a length- or
    stop-string-truncated reply).
    """
    calls = reply.get("tool_calls")
    stand_in = {"role": "assistant", "content": "", "tool_calls": calls} if calls else None
    chat = template_messages([_USER, stand_in or {"role": "assistant", "content": "y"}])
    base = render(tok, chat, tools, template_kwargs, add_generation_prompt=False)
    full = render(tok, [*chat, *template_messages(new_messages)], tools, template_kwargs)
    eos = tok.eos_token_id
    # A completion that ends on a special token other than the EOS stopped there (gpt-oss's
    # `<|call|>`): the template closes the reply with it too.
    stopped = [t for t in completion_ids[-1:] if tok.decode([t]) == ""]
    turn_ends = {eos, *stopped}
    closing = [] if stopped else [eos]
    if not turn_ends & set(base):
        if full[: len(base)] != base:
            raise ValueError(
                "the chat template does not render new turns as a suffix of the history"
            )
        return [*closing, *full[len(base) :]]
    base_ends = [i for i, t in enumerate(base) if t in turn_ends]
    ends = [i for i, t in enumerate(full) if t in turn_ends]
    k = len(base_ends)  # the reply's end is the k-th in both renderings
    before = base_ends[-2] + 1 if k > 1 else 0  # the turns before the reply's
    if len(ends) < k or full[:before] != base[:before]:
        raise ValueError("the chat template renders the turns before the reply differently")
    return [*closing, *full[ends[k - 1] + 1 :]]


@dataclass(slots=True)
class _Tip:
    keys: tuple[tuple[Any, ...], ...]  # the call's messages plus the reply it produced
    reply: dict[str, Any]
    tools: str
    prompt_ids: list[int]
    completion_ids: list[int]


class ChatHistory:
    """The token-in/token-out memory of one actor: every reply and the exact tokens behind it."""

    def __init__(self) -> None:
        self._tips: list[_Tip] = []

    def copy(self) -> ChatHistory:
        """A history with the same replies, which later turns of either extend independently."""
        out = ChatHistory()
        out._tips = list(self._tips)
        return out

    def add(
        self,
        messages: Sequence[dict[str, Any]],
        reply: dict[str, Any],
        tools: Sequence[dict[str, Any]] | None,
        prompt_ids: list[int],
        completion_ids: list[int],
        template_kwargs: dict[str, Any] | None = None,
    ) -> None:
        keys = tuple(message_key(m) for m in (*messages, reply))
        tools_key = _tools_key(tools, template_kwargs)
        self._tips.append(_Tip(keys, reply, tools_key, prompt_ids, completion_ids))

    def prompt(
        self,
        tok: Tokenizer,
        messages: Sequence[dict[str, Any]],
        tools: Sequence[dict[str, Any]] | None,
        template_kwargs: dict[str, Any] | None = None,
    ) -> tuple[list[int], bool]:
        """The prompt for `messages`: an earlier reply's exact tokens extended by the new turns
        when `messages` continue that reply's chat (True), else a fresh rendering (False)."""
        keys = tuple(message_key(m) for m in messages)
        tools_key = _tools_key(tools, template_kwargs)
        best = None
        for tip in self._tips:
            n = len(tip.keys)
            longer = best is None or n > len(best.keys)
            if longer and tip.tools == tools_key and n <= len(keys) and keys[:n] == tip.keys:
                best = tip
        if best is not None:
            try:
                new = messages[len(best.keys) :]
                tail = continuation_ids(
                    tok, best.reply, best.completion_ids, new, tools, template_kwargs
                )
            except ValueError:
                pass  # a template that cannot render a suffix: render the whole chat
            else:
                return [*best.prompt_ids, *best.completion_ids, *tail], True
        return render(tok, template_messages(messages), tools, template_kwargs), False


def _tools_key(
    tools: Sequence[dict[str, Any]] | None, template_kwargs: dict[str, Any] | None
) -> str:
    """What else than the messages a rendering depends on."""
    return json.dumps([list(tools or ()), template_kwargs or {}], sort_keys=True, default=str)
