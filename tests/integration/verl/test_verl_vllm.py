"""`backend.name: verl` with `rollout: vllm`: `rllm-async train` end to end on the CPU, verl's FSDP2
worker training a tiny Qwen3 and a real vLLM server (the project's engine, from `.venv-vllm/`)
sampling from it and reloading the trained weights after every step."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import yaml

from rllm_async.engines.vllm.server import REPO_VENV_PYTHON

HERE = Path(__file__).resolve().parent
RLLM = Path(sys.executable).parent / "rllm-async"

pytestmark = [
    pytest.mark.integration,
    pytest.mark.timeout(420),
    pytest.mark.skipif(
        not REPO_VENV_PYTHON.is_file(),
        reason=f"no {REPO_VENV_PYTHON}: run `python scripts/vllm_env.py setup` first",
    ),
]


@pytest.fixture(scope="module")
def tiny_qwen(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random two-layer Qwen3 (hidden 256, float32, untied) with its tokenizer."""
    from rllm_async.models.tiny_qwen import build_tiny_qwen

    return build_tiny_qwen(tmp_path_factory.mktemp("tiny-qwen"))


def write_config(tmp_path: Path, model: Path, mode: str = "async", **vllm: Any) -> Path:
    coordinator = {"pipeline_depth": 1, "max_staleness": 2, "weight_update": "latest"}
    config = {
        "name": "verl-vllm",
        "mode": mode,
        "run_dir": str(tmp_path / "runs"),
        "backend": {
            "name": "verl",
            "model_path": str(model),
            "device": "cpu",
            "gpus_per_node": 1,
            "max_seq_len": 128,
            "rollout": "vllm",
            # float32 serving: the first step's importance weights are 1 up to summation order.
            "vllm": {"dtype": "float32", "weights_dir": str(tmp_path / "weights"), **vllm},
        },
        "workflow": {
            "cls": "rllm_async.workflows.SingleTurnWorkflow",
            "args": {"reward_fn": "rewards:odd_length"},
        },
        "data": {"train": {"generator": "rewards:questions"}},
        "rollout": {"group_size": 4, "max_tokens": 16, "timeout_s": 60, "retries": 1},
        "coordinator": coordinator if mode == "async" else {},
        "train": {"total_steps": 3, "groups_per_step": 4},
        "checkpoint": {"at_end": False},
        "logging": {"progress_bar": False},
    }
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def processes_in(run_dir: Path) -> list[int]:
    """Pids whose working directory is `run_dir`: the vLLM servers a run started there."""
    found = []
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            try:
                if Path(os.readlink(proc / "cwd")) == run_dir:
                    found.append(int(proc.name))
            except OSError:
                continue
    return found


def train(config: Path) -> subprocess.CompletedProcess[str]:
    """`rllm-async train config` in this interpreter's environment (the verl one)."""
    return subprocess.run(
        [str(RLLM), "train", str(config)],
        cwd=config.parent,
        env={**os.environ, "PYTHONPATH": str(HERE)},  # `rewards`, by plain name
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=360,
    )


@pytest.mark.parametrize("mode", ["async", "sync"])
def test_rllm_async_train_with_verl_learner_and_vllm_rollout(
    tiny_qwen: Path, tmp_path: Path, mode: str
) -> None:
    proc = train(write_config(tmp_path, tiny_qwen, mode))
    assert proc.returncode == 0, proc.stdout
    run_dir = (tmp_path / "runs" / "verl-vllm").resolve()
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3]
    assert all(r["time/sync_s"] > 0 for r in records)
    # The servers' pause of the previous step's sync, none before the first step's.
    assert records[0]["vllm/pause_s"] == 0 and all(r["vllm/pause_s"] > 0 for r in records[1:])
    assert all(r["vllm/restarts"] == 0 for r in records)
    assert all(r["loss/num_tokens"] > 0 for r in records)
    # The servers start from the workers' weights: the first step trains on tokens sampled by the
    # policy being trained, so verl's log-probs equal the server's.
    first = records[0]
    assert first["staleness/max"] == 0
    assert abs(first["loss/is_weight_mean"] - 1.0) < 1e-3, first
    assert first["loss/sampler_kl"] < 1e-4, first
    if mode == "sync":
        # On-policy after every sync (pause mode `wait`): the reloaded server samples exactly the
        # weights verl just trained, so every step's importance weights are 1, not just the first.
        assert all(r["staleness/max"] == 0 for r in records)
        assert all(abs(r["loss/is_weight_mean"] - 1.0) < 1e-3 for r in records), records
    assert (run_dir / "vllm-0.log").is_file()
    assert processes_in(run_dir) == [], "the vLLM server was stopped with the run"
    assert not any((tmp_path / "weights").iterdir()), "the synced weights were deleted"


def test_a_server_that_cannot_start_stops_the_run_with_its_error(
    tiny_qwen: Path, tmp_path: Path
) -> None:
    """Ray and the workers are up when the server starts; its failure still ends the run at once,
    quoting the server's log."""
    broken = tmp_path / "broken-python"
    broken.write_text("#!/bin/sh\necho 'no vllm here' >&2\nexit 3\n")
    broken.chmod(0o755)
    start = time.monotonic()
    proc = train(write_config(tmp_path, tiny_qwen, python=str(broken)))
    assert proc.returncode == 1, proc.stdout
    assert "rllm-async: the run stopped:" in proc.stdout, proc.stdout
    assert "exited with" in proc.stdout and "no vllm here" in proc.stdout, proc.stdout
    assert "Traceback" not in proc.stdout, proc.stdout
    assert time.monotonic() - start < 120, "the run hung after the failed start"
    assert not any((tmp_path / "weights").iterdir()), "the weight files were deleted"
