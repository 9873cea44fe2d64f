"""The sim backend: processor-sharing timing, versions, determinism, calibration and faults."""

from __future__ import annotations

import asyncio
import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from rllm_async import vclock
from rllm_async.algorithms.sim_workload import sample_lengths
from rllm_async.backends.sim import (
    WORKLOADS,
    SimBackend,
    SimOptions,
    SimPolicy,
    SimSyncError,
    ps_makespan,
    ps_rate,
    step_profile,
    workload_config,
)
from rllm_async.config import ConfigError, LossConfig, config_from_dict
from rllm_async.protocols import Backend, SamplingParams
from rllm_async.rollout import RolloutContext
from rllm_async.types import TrajectoryGroup
from rllm_async.workflows.sim import SimWorkflow, SimWorkflowError, synthetic_tasks


def sim_context(
    policy: SimPolicy, task_id: str, index: int = 0, attempt: int = 0
) -> RolloutContext:
    """A pinned rollout context with no deadline on `policy`."""
    return RolloutContext(
        policy,
        sampling=SamplingParams(),
        pin=True,
        deadline=math.inf,
        task_id=task_id,
        rollout_index=index,
        attempt=attempt,
    )


async def _timed_generate(
    policy: SimPolicy, n: int, version: int | None = None
) -> tuple[float, list[int]]:
    out = await policy.generate([1, 2], SamplingParams(max_tokens=n), version=version)
    assert out.ids == [0] * n and len(out.logprobs) == n
    return asyncio.get_running_loop().time(), out.versions


async def trained_group(policy: SimPolicy, task_id: str, tokens: int) -> TrajectoryGroup:
    """A group of one rollout of `tokens` sampled tokens, to train on."""
    ctx = sim_context(policy, task_id)
    await ctx.generate([1], max_tokens=tokens)
    ctx.close()
    return TrajectoryGroup(task_id, "default", [ctx.trajectory()], [0.0])


def test_processor_sharing_matches_hand_computed_finish_times() -> None:
    # Two active: each decodes at 1000 / (2 + 2) = 250 tok/s, so the 100-token one ends at 0.4 s.
    # Then alone at 1000 / 3 tok/s, the other's last 200 tokens take 0.6 s: it ends at 1.0 s.
    policy = SimPolicy(SimOptions(rmax=1000, n_half=2))

    async def main() -> list[tuple[float, list[int]]]:
        return await asyncio.gather(_timed_generate(policy, 100), _timed_generate(policy, 300))

    (t_short, _), (t_long, _) = vclock.run(main(), virtual=True)
    assert t_short == pytest.approx(0.4, abs=1e-9)
    assert t_long == pytest.approx(1.0, abs=1e-9)
    assert ps_makespan([100, 300], rmax=1000, n_half=2, slots=512) == pytest.approx(1.0)
    assert ps_rate(2, rmax=1000, n_half=2) == 500.0


def test_step_profile_closed_form_matches_the_event_simulation() -> None:
    opts = SimOptions(len_sigma=1.3, len_cap=32768)
    profile = step_profile(opts, 100, steps=5, seed=3)
    rows = sample_lengths(np.random.default_rng(3), 500, 1500.0, 1.3, 32768).reshape(5, 100)
    t_gen = [ps_makespan(row.tolist(), opts.rmax, opts.n_half, opts.slots) for row in rows]
    assert profile.t_gen == pytest.approx(sum(t_gen) / 5, rel=1e-12)
    assert profile.tokens == rows.sum() / 5
    queued = step_profile(opts.model_copy(update={"slots": 10}), 100, steps=5, seed=3)
    assert queued.t_gen > profile.t_gen


def test_sequences_beyond_the_slots_wait_in_fifo_order() -> None:
    # slots=2 at 100 tok/s shared: the first two 100-token sequences end at 2 s; the third
    # starts then, alone, and ends at 3 s.
    policy = SimPolicy(SimOptions(rmax=100, n_half=0, slots=2))
    engine = policy.engine
    assert engine is not None

    async def main() -> tuple[list[float], tuple[int, int]]:
        tasks = [asyncio.create_task(_timed_generate(policy, 100)) for _ in range(3)]
        await asyncio.sleep(0.5)
        occupancy = (engine.active, engine.queued)
        return [t for t, _ in await asyncio.gather(*tasks)], occupancy

    finish, occupancy = vclock.run(main(), virtual=True)
    assert occupancy == (2, 1)
    assert finish == pytest.approx([2.0, 2.0, 3.0])
    assert ps_makespan([100, 100, 100], rmax=100, n_half=0, slots=2) == pytest.approx(3.0)


