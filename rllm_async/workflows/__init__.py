"""Workflows: how one rollout of one task goes."""

from rllm_async.workflows.base import (
    ChatTemplateError,
    ChatTurn,
    ContextLengthError,
    RolloutContext,
    Workflow,
)
from rllm_async.workflows.env import Env, EnvWorkflow
from rllm_async.workflows.multi_turn import MultiTurnWorkflow, Tool
from rllm_async.workflows.openai_agent import OpenAIAgentWorkflow
from rllm_async.workflows.single_turn import SingleTurnWorkflow

__all__ = [
    "ChatTemplateError",
    "ChatTurn",
    "ContextLengthError",
    "Env",
    "EnvWorkflow",
    "MultiTurnWorkflow",
    "OpenAIAgentWorkflow",
    "RolloutContext",
    "SingleTurnWorkflow",
    "Tool",
    "Workflow",
]
