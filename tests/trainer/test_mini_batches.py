"""`train.mini_batches` and `train.epochs_per_batch`: several optimizer steps per batch of groups,
one version each; the clipped loss limits how far later passes move the policy."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
import torch

from rllm_async.backends.local import LocalBackend
from rllm_async.backends.sim import SimBackend, workload_config
from rllm_async.config import ConfigError, load_config
from rllm_async.trainer import UnifiedTrainer
from rllm_async.vclock import run
from tests.backends.local.test_local_backend import make_config as local_config
from tests.backends.local.test_local_backend import params, sample_groups
from tests.fakes import FakeBackend, ScriptedWorkflow, make_config, tasks


class CallLog(FakeBackend):
    """Logs every backend call: ("fb", task ids), ("recompute", task ids), ("optim",),
    ("sync", version)."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.log: list[tuple[Any, ...]] = []

    async def forward_backward(self, groups: list[Any], loss: Any) -> dict[str, float]:
        self.log.append(("fb", tuple(g.task_id for g in groups)))
        return await super().forward_backward(groups, loss)

    async def recompute_logprobs(self, groups: list[Any]) -> None:
        self.log.append(("recompute", tuple(g.task_id for g in groups)))

    async def optim_step(self) -> dict[str, float]:
        self.log.append(("optim",))
        return await super().optim_step()

    async def on_policy_updated(self, version: int) -> None:
        self.log.append(("sync", version))
        await super().on_policy_updated(version)


def fit(tmp_path, train: dict[str, Any], **sections: Any):
    backend = CallLog(latency=lambda: 0.5, train_s=0.2)
    cfg = make_config(tmp_path, train=train, **sections)
    trainer = UnifiedTrainer(
        cfg, backend=backend, workflow=ScriptedWorkflow(), train_tasks=tasks(40)
    )
    return trainer, backend, run(trainer.fit(), virtual=True)


def test_each_batch_takes_mini_batches_x_epochs_optimizer_steps(tmp_path) -> None:
    train = {"total_steps": 12, "groups_per_step": 4, "mini_batches": 2, "epochs_per_batch": 3}
    trainer, backend, records = fit(
        tmp_path, train, coordinator={"pipeline_depth": 1, "max_staleness": 6}
    )
    assert sum(call == ("optim",) for call in backend.log) == 12
    assert [c[1] for c in backend.log if c[0] == "sync"] == list(range(1, 13))
    assert trainer.coordinator.version == 12
    assert [r["step"] for r in records] == [6, 12], "one record per batch"
    assert [r["policy_version"] for r in records] == [6, 12]
    assert trainer.coordinator.counts.consumed == 8, "two batches of four groups"
    # Every optimizer step trains one mini-batch of two groups; each batch's mini-batches are
    # passed over three times, in the same order.
    steps = backend.trained
    assert len(steps) == 12 and all(len(step) == 2 for step in steps)
    for batch in (steps[:6], steps[6:]):
        assert batch[:2] == batch[2:4] == batch[4:6]
        assert not {t for t, _ in batch[0]} & {t for t, _ in batch[1]}
    assert max(r["staleness/max"] for r in records) <= 6


def test_one_mini_batch_and_one_epoch_is_the_plain_step(tmp_path) -> None:
    # Today's update: micro-batches streamed into forward_backward, one optimizer step, one sync.
    plain = fit(tmp_path / "plain", {"total_steps": 3})[1].log
    explicit = fit(tmp_path / "explicit", {"total_steps": 3, "mini_batches": 1})[1].log
    assert plain == explicit
    kinds = [c[0] if c[0] != "sync" else c for c in plain]
    assert kinds == [k for v in (1, 2, 3) for k in ("fb", "fb", "optim", ("sync", v))]
    assert all(len(c[1]) == 2 for c in plain if c[0] == "fb")


def test_recomputed_old_logprobs_take_the_whole_batch_before_its_first_step(tmp_path) -> None:
    train = {"total_steps": 8, "groups_per_step": 4, "mini_batches": 2, "epochs_per_batch": 2}
    co = {"pipeline_depth": 1, "max_staleness": 4}
    loss = {"loss": {"behaviour_logprobs": "recomputed"}}
    trainer, backend, records = fit(tmp_path / "r", train, coordinator=co, algorithm=loss)
    one_batch = ["fb", "recompute", "optim", "sync", *["fb", "optim", "sync"] * 3]
    assert [c[0] for c in backend.log] == one_batch * 2
    assert [c[1] for c in backend.log if c[0] == "sync"] == list(range(1, 9))
    # The second mini-batch is recorded before the first step and trained after it, every pass.
    first = backend.log[: len(one_batch)]
    trained = [c[1] for c in first if c[0] == "fb"]
    assert trained[1] == trained[3] == first[1][1] and trained[0] == trained[2]
    # Versions, records and group counts are those of the sampler's schedule.
    plain = fit(tmp_path / "s", train, coordinator=co)
    assert [r["step"] for r in records] == [r["step"] for r in plain[2]] == [4, 8]
    assert trainer.coordinator.counts.consumed == plain[0].coordinator.counts.consumed == 8
    assert all(r["time/recompute_logprobs_s"] >= 0 for r in records)


def test_recomputed_old_logprobs_need_a_backend_that_recomputes(tmp_path) -> None:
    cfg = make_config(tmp_path, algorithm={"loss": {"behaviour_logprobs": "recomputed"}})
    with pytest.raises(ConfigError, match=r"behaviour_logprobs: recomputed.*FakeBackend"):
        UnifiedTrainer(
            cfg, backend=FakeBackend(), workflow=ScriptedWorkflow(), train_tasks=tasks(8)
        )