def test_cancelled_sequence_frees_its_slot_at_once() -> None:
    policy = SimPolicy(SimOptions(rmax=100, n_half=0, slots=1))

    async def main() -> float:
        hog = asyncio.create_task(_timed_generate(policy, 10_000))
        waiter = asyncio.create_task(_timed_generate(policy, 100))
        await asyncio.sleep(1.0)
        hog.cancel()
        t, _ = await waiter
        assert policy.engine is not None and policy.engine.active == 0
        return t

    assert vclock.run(main(), virtual=True) == pytest.approx(2.0)


def test_latest_mode_splits_tokens_at_a_version_change() -> None:
    # Two 100-token sequences share 100 tok/s: at t=0.5 each has 25 tokens when version 1 lands.
    policy = SimPolicy(SimOptions(rmax=100, n_half=0))

    async def main() -> tuple[list[int], list[int]]:
        pinned_version = policy.acquire()
        pinned = asyncio.create_task(_timed_generate(policy, 100, version=pinned_version))
        latest = asyncio.create_task(_timed_generate(policy, 100))
        await asyncio.sleep(0.5)
        policy.set_version(1)
        (_, pinned_versions), (_, latest_versions) = await asyncio.gather(pinned, latest)
        policy.release(pinned_version)
        return pinned_versions, latest_versions

    pinned_versions, latest_versions = vclock.run(main(), virtual=True)
    assert pinned_versions == [0] * 100
    assert latest_versions == [0] * 25 + [1] * 75
    assert policy.snapshots == {}


def test_zero_latency_takes_no_time_and_still_tags_versions() -> None:
    backend = SimBackend(SimOptions(latency="zero"))
    policy = backend.policy()

    async def main() -> tuple[float, list[int], list[int]]:
        await backend.on_policy_updated(3)
        _, latest = await _timed_generate(policy, 5)
        _, pinned = await _timed_generate(policy, 5, version=policy.acquire())
        await backend.forward_backward([], LossConfig())
        return asyncio.get_running_loop().time(), latest, pinned

    assert vclock.run(main(), virtual=True) == (0.0, [3] * 5, [3] * 5)


def test_a_thousand_concurrent_sequences_finish_on_time() -> None:
    n, length = 1000, 500
    policy = SimPolicy(SimOptions(slots=n, rmax=20000, n_half=64))

    async def main() -> list[float]:
        return [
            t for t, _ in await asyncio.gather(*(_timed_generate(policy, length) for _ in range(n)))
        ]

    finish = vclock.run(main(), virtual=True)
    assert finish == pytest.approx([length * n / ps_rate(n, 20000, 64)] * n)


def test_workflow_draws_depend_only_on_task_index_and_attempt() -> None:
    workflow = SimWorkflow(seed=1, len_sigma=1.0)
    keys = [(task, i, a) for task in synthetic_tasks(20) for i in range(4) for a in range(2)]

    def draws(order: list[Any]) -> dict[tuple[str, int, int], tuple[int, Any]]:
        policy = SimPolicy(SimOptions(latency="zero"))

        async def one(task: dict[str, Any], index: int, attempt: int) -> tuple[int, Any]:
            ctx = sim_context(policy, task["id"], index, attempt)
            reward = await workflow.run(task, ctx)
            ctx.close()
            return ctx.trajectory().num_completion_tokens, reward

        async def main() -> list[tuple[int, Any]]:
            return await asyncio.gather(*(one(*k) for k in order))

        results = vclock.run(main(), virtual=True)
        return {(t["id"], i, a): r for (t, i, a), r in zip(order, results, strict=True)}

    forward, backward = draws(keys), draws(keys[::-1])
    assert forward == backward
    assert len({length for length, _ in forward.values()}) > 100
    assert {reward for _, reward in forward.values()} == {0.0, 1.0}
    assert synthetic_tasks(3, seed=2) == synthetic_tasks(3, seed=2)
    assert all(0.1 <= t["p0"] <= 0.9 for t in synthetic_tasks(200))


def test_success_rate_rises_with_the_policy_version() -> None:
    workflow = SimWorkflow(len_median=10)
    tasks = synthetic_tasks(2000)

    def mean_reward(version: int) -> float:
        policy = SimPolicy(SimOptions(latency="zero"))
        policy.set_version(version)

        async def main() -> list[Any]:
            return [await workflow.run(t, sim_context(policy, t["id"])) for t in tasks]

        return sum(vclock.run(main(), virtual=True)) / len(tasks)

    assert mean_reward(100) > mean_reward(0) + 0.1


