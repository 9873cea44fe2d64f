"""Runs under random heavy-tailed latencies for property tests: the drawn schedule (depth d <= K,
batch, group size, Pareto tail, training time, seed) and the trainer on the fake backend it sets."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

from hypothesis import strategies as st

from rllm_async.trainer import UnifiedTrainer
from tests.fakes import FakeBackend, ScriptedWorkflow, make_config, tasks


@st.composite
def schedules(draw: st.DrawFn) -> dict[str, Any]:
    d = draw(st.integers(0, 3))
    return {
        "d": d,
        "k": d + draw(st.integers(0, 3)),
        "gps": draw(st.integers(1, 4)),
        "group_size": draw(st.integers(1, 4)),
        "alpha": draw(st.floats(1.05, 3.0)),  # Pareto tail index: small = very heavy tail
        "scale": draw(st.floats(0.01, 2.0)),
        "train_s": draw(st.floats(0.0, 3.0)),
        "seed": draw(st.integers(0, 2**16)),
    }


def trainer(
    tmp_path: Path, s: dict[str, Any], rollout: dict[str, Any], coordinator: dict[str, Any]
) -> tuple[UnifiedTrainer, FakeBackend]:
    """Six steps of `s["gps"]` groups of rollouts whose latencies follow the drawn Pareto tail and
    whose rewards are coin flips; `rollout` and `coordinator`: further keys of those sections."""
    rng = random.Random(s["seed"])
    backend = FakeBackend(
        latency=lambda: rng.paretovariate(s["alpha"]) * s["scale"], train_s=s["train_s"]
    )
    workflow = ScriptedWorkflow(reward=lambda task, i, a: float(rng.random() < 0.5))
    cfg = make_config(
        tmp_path,
        train={"total_steps": 6, "groups_per_step": s["gps"], "micro_batch_groups": 1},
        rollout={"group_size": s["group_size"], "min_group_size": 1, "timeout_s": 1e6, **rollout},
        coordinator={"pipeline_depth": s["d"], "max_staleness": s["k"], **coordinator},
        algorithm={"filter_zero_variance": False},
    )
    return UnifiedTrainer(cfg, backend=backend, workflow=workflow, train_tasks=tasks(50)), backend
