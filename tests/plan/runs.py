"""Recorded sim runs for the planner's tests: W1 through the real trainer on the virtual clock."""

from __future__ import annotations

from pathlib import Path

from rllm_async.backends.sim import workload_config
from rllm_async.plan.simulate import QUIET
from rllm_async.trainer import UnifiedTrainer

# W1 (32 groups of 8 per step): smaller batches make one run's step time vary by +-5% with the
# seed (the step waits for its longest rollouts), so a run could not be predicted within 5%.
STEPS = 20


def record_run(root: Path, *overrides: str) -> Path:
    """A W1 run of `STEPS` steps (unless `overrides` say otherwise) recorded into `root`."""
    config = workload_config(
        "W1", [f"run_dir={root}", *QUIET, f"train.total_steps={STEPS}", *overrides]
    )
    UnifiedTrainer(config).run()
    return root
