"""The `sim` backend: a deterministic, model-free simulation of generation and training."""

from rllm_async.backends.sim.backend import SimBackend, SimSyncError
from rllm_async.backends.sim.options import SimOptions
from rllm_async.backends.sim.policy import SimPolicy
from rllm_async.backends.sim.server import ProcessorSharing, ps_makespan, ps_rate, step_profile
from rllm_async.backends.sim.workloads import DRIFTING_WORKLOADS, WORKLOADS, workload_config

__all__ = [
    "DRIFTING_WORKLOADS",
    "WORKLOADS",
    "ProcessorSharing",
    "SimBackend",
    "SimOptions",
    "SimPolicy",
    "SimSyncError",
    "ps_makespan",
    "ps_rate",
    "step_profile",
    "workload_config",
]
