"""rllm-async: asynchronous RL for LLM policies and multi-turn agents, with bounded staleness."""

from rllm_async.callbacks import Callback
from rllm_async.config import Config, ConfigError, load_config
from rllm_async.health import FailureRateError, InfraFailureRateError, NoSignalError
from rllm_async.infra import InfraError, register_infra_error
from rllm_async.rollout import ChatTurn, RolloutContext
from rllm_async.trainer import UnifiedTrainer
from rllm_async.types import Episode, Step, Termination, Trajectory, TrajectoryGroup
from rllm_async.workflows import (
    Env,
    EnvWorkflow,
    MultiTurnWorkflow,
    OpenAIAgentWorkflow,
    SingleTurnWorkflow,
    Tool,
    Workflow,
)

__all__ = [
    "Callback",
    "ChatTurn",
    "Config",
    "ConfigError",
    "Env",
    "EnvWorkflow",
    "Episode",
    "FailureRateError",
    "InfraError",
    "InfraFailureRateError",
    "MultiTurnWorkflow",
    "NoSignalError",
    "OpenAIAgentWorkflow",
    "RolloutContext",
    "SingleTurnWorkflow",
    "Step",
    "Termination",
    "Tool",
    "Trajectory",
    "TrajectoryGroup",
    "UnifiedTrainer",
    "Workflow",
    "load_config",
    "register_infra_error",
]
__version__ = "0.1.0"
