"""Other APIs' conversations as chat messages, and a chat reply's tool calls: what the Responses and
Anthropic Messages APIs share on the chat path."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from rllm_async.rollout import ChatTurn, RolloutContext
from rllm_async.rollout.tool_calls import ParsedReply


class ChatMessages:
    """Chat messages built item by item. A tool call joins the assistant turn before it, so a reply
    sent back (its text, then its calls) is one assistant message, as the chat path recorded it:
    the next call extends that reply's tokens."""

    def __init__(self, system: str | None) -> None:
        self.messages: list[dict[str, Any]] = []
        self._reasoning: str | None = None  # for the next assistant message
        if system:
            self.say("system", system)

    def reason(self, text: str) -> None:
        """Reasoning of the assistant message that follows: its `reasoning_content`, which chat
        templates such as Qwen3's render, as on the chat path."""
        self._reasoning = text if self._reasoning is None else self._reasoning + text

    def say(self, role: str, text: str) -> None:
        """A message (`developer` is a system turn)."""
        self._append({"role": "system" if role == "developer" else role, "content": text})

    def call(self, call_id: str, name: str, arguments: str) -> None:
        """A tool call the assistant made (`arguments` a JSON object's text)."""
        last = self.messages[-1] if self.messages else None
        if last is None or last["role"] != "assistant" or self._reasoning is not None:
            last = {"role": "assistant", "content": ""}
            self._append(last)
        function = {"name": name, "arguments": arguments}
        last.setdefault("tool_calls", []).append(
            {"id": call_id, "type": "function", "function": function}
        )

    def result(self, call_id: str, text: str) -> None:
        """A tool's result for the call `call_id`."""
        self._append({"role": "tool", "content": text, "tool_call_id": call_id})

    def _append(self, message: dict[str, Any]) -> None:
        if message["role"] == "assistant" and self._reasoning is not None:
            message["reasoning_content"], self._reasoning = self._reasoning, None
        self.messages.append(message)


def reply_calls(turn: ChatTurn, parallel: bool) -> list[dict[str, Any]]:
    """The reply's tool calls; the first only when parallel calls are off (`keep_first_call` has
    then cut the reply, unless its syntax could not be cut)."""
    calls: list[dict[str, Any]] = turn.message.get("tool_calls") or []
    return calls if parallel else calls[:1]


def keep_first_call(
    ctx: RolloutContext,
    turn: ChatTurn,
    messages: list[dict[str, Any]],
    *,
    tools: list[dict[str, Any]] | None,
    prefix: str,
    template_kwargs: dict[str, Any] | None,
    stop: Sequence[str] | str,
) -> None:
    """With parallel tool calls off, cut a reply of several calls after its first: the recorded
    step keeps the sampled tokens up to the end of that call (what the client sees; the calls
    after it are neither returned nor trained), and the reply as returned is remembered for those
    tokens, so that the next turn extends them (its prompt closes the turn with the end-of-turn
    token, a prompt token). A reply whose first call no prefix of its tokens parses to (one JSON
    array of calls) keeps every token: the next turn then starts a new sequence."""
    calls = turn.message.get("tool_calls") or []
    if len(calls) < 2:
        return
    step, tok = turn.step, ctx.policy.tokenizer

    def first_call(k: int) -> ParsedReply | None:
        parsed = ctx.parser.read(
            tok, step.prompt_ids, step.completion_ids[:k], prefix=prefix, stop=stop, tools=tools
        )
        found = parsed.tool_calls[:1]
        return parsed if found and found[0]["function"] == calls[0]["function"] else None

    lo, hi = 1, len(step.completion_ids)  # the shortest prefix that parses to the first call
    while lo < hi:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if first_call(mid) is not None else (mid + 1, hi)
    parsed = first_call(lo)
    if parsed is None or len(parsed.tool_calls) != 1:
        return
    shown = {**turn.message, "content": parsed.content, "tool_calls": calls[:1]}
    step.completion_ids = step.completion_ids[:lo]
    step.logprobs = step.logprobs[:lo]
    step.versions = step.versions[:lo]
    step.info["dropped_tool_calls"] = len(calls) - 1
    ctx.chat_history().add(
        messages, shown, tools, step.prompt_ids, step.completion_ids, template_kwargs
    )
    turn.message = shown
