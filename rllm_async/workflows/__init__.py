"""Workflows: how one rollout of one task goes."""

from rllm_async.workflows.base import RolloutContext, Workflow
from rllm_async.workflows.single_turn import SingleTurnWorkflow

__all__ = ["RolloutContext", "SingleTurnWorkflow", "Workflow"]
