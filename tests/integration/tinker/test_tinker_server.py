"""The Tinker backend against a real Tinker API server: SkyRL 0.3.0's, JAX on CPU, on 127.0.0.1.

SkyRL 0.3.0 speaks the JSON protocol of tinker <= 0.24, so these run in .venv-skyrl:
    python scripts/tinker_server/manage.py setup
    .venv-skyrl/bin/python -m pytest -m integration tests/integration/tinker/test_tinker_server.py
"""

from __future__ import annotations

import asyncio
import importlib.util
import math
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from rllm_async.config import Config, ConfigError, config_from_dict
from rllm_async.protocols import SamplingParams
from rllm_async.types import Step, Trajectory, TrajectoryGroup

tinker = pytest.importorskip("tinker")

from rllm_async.backends.tinker import TinkerBackend, sdk  # noqa: E402  (needs the SDK)

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(
        sdk.sdk_version() >= (0, 25),
        reason=f"tinker {tinker.__version__} sends protobuf, SkyRL 0.3.0 reads JSON: run under "
        ".venv-skyrl (tinker 0.24.1), see docs/tinker.md",
    ),
]

REPO = Path(__file__).resolve().parents[3]
GREEDY = SamplingParams(temperature=0.0, max_tokens=8)


def _manage() -> Any:
    spec = importlib.util.spec_from_file_location(
        "manage", REPO / "scripts/tinker_server/manage.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A SkyRL Tinker API server on a free local port, stopped (with its engine) afterwards."""
    manage = _manage()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = manage.start(tmp_path_factory.mktemp("tinker-server"), port)
    yield f"http://127.0.0.1:{port}"
    manage.stop(proc)


def make_config(url: str, tmp_path: Path, **over: Any) -> Config:
    data: dict[str, Any] = {
        "name": "tinker-it",
        "mode": "sync",  # SkyRL's samplers are not snapshots: only on-policy runs are correct
        "run_dir": str(tmp_path / "runs"),
        "backend": {
            "name": "tinker",
            "base_model": str(_manage().MODEL),
            "base_url": url,
            "api_key": "tml-local-test",
            "lora_rank": 8,
            "server_loss_reduction": "sequence_mean",
            "server_snapshots": False,
            "request_timeout_s": 300,
        },
        "algorithm": {"loss": {"importance_sampling": "none"}},
        "train": {"groups_per_step": 2, "micro_batch_groups": 1, "total_steps": 10},
        "optim": {"lr": 0.05},
    }
    for key, value in over.items():
        data[key] = {**data.get(key, {}), **value}
    return config_from_dict(data)


def prompt(backend: TinkerBackend, text: str = "what is 2 plus 3?") -> list[int]:
    return backend.policy().tokenizer.apply_chat_template([{"role": "user", "content": text}])


async def rollouts(backend: TinkerBackend, version: int, n: int = 4) -> TrajectoryGroup:
    """n sampled completions of one prompt, with alternating advantages."""
    ids = prompt(backend)
    trajs = []
    for i in range(n):
        out = await backend.policy().generate(
            ids, SamplingParams(max_tokens=6, seed=i), version=version
        )
        trajs.append(Trajectory([Step(ids, out.ids, out.logprobs, out.versions)], reward=i % 2))
    return TrajectoryGroup("t", "default", trajs, [1.0 if i % 2 else -1.0 for i in range(n)])


async def train_step(backend: TinkerBackend, version: int) -> dict[str, float]:
    loss = backend.config.algorithm.loss
    assert await backend.forward_backward([await rollouts(backend, version)], loss) == {}
    await backend.forward_backward([await rollouts(backend, version)], loss)
    return await backend.optim_step()


def test_sample_forward_backward_optim_step(server, tmp_path) -> None:
    async def main() -> None:
        backend = TinkerBackend.from_config(make_config(server, tmp_path))
        policy = backend.policy()
        v = policy.acquire()
        out = await policy.generate(
            prompt(backend), SamplingParams(max_tokens=6, seed=1), version=v
        )
        assert 0 < len(out.ids) <= 6 and out.versions == [v] * len(out.ids)
        assert all(math.isfinite(lp) and lp < 0 for lp in out.logprobs)
        assert out.finish_reason in ("stop", "length")
        metrics = await train_step(backend, v)
        assert metrics["loss/num_sequences"] == 8
        assert metrics["loss/num_tokens"] > 0
        assert math.isfinite(metrics["loss/policy"]) and metrics["optim/lr"] == 0.05
        # Sampled by these very weights: the learner's logprobs match the sampler's.
        assert abs(metrics["loss/sampler_kl"]) < 1e-3
        assert metrics["tinker/grad_scale_error"] == pytest.approx(1.0, rel=0.5)
        policy.release(v)
        await backend.close()

    asyncio.run(main())


def test_weight_sync_gives_the_new_sampler_the_trained_weights(server, tmp_path) -> None:
    async def main() -> None:
        backend = TinkerBackend.from_config(make_config(server, tmp_path))
        policy, ids = backend.policy(), prompt(backend)
        old = policy.acquire()
        before = await policy.generate(ids, GREEDY, version=old)
        assert await policy.generate(ids, GREEDY, version=old) == before  # greedy is repeatable
        await train_step(backend, old)
        await backend.on_policy_updated(1)
        # SkyRL's old samplers would sample the trained weights (or load theirs over them):
        # with server_snapshots: false an older version is refused, never silently sampled.
        with pytest.raises(RuntimeError, match="not snapshots"):
            await policy.generate(ids, GREEDY, version=old)
        policy.release(old)
        assert policy.live_versions == [1]
        new = await policy.generate(ids, GREEDY)
        assert new.versions == [1] * len(new.ids)
        assert new.logprobs != pytest.approx(before.logprobs, abs=1e-4)
        await backend.close()

    asyncio.run(main())


def test_checkpoint_save_and_load(server, tmp_path) -> None:
    async def main() -> None:
        cfg = make_config(server, tmp_path)
        trained = TinkerBackend.from_config(cfg)
        ids = prompt(trained)
        await train_step(trained, trained.policy().acquire())
        await trained.on_policy_updated(1)
        await trained.save(tmp_path / "ckpt")
        expected = await trained.policy().generate(ids, GREEDY)

        fresh = TinkerBackend.from_config(cfg)
        untrained = await fresh.policy().generate(ids, GREEDY)
        assert untrained.logprobs != pytest.approx(expected.logprobs, abs=1e-4)
        await fresh.load(tmp_path / "ckpt")
        await fresh.on_policy_updated(1)
        restored = await fresh.policy().generate(ids, GREEDY)
        assert (restored.ids, restored.versions) == (expected.ids, expected.versions)
        assert restored.logprobs == pytest.approx(expected.logprobs, abs=1e-4)
        # The optimizer step count came back too: the next step continues the LR schedule.
        assert fresh._step == 1
        await trained.close()
        await fresh.close()

        other = make_config(server, tmp_path, backend={"lora_rank": 4})
        with pytest.raises(ConfigError, match="lora_rank=8"):
            await TinkerBackend.from_config(other).load(tmp_path / "ckpt")

    asyncio.run(main())


def test_a_rejected_request_is_a_clear_error_not_a_hang(server, tmp_path) -> None:
    async def main() -> None:
        # The server allows LoRA ranks up to 32.
        backend = TinkerBackend.from_config(
            make_config(server, tmp_path, backend={"lora_rank": 64})
        )
        t0 = time.monotonic()
        with pytest.raises(sdk.TinkerBackendError, match=r"create_lora_training_client .*rank 64"):
            await backend.policy().generate(prompt(backend), GREEDY)
        assert time.monotonic() - t0 < 60

    asyncio.run(main())


def test_unified_trainer_runs_on_the_tinker_backend(server, tmp_path) -> None:
    from rllm_async.trainer import UnifiedTrainer
    from rllm_async.workflows.single_turn import SingleTurnWorkflow

    cfg = make_config(
        server,
        tmp_path,
        rollout={"group_size": 4, "max_tokens": 6, "timeout_s": 300},
        train={"total_steps": 2, "groups_per_step": 2, "micro_batch_groups": 1},
        algorithm={"filter_zero_variance": False, "loss": {"importance_sampling": "none"}},
        checkpoint={"at_end": True},
    )
    tasks = [
        {"id": f"q{i}", "prompt": f"what is {i} plus {i}?", "answer": str(2 * i)} for i in range(8)
    ]
    workflow = SingleTurnWorkflow(lambda task, text: float(len(text) % 3))
    backend = TinkerBackend.from_config(cfg)
    trainer = UnifiedTrainer(cfg, backend=backend, workflow=workflow, train_tasks=tasks)
    records = trainer.run()
    assert [r["step"] for r in records] == [1, 2]
    assert all("loss/policy" in r for r in records)
    assert (cfg.run_path / "checkpoints" / "step_2" / "backend" / "tinker.json").is_file()


# -- `rllm-async train` end to end, sync and async -----------------------------------------------

REWARD_MODULE = '''
def reward(task, text):
    """A reward that varies within a group, so that a random policy has advantages to learn."""
    return float(len(text) % 3)
'''


def cli_config(url: str, tmp_path: Path, mode: str) -> Path:
    """A run config for `rllm-async train`: countdown tasks, 4 rollouts per task, 3 steps."""
    import yaml

    coordinator = (
        {"pipeline_depth": 1, "max_staleness": 1, "weight_update": "latest"}
        if mode == "async"
        else {}
    )
    data = {
        "name": f"tinker-cli-{mode}",
        "mode": mode,
        "seed": 0,
        "run_dir": str(tmp_path / "runs"),
        "backend": make_config(url, tmp_path).backend.model_dump(mode="json"),
        "workflow": {
            "cls": "rllm_async.workflows.SingleTurnWorkflow",
            "args": {"reward_fn": "tinker_it_reward:reward"},
        },
        "data": {
            "train": {
                "generator": "rllm_async.tasks.countdown:generator",
                "args": {"n": 64},
            }
        },
        "rollout": {"group_size": 4, "max_tokens": 6, "timeout_s": 300},
        "coordinator": coordinator,
        "train": {"total_steps": 3, "groups_per_step": 2, "micro_batch_groups": 1},
        "algorithm": {"filter_zero_variance": False, "loss": {"importance_sampling": "none"}},
        "optim": {"lr": 0.05},
        "logging": {"progress_bar": False},
        "checkpoint": {"at_end": True},
    }
    path = tmp_path / f"{mode}.yaml"
    path.write_text(yaml.safe_dump(data))
    (tmp_path / "tinker_it_reward.py").write_text(REWARD_MODULE)
    return path


def train_cli(config: Path, *overrides: str) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Run `rllm-async train CONFIG [overrides]`; return metrics.jsonl's rows and the summary."""
    import contextlib
    import io
    import json

    from rllm_async.cli import main

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(["train", str(config), *overrides]) == 0
    summary = json.loads(out.getvalue().strip().splitlines()[-1])
    rows = Path(summary["run_dir"], "metrics.jsonl").read_text().splitlines()
    return [json.loads(r) for r in rows], summary


def check_trained(rows: list[dict[str, Any]], summary: dict[str, Any]) -> None:
    """Three steps, each with real samples, forward/backward passes and an optimizer step."""
    assert summary["steps"] == 3 and [r["step"] for r in rows] == [1, 2, 3]
    for r in rows:
        assert r["groups/consumed"] == 2 and r["policy_version"] == r["step"]
        assert r["tokens/generated"] > 0 and r["loss/num_sequences"] == 8
        assert r["loss/num_tokens"] > 0 and math.isfinite(r["loss/policy"])
        assert r["optim/lr"] == 0.05 and "tinker/grad_scale_error" in r
        assert r["time/forward_backward_s"] > 0 and r["time/optim_step_s"] > 0
    assert (
        Path(summary["run_dir"]) / "checkpoints" / "step_3" / "backend" / "tinker.json"
    ).is_file()


def test_rllm_async_train_sync(server, tmp_path, monkeypatch) -> None:
    monkeypatch.syspath_prepend(str(tmp_path))
    rows, summary = train_cli(cli_config(server, tmp_path, "sync"))
    check_trained(rows, summary)
    # Strictly on-policy: no staleness, and the learner's logprobs are the sampler's.
    assert all(r["staleness/max"] == 0 for r in rows)
    assert all(abs(r["loss/sampler_kl"]) < 1e-3 for r in rows)

    # The trained weights differ from the initial ones: a sampler of the final checkpoint gives
    # other logprobs than a fresh adapter with the same seed.
    async def compare() -> None:
        cfg = make_config(server, tmp_path)
        fresh, trained = TinkerBackend.from_config(cfg), TinkerBackend.from_config(cfg)
        await trained.load(Path(summary["run_dir"]) / "checkpoints" / "step_3" / "backend")
        assert trained._step == 3
        ids = prompt(fresh)
        before = await fresh.policy().generate(ids, GREEDY)
        after = await trained.policy().generate(ids, GREEDY)
        assert after.logprobs != pytest.approx(before.logprobs, abs=1e-3)
        await fresh.close()
        await trained.close()

    asyncio.run(compare())


def test_rllm_async_train_async_latest(server, tmp_path, monkeypatch) -> None:
    monkeypatch.syspath_prepend(str(tmp_path))
    config = cli_config(server, tmp_path, "async")
    rows, summary = train_cli(config)
    check_trained(rows, summary)
    # d=1: step 2 trains groups sampled before step 1's update, and their tokens say so.
    assert max(r["staleness/max"] for r in rows) == 1
    assert all(r["staleness/max"] <= 1 for r in rows)
    # The learner's weights moved away from those stale samples' sampler.
    stale = [r for r in rows if r["staleness/mean"] > 0]
    assert stale and max(abs(r["loss/sampler_kl"]) for r in stale) > 1e-4

    # Pinned episodes cannot run ahead on a server without snapshot samplers: refused up front.
    from rllm_async.cli import main

    assert main(["train", str(config), "coordinator.weight_update=pin"]) == 2
