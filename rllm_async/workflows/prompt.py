"""The opening chat of a rollout, built one way for the single-turn, multi-turn and env workflows."""

from __future__ import annotations

from typing import Any


def opening_messages(content: Any, system_prompt: str | None) -> list[dict[str, Any]]:
    """The system prompt (when given), then `content` as the user's first turn."""
    messages: list[dict[str, Any]] = [{"role": "user", "content": content}]
    if system_prompt:
        messages.insert(0, {"role": "system", "content": system_prompt})
    return messages


def task_messages(
    task: dict[str, Any], prompt_key: str, system_prompt: str | None
) -> list[dict[str, Any]]:
    """The opening chat of `task`: its `prompt_key` field as the user's turn, or, when the field is
    a list of chat messages (the conversational format), those messages after the system prompt
    (unless they open with their own). KeyError without the field, ValueError for a malformed list."""
    if prompt_key not in task:
        raise KeyError(
            f"task {task.get('id')!r} has no '{prompt_key}' field; set "
            "workflow.args.prompt_key to the field that holds the prompt"
        )
    prompt = task[prompt_key]
    if not isinstance(prompt, list):
        return opening_messages(str(prompt), system_prompt)
    for i, msg in enumerate(prompt):
        if not (isinstance(msg, dict) and isinstance(msg.get("role"), str) and "content" in msg):
            raise ValueError(
                f"task {task.get('id')!r}: '{prompt_key}' is a list, so it must be chat messages "
                f'like {{"role": "user", "content": "..."}}; item {i} is {str(msg)[:80]}'
            )
    messages = [dict(m) for m in prompt]  # copies: a rollout never mutates the dataset's rows
    if system_prompt and (not messages or messages[0]["role"] != "system"):
        messages.insert(0, {"role": "system", "content": system_prompt})
    return messages
