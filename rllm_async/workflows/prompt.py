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
    """The opening chat of `task`, its `prompt_key` field as the user's turn; KeyError without it."""
    if prompt_key not in task:
        raise KeyError(
            f"task {task.get('id')!r} has no '{prompt_key}' field; set "
            "workflow.args.prompt_key to the field that holds the prompt"
        )
    return opening_messages(str(task[prompt_key]), system_prompt)
