"""Rollout recording: `RolloutContext` and the chat plumbing that turns model calls into Steps."""

from rllm_async.rollout.context import (
    COMPACT_PROMPT,
    SUMMARY_TEMPLATE,
    CallMeter,
    ChatTemplateError,
    ChatTurn,
    ContextLengthError,
    RolloutContext,
)
from rllm_async.rollout.pause import Pause, SyncPause

__all__ = [
    "COMPACT_PROMPT",
    "SUMMARY_TEMPLATE",
    "CallMeter",
    "ChatTemplateError",
    "ChatTurn",
    "ContextLengthError",
    "Pause",
    "RolloutContext",
    "SyncPause",
]
