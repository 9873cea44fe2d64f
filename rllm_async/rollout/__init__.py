"""Rollout recording: `RolloutContext` and the chat plumbing that turns model calls into Steps."""

from rllm_async.rollout.context import (
    ChatTemplateError,
    ChatTurn,
    ContextLengthError,
    RolloutContext,
)

__all__ = ["ChatTemplateError", "ChatTurn", "ContextLengthError", "RolloutContext"]
