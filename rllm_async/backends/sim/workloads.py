"""The benchmark workloads of the sim backend, as configs: W1-W4 stationary, D1-D4 drifting."""

from __future__ import annotations

from typing import Any

from rllm_async.algorithms.sim_workload import LEN_CAP, LEN_MEDIAN, LEN_SIGMA
from rllm_async.config import Config, ConfigError, load_config

KL_PER_VERSION = 0.01  # D4's sampler KL per version of staleness at the start, nats per token


def _workload(
    *,
    groups_per_step: int = 32,
    len_sigma: float = LEN_SIGMA,
    len_cap: int = LEN_CAP,
    train_ratio: float = 0.3,
    timeout_s: float = 1200.0,
    exception_rate: float = 0.0,
    hang_rate: float = 0.0,
    sync_fail_every: int = 0,
    drift: dict[str, Any] | None = None,
    backend_drift: dict[str, Any] | None = None,
    auto: dict[str, Any] | None = None,
) -> dict[str, Any]:
    slots = 512
    return {
        "backend": {
            "name": "sim",
            "latency": "ps",
            "slots": slots,
            "rmax": 20000.0,
            "n_half": 64.0,
            "t_sync": 0.5,
            "train_ratio": train_ratio,
            "sync_fail_every": sync_fail_every,
            **(backend_drift or {}),
        },
        "workflow": {
            "cls": "rllm_async.workflows.sim:SimWorkflow",
            "args": {
                "len_median": LEN_MEDIAN,
                "len_sigma": len_sigma,
                "len_cap": len_cap,
                "exception_rate": exception_rate,
                "hang_rate": hang_rate,
                **(drift or {}),
            },
        },
        "data": {
            "train": {"generator": "rllm_async.workflows.sim:synthetic_tasks", "args": {"n": 1024}}
        },
        "train": {"groups_per_step": groups_per_step},
        # timeout_s: a few times the longest legitimate rollout at full concurrency (cap tokens
        # at rmax / (slots + n_half) tok/s), so only injected hangs are reclaimed by it.
        "rollout": {
            "group_size": 8,
            "max_tokens": len_cap,
            "timeout_s": timeout_s,
            "max_concurrency": slots,
        },
        **({"coordinator": {"auto": auto}} if auto else {}),
    }


WORKLOADS: dict[str, dict[str, Any]] = {
    "W1": _workload(),  # reasoning
    "W2": _workload(train_ratio=1.0),  # balanced
    "W3": _workload(groups_per_step=16, len_sigma=1.3, len_cap=32768, timeout_s=3600.0),
    "W4": _workload(exception_rate=0.02, hang_rate=0.005, sync_fail_every=50),  # faults
}

DRIFTING_WORKLOADS: dict[str, dict[str, Any]] = {
    # Drifting over 60 policy versions (the benchmarks' run length; `--set
    # workflow.args.drift_steps=300` stretches it). D1: reasoning whose completions grow 3x.
    "D1": _workload(drift={"drift_steps": 60, "len_growth": 3.0}),
    # D2: balanced, with a tool call whose latency goes from 5 s to 60 s, and learner seconds per
    # token that halve (e.g. a larger learner allocation) over the same 60 steps.
    "D2": _workload(
        train_ratio=1.0,
        drift={"drift_steps": 60, "tool_s": 5.0, "tool_growth": 12.0},
        backend_drift={"train_drift_steps": 60, "train_growth": 0.5},
    ),
    # D3: an agent: reasoning whose tool call after each reply goes from 5 s to 60 s over the
    # same 60 steps. Generation-bound, with ever fewer of its rollouts in the engine at once.
    "D3": _workload(drift={"drift_steps": 60, "tool_s": 5.0, "tool_growth": 12.0}),
    # D4: reasoning whose policy moves ever less per step (a decaying learning rate): the
    # sampler-learner KL a version of staleness brings falls 10x over the same 60 steps, under a
    # KL budget that early on only a staleness of about one keeps; `auto` starts at d = 1, which
    # keeps it (at its default, 2, its first steps go over the budget).
    "D4": _workload(
        backend_drift={"kl_per_version": KL_PER_VERSION, "kl_growth": 0.1, "kl_drift_steps": 60},
        auto={"max_sampler_kl": 1.5 * KL_PER_VERSION, "initial": 1},
    ),
}


def workload_config(name: str, overrides: list[str] | None = None) -> Config:
    """The Config of workload `name` with `key=value` overrides applied (as on the command line)."""
    every = {**WORKLOADS, **DRIFTING_WORKLOADS}
    if name not in every:
        raise ConfigError(f"unknown sim workload '{name}': choose one of {', '.join(every)}")
    return load_config(overrides=overrides, defaults=every[name])
