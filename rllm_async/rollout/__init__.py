"""Rollout recording: `RolloutContext` and the chat plumbing that turns model calls into Steps."""

from rllm_async.rollout.context import (
    CallMeter,
    ChatTemplateError,
    ChatTurn,
    ContextLengthError,
    RolloutContext,
)

__all__ = ["CallMeter", "ChatTemplateError", "ChatTurn", "ContextLengthError", "RolloutContext"]
