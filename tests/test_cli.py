"""`rllm-async train` at the terminal, as a process of its own: Ctrl-C writes a final checkpoint
that a resumed run continues from, a second Ctrl-C exits at once, and the log shows that
generation goes on while no step is recorded; and the collector settings the command runs under."""

from __future__ import annotations

import asyncio
import gc
import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml

from rllm_async import checkpoint
from rllm_async.cli import collector_for_rollouts
from rllm_async.workflows import SingleTurnWorkflow

ROOT = Path(__file__).resolve().parents[1]
WAIT_S = 300.0  # a bound for a hung process only: every wait below ends on an event


class CloseHangs(SingleTurnWorkflow):
    """Countdown's workflow whose `close` never returns: a run stuck in its shutdown."""

    async def close(self) -> None:
        await asyncio.Event().wait()


def job(tmp_path: Path, **workflow: Any) -> Path:
    """A config of countdown on the tiny built-in model that would train for hours."""
    config = {
        "name": "ctrl-c",
        "run_dir": str(tmp_path / "runs"),
        "backend": {"name": "local", "model": "tiny", "max_seq_len": 64, "max_batch": 16},
        "data": {
            "train": {
                "generator": "rllm_async.tasks.countdown:generator",
                "args": {"n": 1000, "seed": 0, "min_numbers": 2, "max_numbers": 2},
            }
        },
        "workflow": {
            "cls": "rllm_async.workflows.SingleTurnWorkflow",
            "args": {"reward_fn": "rllm_async.tasks.countdown:reward"},
            **workflow,
        },
        "rollout": {"group_size": 4, "max_tokens": 12},
        "algorithm": {"filter_zero_variance": False},  # an untrained model rarely scores
        "train": {"total_steps": 100_000, "groups_per_step": 2},
        "checkpoint": {"every_steps": 0, "at_end": False},
        "logging": {"progress_bar": False},
    }
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def start(config: Path, tmp_path: Path, *overrides: str) -> tuple[subprocess.Popen[bytes], Path]:
    """`rllm-async train CONFIG` in a process of its own; its stderr goes to a file."""
    err = tmp_path / f"stderr-{time.monotonic_ns()}.txt"
    with err.open("wb") as sink:
        proc = subprocess.Popen(
            [sys.executable, "-m", "rllm_async.cli", "train", str(config), *overrides],
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=sink,
        )
    return proc, err


def wait_until(what: str, done: Callable[[], bool], proc: subprocess.Popen[bytes]) -> None:
    deadline = time.monotonic() + WAIT_S
    while not done():
        assert proc.poll() is None, f"the run ended before {what}"
        assert time.monotonic() < deadline, f"no {what} after {WAIT_S:.0f} s"
        time.sleep(0.05)


def records(run_dir: Path) -> list[dict[str, Any]]:
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_ctrl_c_writes_a_checkpoint_that_a_resumed_run_continues_from(tmp_path) -> None:
    config = job(tmp_path)
    run_dir = tmp_path / "runs" / "ctrl-c"
    proc, err = start(config, tmp_path)
    wait_until("two steps", lambda: len(records(run_dir)) >= 2, proc)
    proc.send_signal(signal.SIGINT)
    out, _ = proc.communicate(timeout=WAIT_S)
    stderr = err.read_text()
    assert proc.returncode == 130, stderr
    assert "interrupted: writing a final checkpoint" in stderr
    last = records(run_dir)[-1]["step"]
    assert json.loads(out)["steps"] == len(records(run_dir))
    assert [checkpoint.step_of(p) for p in checkpoint.checkpoints(run_dir)] == [last]
    assert f"interrupted at step {last}; checkpoint written to" in stderr

    resumed, err = start(config, tmp_path, f"train.total_steps={last + 2}")
    resumed.communicate(timeout=WAIT_S)
    assert resumed.returncode == 0, err.read_text()
    steps = [r["step"] for r in records(run_dir)]
    assert steps[-2:] == [last + 1, last + 2], "the resumed run continues at the next step"


def test_a_second_ctrl_c_exits_at_once(tmp_path) -> None:
    # The workflow's close hangs after the final checkpoint: only the second Ctrl-C ends the run.
    config = job(tmp_path, cls="tests.test_cli.CloseHangs")
    run_dir = tmp_path / "runs" / "ctrl-c"
    proc, err = start(config, tmp_path)
    wait_until("a step", lambda: len(records(run_dir)) >= 1, proc)
    proc.send_signal(signal.SIGINT)
    wait_until("the final checkpoint", lambda: "checkpoint written to" in err.read_text(), proc)
    proc.send_signal(signal.SIGINT)
    proc.communicate(timeout=WAIT_S)
    stderr = err.read_text()
    assert proc.returncode == 130, stderr
    assert stderr.rstrip().endswith("rllm-async: interrupted again: exiting now")
    assert checkpoint.latest(run_dir) is not None, "the complete checkpoint stays"


def test_the_log_says_that_generation_goes_on_while_no_step_is_recorded(tmp_path) -> None:
    # Every group is filtered (an untrained model never solves countdown), so no step is taken.
    config = job(tmp_path)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(
        [
            sys.executable,
            "-c",
            "import sys; from rllm_async import step_record, cli; step_record.HEARTBEAT_S = 0.0; "
            "sys.exit(cli.main(sys.argv[1:]))",
            "train",
            str(config),
            "algorithm.filter_zero_variance=true",
            "algorithm.filter_unsolved=true",
            "algorithm.no_signal_steps=2",
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=WAIT_S,
    )
    assert proc.returncode == 1, proc.stderr
    assert "INFO: local backend: tiny runs on the native decoder" in proc.stderr
    assert re.search(
        r"INFO: generating: 1 rollouts finished in the \d+ s since the last record, mean reward "
        r"[0-9.e-]+, 0 of 1 correct",
        proc.stderr,
    )
    assert "rllm-async: the run stopped: the last 4 groups all had equal rewards" in proc.stderr


def test_the_collector_for_rollouts_freezes_start_up_and_collects_young_objects_later() -> None:
    before = (gc.get_threshold(), gc.get_freeze_count())
    with collector_for_rollouts():
        young, *older = gc.get_threshold()
        assert gc.get_freeze_count() > before[1], "what start-up made is frozen"
        assert young > before[0][0] and tuple(older) == before[0][1:]
    assert (gc.get_threshold(), gc.get_freeze_count()) == before, "the process's settings are back"