def test_calibrated_train_ratio_holds_when_resimulated() -> None:
    config = workload_config("W1", ["train.groups_per_step=8"])
    backend = SimBackend.from_config(config)
    policy = backend.policy()
    workflow = SimWorkflow(**config.workflow.args)
    gps, size, steps = config.train.groups_per_step, config.rollout.group_size, 20
    tasks = synthetic_tasks(gps * steps)

    async def sync_step(batch: list[dict[str, Any]]) -> tuple[float, float]:
        loop = asyncio.get_running_loop()
        start = loop.time()
        ctxs = [[sim_context(policy, t["id"], i) for i in range(size)] for t in batch]
        await asyncio.gather(
            *(workflow.run(t, c) for t, row in zip(batch, ctxs, strict=True) for c in row)
        )
        t_gen = loop.time() - start
        groups = [
            TrajectoryGroup(t["id"], "default", [c.trajectory() for c in row], [0.0] * size)
            for t, row in zip(batch, ctxs, strict=True)
        ]
        start = loop.time()
        await backend.forward_backward(groups, LossConfig())
        await backend.optim_step()
        for row in ctxs:
            for c in row:
                c.close()
        return t_gen, loop.time() - start

    async def main() -> list[tuple[float, float]]:
        return [await sync_step(tasks[s * gps : (s + 1) * gps]) for s in range(steps)]

    times = vclock.run(main(), virtual=True)
    ratio = sum(t for _, t in times) / sum(g for g, _ in times)
    assert ratio == pytest.approx(0.3, rel=0.05)  # 20 sampled steps: a few percent of noise
    assert len(backend.trained) == steps and all(len(s) == gps for s in backend.trained)
    assert policy.snapshots == {}
    # The live engine's sync steps take exactly the closed-form time of the same lengths.
    for (t_gen, _), step in zip(times, backend.trained, strict=True):
        lengths = [n for group in step for n in group[4]]
        assert t_gen == pytest.approx(ps_makespan(lengths, 20000.0, 64.0, 512), rel=1e-9)
    # Over many independent steps the calibration is unbiased.
    many = step_profile(backend.opts, gps * size, steps=4000, seed=1)
    assert many.tokens / (backend.train_rate * many.t_gen) == pytest.approx(0.3, rel=0.02)


def test_injected_workflow_faults() -> None:
    policy = SimPolicy(SimOptions(latency="zero"))
    task = synthetic_tasks(1)[0]

    async def main() -> None:
        failed = sim_context(policy, task["id"])
        with pytest.raises(SimWorkflowError, match="exception_rate"):
            await SimWorkflow(exception_rate=1.0).run(task, failed)
        failed.close()
        with pytest.raises(SimWorkflowError, match="fail_tasks"):
            await SimWorkflow(fail_tasks=[task["id"]]).run(task, sim_context(policy, task["id"]))
        hung = sim_context(policy, task["id"])
        with pytest.raises(TimeoutError):
            async with asyncio.timeout(3600):
                await SimWorkflow(hang_rate=1.0).run(task, hung)
        assert policy.snapshots == {0: 1}
        hung.close()
        assert policy.snapshots == {}
        start = asyncio.get_running_loop().time()
        await SimWorkflow(reward_delay_s=30.0).run(task, sim_context(policy, task["id"]))
        assert asyncio.get_running_loop().time() - start == 30.0

    vclock.run(main(), virtual=True)


def test_sync_faults_hit_the_first_try_of_every_nth_version() -> None:
    backend = SimBackend(SimOptions(t_sync=0.5, sync_fail_every=2, sync_hang_every=3))

    async def main() -> list[float]:
        loop = asyncio.get_running_loop()
        await backend.on_policy_updated(1)
        seen = [loop.time()]
        with pytest.raises(SimSyncError):
            await backend.on_policy_updated(2)
        assert backend.version == 1
        await backend.on_policy_updated(2)  # a retry goes through
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(backend.on_policy_updated(3), 10)
        await backend.on_policy_updated(3)
        seen.append(loop.time())
        return seen

    assert vclock.run(main(), virtual=True) == [0.5, 12.0]
    assert (backend.version, backend.policy().version) == (3, 3)
    assert (backend.sync_failures, backend.sync_hangs) == (1, 1)


