"""The main job's pieces on the local backend: cached warm start, eval of a run's checkpoint."""

from __future__ import annotations

import asyncio
import json

import torch

from rllm_async.backends.local import LocalBackend
from rllm_async.backends.local import warm_start as warm_start_module
from rllm_async.cli import main
from rllm_async.config import config_from_dict
from rllm_async.tasks import countdown


def countdown_config(tmp_path, **extra) -> dict:
    return {
        "name": "cd",
        "run_dir": str(tmp_path / "runs"),
        "backend": {
            "name": "local",
            "model": "tiny",
            "max_seq_len": 64,
            "warm_start": {
                "examples": "rllm_async.tasks.countdown:warm_start_examples",
                "args": {"n": 64, "seed": 1},
                "steps": 20,
                "batch_size": 16,
                "cache_dir": str(tmp_path / "cache"),
            },
        },
        "workflow": {
            "cls": "rllm_async.workflows.SingleTurnWorkflow",
            "args": {"reward_fn": "rllm_async.tasks.countdown:reward"},
        },
        "data": {
            "train": {
                "generator": "rllm_async.tasks.countdown:generator",
                "args": {"n": 64, "seed": 2},
            },
            "eval": {
                "generator": "rllm_async.tasks.countdown:generator",
                "args": {"n": 16, "seed": 3},
            },
        },
        "rollout": {"group_size": 4, "max_tokens": 16},
        "algorithm": {"filter_zero_variance": False},  # a 20-step warm start rarely scores
        "train": {"total_steps": 2, "groups_per_step": 4},
        "logging": {"progress_bar": False},
        **extra,
    }


def weights(backend: LocalBackend) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in backend.learner.model.state_dict().items()}


def test_warm_start_changes_the_model_and_is_cached(tmp_path, monkeypatch) -> None:
    cfg = config_from_dict(countdown_config(tmp_path))
    plain = config_from_dict(
        {**countdown_config(tmp_path), "backend": {"name": "local", "model": "tiny"}}
    )
    fine_tunings = []  # the warm start's training runs; a cache hit loads its result instead
    fit = warm_start_module._fit
    monkeypatch.setattr(warm_start_module, "_fit", lambda *a: fine_tunings.append(fit(*a)))
    first = LocalBackend.from_config(cfg)
    cached = list((tmp_path / "cache").glob("*.pt"))
    assert len(cached) == 1 and len(fine_tunings) == 1
    second = LocalBackend.from_config(cfg)
    untouched = LocalBackend.from_config(plain)
    w1, w2, w0 = weights(first), weights(second), weights(untouched)
    assert all(torch.equal(w1[k], w2[k]) for k in w1), "the cache restores the same weights"
    assert any(not torch.equal(w1[k], w0[k]) for k in w1), "the warm start trained the model"
    assert len(fine_tunings) == 1, "the second starts from the cache, without fine-tuning"
    for b in (first, second, untouched):
        asyncio.run(b.close())


def test_eval_command_reports_held_out_accuracy_of_the_newest_checkpoint(tmp_path, capsys) -> None:
    import yaml

    cfg = countdown_config(tmp_path, checkpoint={"every_steps": 1})
    cfg["backend"]["learner"] = "process"  # as in the main job's config
    cfg_path = tmp_path / "cd.yaml"
    cfg_path.write_text(yaml.safe_dump(cfg))
    assert main(["train", str(cfg_path)]) == 0
    capsys.readouterr()
    run_dir = tmp_path / "runs" / "cd"
    assert main(["eval", str(run_dir)]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["checkpoint"].endswith("step_2")
    assert out["eval/n"] == 16 and out["eval/policy_version"] == 2
    assert 0.0 <= out["eval/accuracy"] <= 1.0
    assert main(["eval", str(tmp_path)]) == 2  # not a run directory


def test_warm_start_cache_follows_the_examples_text_not_their_generators_name(
    tmp_path, monkeypatch
) -> None:
    cfg = config_from_dict(countdown_config(tmp_path))
    asyncio.run(LocalBackend.from_config(cfg).close())
    monkeypatch.setattr(countdown, "prompt_for", lambda numbers, target: f"{numbers}={target}")
    asyncio.run(LocalBackend.from_config(cfg).close())
    assert len(list((tmp_path / "cache").glob("*.pt"))) == 2
