"""Workflows: how one rollout of one task goes."""

from rllm_async.workflows.base import Workflow
from rllm_async.workflows.env import Env, EnvWorkflow
from rllm_async.workflows.multi_turn import MultiTurnWorkflow, Tool
from rllm_async.workflows.openai_agent import OpenAIAgentWorkflow
from rllm_async.workflows.python_tool import PythonTool
from rllm_async.workflows.single_turn import SingleTurnWorkflow

__all__ = [
    "Env",
    "EnvWorkflow",
    "MultiTurnWorkflow",
    "OpenAIAgentWorkflow",
    "PythonTool",
    "SingleTurnWorkflow",
    "Tool",
    "Workflow",
]