def test_snapshot_refcounts_return_to_zero() -> None:
    policy = SimPolicy(SimOptions())
    workflow = SimWorkflow(len_median=200, len_sigma=0.0)  # all still decoding at t=0.5
    tasks = synthetic_tasks(50)

    async def rollout(task: dict[str, Any], index: int) -> None:
        ctx = sim_context(policy, task["id"], index)
        try:
            await workflow.run(task, ctx)
        finally:
            ctx.close()

    async def main() -> dict[int, int]:
        running = [asyncio.create_task(rollout(t, i)) for t in tasks for i in range(4)]
        await asyncio.sleep(0.5)
        held = policy.snapshots
        for task in running[::3]:
            task.cancel()
        await asyncio.gather(*running, return_exceptions=True)
        return held

    assert vclock.run(main(), virtual=True) == {0: 200}
    assert policy.snapshots == {}
    with pytest.raises(ValueError, match="without a matching acquire"):
        policy.release(0)


def test_training_log_timing_and_checkpoint(tmp_path: Path) -> None:
    backend = SimBackend(SimOptions(train_rate=1000.0))
    assert isinstance(backend, Backend)
    policy = backend.policy()
    task = synthetic_tasks(1)[0]

    async def main() -> float:
        ctxs = [sim_context(policy, task["id"], i) for i in range(2)]
        for n, c in zip((300, 200), ctxs, strict=True):
            await c.generate([1], max_tokens=n)
            c.set_reward(n / 100)
            c.close()
        group = TrajectoryGroup(task["id"], "default", [c.trajectory() for c in ctxs], [0.5, -0.5])
        start = asyncio.get_running_loop().time()
        metrics = await backend.forward_backward([group], LossConfig())
        assert metrics["sim/train_tokens"] == 500.0
        await backend.optim_step()
        await backend.optim_step()
        await backend.on_policy_updated(1)
        await backend.save(tmp_path / "ckpt")
        await backend.close()
        await backend.close()
        return asyncio.get_running_loop().time() - start

    assert vclock.run(main(), virtual=True) == pytest.approx(0.5 + 0.5)
    assert backend.trained == [
        [(task["id"], "default", (3.0, 2.0), (0.5, -0.5), (300, 200), 0)],
        [],
    ]
    resumed = SimBackend(SimOptions(train_rate=1000.0))
    vclock.run(resumed.load(tmp_path / "ckpt"), virtual=True)
    assert (resumed.version, resumed.steps, resumed.policy().version) == (1, 2, 1)


def test_options_are_validated_and_lengths_follow_the_workflow() -> None:
    assert SimOptions().train_ratio == 0.3
    with pytest.raises(ConfigError, match="not both"):
        SimBackend.from_config(
            config_from_dict({"backend": {"name": "sim", "train_rate": 5, "train_ratio": 1}})
        )
    with pytest.raises(ConfigError, match="did you mean 'n_half'"):
        SimBackend.from_config(config_from_dict({"backend": {"name": "sim", "n_hal": 5}}))
    with pytest.raises(ConfigError, match="exception_rat"):
        SimWorkflow(exception_rat=0.1)
    config = workload_config("W3")
    backend = SimBackend.from_config(config)
    assert (backend.opts.len_sigma, backend.opts.len_cap) == (1.3, 32768)
    assert backend.profile.train_rate_for(0.3) == pytest.approx(backend.train_rate)
    fixed = SimBackend.from_config(
        workload_config("W1", ["backend.train_rate=123", "backend.train_ratio=null"])
    )
    assert fixed.train_rate == 123.0


def test_workloads_build_valid_configs() -> None:
    assert set(WORKLOADS) == {"W1", "W2", "W3", "W4"}
    for name in WORKLOADS:
        config = workload_config(name)
        backend = SimBackend.from_config(config)
        SimWorkflow(**config.workflow.args)
        assert config.rollout.max_concurrency == backend.opts.slots
        assert config.data.train is not None
    w4 = workload_config("W4")
    assert w4.workflow.args["hang_rate"] == 0.005 and w4.backend.options["sync_fail_every"] == 50
    with pytest.raises(ConfigError, match="unknown sim workload"):
        workload_config("W9")


