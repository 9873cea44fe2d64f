"""Other APIs' conversations as chat messages, and a chat reply's tool calls: what the Responses and
Anthropic Messages APIs share on the chat path."""

from __future__ import annotations

from typing import Any

from rllm_async.rollout import ChatTurn


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
    """The reply's tool calls; the first only when parallel calls are off (the recorded tokens keep
    every call the model wrote)."""
    calls: list[dict[str, Any]] = turn.message.get("tool_calls") or []
    return calls if parallel else calls[:1]
