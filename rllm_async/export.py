"""`rllm-async export`: a run's checkpoint as a Hugging Face model directory, written by the
backend that trained it (its `export` hook), all at once or not at all."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

from rllm_async import checkpoint
from rllm_async.config import ConfigError, load_config

# Backends whose weights live elsewhere, and the route their own project documents.
ROUTES = {
    "verl": (
        "verl writes FSDP shards; merge them with verl's model merger: python -m "
        "verl.model_merger merge --backend fsdp --local_dir "
        "RUN_DIR/checkpoints/step_N/backend/verl --target_dir OUT"
    ),
    "tinker": (
        "the weights stay on the Tinker service; save a sampler checkpoint "
        "(save_weights_for_sampler), then tinker_cookbook.weights.download and "
        "tinker_cookbook.weights.build_hf_model merge its LoRA adapter into the base model "
        "(see docs/tinker.md)"
    ),
    "sim": "the sim backend has no model to export",
}


def export_run(run_dir: Path, out: Path, which: str | None = None) -> Path:
    """Export a checkpoint of `run_dir` into the new directory `out`; returns the checkpoint used.

    `which` is a step number N (`checkpoints/step_N`), a checkpoint directory, or None (the newest).
    """
    if not (run_dir / "config.yaml").is_file():
        raise ConfigError(f"{run_dir} has no config.yaml: pass a run directory such as runs/<name>")
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ConfigError(f"--out {out} exists and is not empty: choose a new directory")
    config = load_config(run_dir / "config.yaml")
    name = config.backend.name
    if name in ROUTES:
        raise ConfigError(f"rllm-async export does not export backend '{name}': {ROUTES[name]}")
    source = _checkpoint(run_dir, which)
    from rllm_async.backends import get_backend_factory

    exporter = getattr(get_backend_factory(name), "export", None)
    if exporter is None:
        raise ConfigError(f"backend '{name}' has no export: its class defines no `export` hook")
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        try:
            exporter(config, source / "backend", staging / "model")
        except (OSError, ValueError, ImportError) as e:
            raise ConfigError(f"cannot export {source}: {e}") from e
        if out.exists():
            out.rmdir()  # empty, checked above
        os.rename(staging / "model", out)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return source


def _checkpoint(run_dir: Path, which: str | None) -> Path:
    """The checkpoint `--checkpoint` names: a step of the run, a directory, or the newest."""
    if which is None:
        return checkpoint.resolve(run_dir, "RUN_DIR")
    if which.isdigit():
        path = checkpoint.step_path(run_dir, which)
        if not checkpoint.is_checkpoint(path):
            steps = [p.name.removeprefix("step_") for p in checkpoint.checkpoints(run_dir)]
            raise ConfigError(
                f"--checkpoint {which}: {run_dir} has no complete checkpoint of step {which} "
                f"(it has: {', '.join(steps) or 'none'})"
            )
        return path
    return checkpoint.resolve(Path(which), "--checkpoint")