def test_a_sync_with_sync_share_zero_pauses_decoding_for_its_length() -> None:
    # 100 tokens alone at 1000 / (1 + 1) = 500 tok/s take 0.2 s; a 0.5 s sync starting at 0.1 s
    # stops the clock of the sequence, so it ends at 0.7 s, and at 0.2 s with the full share.
    def finish(sync_share: float) -> float:
        backend = SimBackend(SimOptions(rmax=1000, n_half=1, t_sync=0.5, sync_share=sync_share))

        async def main() -> float:
            async def sync() -> None:
                await asyncio.sleep(0.1)
                await backend.on_policy_updated(1)

            (t, _), _ = await asyncio.gather(_timed_generate(backend.policy(), 100), sync())
            return t

        return vclock.run(main(), virtual=True)

    assert finish(0.0) == pytest.approx(0.7, abs=1e-9)
    assert finish(1.0) == pytest.approx(0.2, abs=1e-9)


def test_training_with_train_share_slows_decoding_by_that_share() -> None:
    # 500 tok/s alone; 0.1 s of training (100 tokens at 1000 tok/s) at a quarter of the rate
    # decodes 12.5 tokens, the other 87.5 take 0.175 s after: the sequence takes 0.275 s.
    backend = SimBackend(SimOptions(rmax=1000, n_half=1, train_rate=1000, train_share=0.25))
    policy = backend.policy()
    task = synthetic_tasks(1)[0]

    async def main() -> float:
        group = await trained_group(policy, task["id"], 100)
        start = asyncio.get_running_loop().time()
        train = backend.forward_backward([group], LossConfig())
        (t, _), _ = await asyncio.gather(_timed_generate(policy, 100), train)
        return t - start

    assert vclock.run(main(), virtual=True) == pytest.approx(0.275, abs=1e-9)


def test_learner_share_slows_training_only_while_generation_decodes() -> None:
    # One sequence alone decodes at 1000 / (1 + 1) = 500 tok/s: 100 tokens from 0 to 0.2 s, 50
    # from 0.3 to 0.4 s. 600 tokens at 1000 tok/s are 0.6 s of training alone; at half speed
    # beside decoding it does 0.1 s of that work by 0.2 s, 0.1 s more alone by 0.3 s, 0.05 s
    # beside the second sequence by 0.4 s, and the last 0.35 s alone: it ends at 0.75 s.
    def finish(learner_share: float) -> tuple[float, float, float]:
        opts = SimOptions(rmax=1000, n_half=1, train_rate=1000, learner_share=learner_share)
        backend = SimBackend(opts)
        policy = backend.policy()
        task = synthetic_tasks(1)[0]

        async def main() -> tuple[float, float, float]:
            group = await trained_group(policy, task["id"], 600)
            loop = asyncio.get_running_loop()
            start = loop.time()

            async def later() -> tuple[float, list[int]]:
                await asyncio.sleep(0.3)
                return await _timed_generate(policy, 50)

            async def train() -> float:
                await backend.forward_backward([group], LossConfig())
                return loop.time()

            (t1, _), (t2, _), t_train = await asyncio.gather(
                _timed_generate(policy, 100), later(), train()
            )
            return t1 - start, t2 - start, t_train - start

        return vclock.run(main(), virtual=True)

    assert finish(0.5) == pytest.approx((0.2, 0.4, 0.75), abs=1e-9)
    assert finish(1.0) == pytest.approx((0.2, 0.4, 0.6), abs=1e-9)


def test_learner_share_slows_recomputed_logprobs_beside_generation() -> None:
    # 300 tokens: 0.1 s of a forward pass alone. At a quarter speed beside a 100-token sequence
    # (0-0.2 s) it does 0.05 s of that work, the other 0.05 s alone after: it ends at 0.25 s.
    backend = SimBackend(SimOptions(rmax=1000, n_half=1, train_rate=1000, learner_share=0.25))
    policy = backend.policy()
    task = synthetic_tasks(1)[0]

    async def main() -> float:
        group = await trained_group(policy, task["id"], 300)
        loop = asyncio.get_running_loop()
        start = loop.time()
        _, _ = await asyncio.gather(
            _timed_generate(policy, 100), backend.recompute_logprobs([group])
        )
        return loop.time() - start

    assert vclock.run(main(), virtual=True) == pytest.approx(0.25, abs=1e-9)


def test_the_sim_says_whether_generation_and_training_share_a_device() -> None:
    assert SimBackend.shares_device({}) is False
    assert SimBackend.shares_device({"learner_share": 0.5}) is True
    assert SimBackend.shares_device({"train_share": 0.5, "rmax": 100}) is True