def test_groups_stream_into_each_mini_batch_however_micro_batched(tmp_path) -> None:
    # The deterministic simulator trains the same groups in every optimizer step whether a
    # mini-batch is one forward_backward call or several.
    def trained(micro: int, behaviour: str = "sampler") -> tuple[list, list[dict[str, float]]]:
        config = workload_config(
            "W1",
            [
                f"run_dir={tmp_path}",
                f"name=micro{micro}",
                "mode=sync",
                "logging.progress_bar=false",
                "checkpoint.resume=never",
                "train.total_steps=8",
                "train.groups_per_step=4",
                "train.mini_batches=2",
                "train.epochs_per_batch=2",
                f"train.micro_batch_groups={micro}",
                "rollout.group_size=4",
                f"algorithm.loss.behaviour_logprobs={behaviour}",
            ],
        )
        trainer = UnifiedTrainer(config)
        records = trainer.run()
        assert isinstance(trainer.backend, SimBackend)
        return trainer.backend.trained, records

    (one, records), (two, _) = trained(1), trained(2)
    assert len(one) == 8 and one == two
    # Recomputing old logprobs trains the same groups in each step (the batch is all there in
    # sync mode) and costs a forward pass over each later mini-batch, in virtual time.
    recomputed, with_recompute = trained(2, "recomputed")
    assert recomputed == one
    assert all(r["time/recompute_logprobs_s"] > 0 for r in with_recompute)
    assert with_recompute[-1]["time/elapsed_s"] > records[-1]["time/elapsed_s"]


def test_configs_that_do_not_split_into_batches_are_refused() -> None:
    with pytest.raises(ConfigError, match=r"groups_per_step \(16\).*mini_batches \(3\)"):
        load_config(None, ["train.mini_batches=3"])
    with pytest.raises(ConfigError, match=r"train.total_steps \(10\).*multiple of 4"):
        load_config(
            None,
            [
                "train.total_steps=10",
                "train.mini_batches=2",
                "train.epochs_per_batch=2",
                "coordinator.max_staleness=4",
            ],
        )
    with pytest.raises(ConfigError, match=r"max_staleness \(1\).*mini_batches \(2\)"):
        load_config(None, ["train.mini_batches=2"])
    with pytest.raises(ConfigError, match=r"micro_batch_groups \(9\).*mini_batches \(8\)"):
        load_config(None, ["train.mini_batches=2", "train.micro_batch_groups=9", "mode=sync"])
    cfg = load_config(None, ["train.mini_batches=4", "mode=sync"])
    assert cfg.train.micro_batch_groups == 4 and cfg.train.groups_per_update == 4


def test_a_second_pass_moves_a_clipped_policy_less_than_an_unclipped_one() -> None:
    base = {"optim": {"lr": 0.02, "grad_clip": None}}
    clipped = local_config(
        **base,
        algorithm={"loss": {"clip_low": 0.02, "clip_high": 0.02, "importance_sampling": "none"}},
    )
    unclipped = local_config(
        **base, algorithm={"loss": {"name": "importance_sampling", "importance_sampling": "none"}}
    )

    async def second_pass_move(cfg: Any) -> tuple[float, dict[str, float], dict[str, float]]:
        backend = LocalBackend.from_config(cfg)
        groups = await sample_groups(backend, 3)
        first = await backend.forward_backward(groups, cfg.algorithm.loss)
        await backend.optim_step()
        before = params(backend).clone()
        second = await backend.forward_backward(groups, cfg.algorithm.loss)
        second.update(await backend.optim_step())
        moved = float((params(backend) - before).norm())
        await backend.close()
        return moved, first, second

    async def main() -> None:
        c_move, c_first, c_second = await second_pass_move(clipped)
        u_move, _, u_second = await second_pass_move(unclipped)
        # On-policy first pass: nothing to clip. The second pass is off the sampler's policy.
        assert c_first["loss/clip_frac_low"] + c_first["loss/clip_frac_high"] == 0.0
        clip = c_second["loss/clip_frac_low"] + c_second["loss/clip_frac_high"]
        assert clip > 0.2, c_second
        assert u_second["loss/sampler_kl"] > 1e-4
        # Clipped tokens give no gradient: a far smaller push, and (through Adam) a shorter step.
        assert c_second["optim/grad_norm"] < 0.5 * u_second["optim/grad_norm"]
        assert c_move < u_move, (c_move, u_move)

    asyncio.run(main())


@pytest.mark.parametrize(
    ("behaviour", "learner"),
    [("sampler", "thread"), ("recomputed", "thread"), ("recomputed", "process")],
)
def test_local_backend_trains_several_epochs_per_batch(tmp_path, behaviour, learner) -> None:
    cfg = local_config(
        backend={"learner": learner},
        algorithm={"loss": {"behaviour_logprobs": behaviour}},
        run_dir=str(tmp_path),
        train={"total_steps": 4, "groups_per_step": 2, "mini_batches": 2, "epochs_per_batch": 2},
        coordinator={"pipeline_depth": 0, "max_staleness": 0},
        checkpoint={"resume": "never", "at_end": False},
        logging={"progress_bar": False},
    )
    trainer = UnifiedTrainer(
        cfg,
        workflow=ScriptedWorkflow(),
        train_tasks=tasks(8),
    )
    records = trainer.run()
    assert [r["step"] for r in records] == [4]
    assert isinstance(trainer.backend, LocalBackend)
    assert trainer.backend.version == 4
    assert records[0]["loss/num_tokens"] > 0
    assert "loss/clip_frac_high" in records[0]
    assert ("loss/old_sampler_kl" in records[0]) == (behaviour == "recomputed")
    assert ("time/recompute_logprobs_s" in records[0]) == (behaviour == "recomputed")
    if learner == "thread":
        assert trainer.backend.learner.step == 4
        assert torch.isfinite(params(trainer.backend)).all()
