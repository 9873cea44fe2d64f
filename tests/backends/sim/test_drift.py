"""Drifting sim workloads: lengths, tool latency, learner time per token and the sampler KL a
version of staleness brings, changing over a run."""

from __future__ import annotations

import asyncio

import pytest

from rllm_async import vclock
from rllm_async.algorithms.sim_workload import drift_factor
from rllm_async.backends.sim import DRIFTING_WORKLOADS, SimBackend, SimOptions, workload_config
from rllm_async.config import LossConfig
from rllm_async.workflows.sim import SimWorkflow, synthetic_tasks
from tests.backends.sim.test_sim import sim_context, trained_group


def test_drift_factor_ramps_or_steps() -> None:
    assert drift_factor(30, 0, 3.0) == 1.0 and drift_factor(30, 60, 1.0) == 1.0
    assert [drift_factor(v, 60, 3.0) for v in (0, 30, 60, 600)] == [1.0, 2.0, 3.0, 3.0]
    assert [drift_factor(v, 60, 3.0, "step") for v in (0, 59, 60, 61)] == [1.0, 1.0, 3.0, 3.0]


def _rollout(workflow: SimWorkflow, version: int, task_id: str, index: int) -> tuple[int, float]:
    """A rollout's completion tokens and seconds, started on `version`."""
    backend = SimBackend(SimOptions(latency="zero"))

    async def main() -> tuple[int, float]:
        await backend.on_policy_updated(version)
        loop = asyncio.get_running_loop()
        ctx = sim_context(backend.policy(), task_id, index)
        t0 = loop.time()
        await workflow.run({"id": task_id}, ctx)
        ctx.close()
        return ctx.trajectory().num_completion_tokens, loop.time() - t0

    return vclock.run(main(), virtual=True)


def test_lengths_and_tool_latency_drift_with_the_version_a_rollout_starts_on() -> None:
    workflow = SimWorkflow(
        drift_steps=10, len_growth=3.0, tool_s=2.0, tool_growth=5.0, len_cap=10**6
    )
    keys = [(t["id"], i) for t in synthetic_tasks(20) for i in range(4)]
    early = [_rollout(workflow, 0, *k) for k in keys]
    late = [_rollout(workflow, 10, *k) for k in keys]
    for (n0, s0), (n1, s1) in zip(early, late, strict=True):
        assert n1 == pytest.approx(3 * n0, abs=2)  # the same draw, a 3x median
        assert (s0, s1) == (pytest.approx(2.0), pytest.approx(10.0))
    steady = SimWorkflow(tool_s=2.0, len_cap=10**6)
    assert [_rollout(steady, 10, *k) for k in keys] == early


def _train_four_steps(backend: SimBackend) -> list[dict[str, float]]:
    """One 100-token call sampled at version 0, trained at optimizer steps 0-3: the backend's
    metrics of each step."""

    async def main() -> list[dict[str, float]]:
        group = await trained_group(backend.policy(), "t", 100)
        out = []
        for _ in range(4):
            out.append(await backend.forward_backward([group], LossConfig()))
            await backend.optim_step()
        return out

    return vclock.run(main(), virtual=True)


def test_learner_seconds_per_token_drift_by_optimizer_step() -> None:
    backend = SimBackend(SimOptions(train_rate=1000.0, train_growth=0.5, train_drift_steps=2))
    metrics = _train_four_steps(backend)
    assert [m["sim/train_s"] for m in metrics] == pytest.approx([0.1, 0.075, 0.05, 0.05])
    assert backend.seconds_per_token(1) == pytest.approx(0.00075)


def test_the_sampler_kl_grows_with_staleness_and_drifts_by_optimizer_step() -> None:
    """Staleness 0-3, at a KL per version that halves over two steps; none without the option."""
    opts = SimOptions(latency="zero", kl_per_version=0.01, kl_growth=0.5, kl_drift_steps=2)
    metrics = _train_four_steps(SimBackend(opts))
    assert [m["loss/sampler_kl"] for m in metrics] == pytest.approx([0.0, 0.0075, 0.01, 0.015])
    assert all(m["loss/num_tokens"] == 100 for m in metrics)
    plain = _train_four_steps(SimBackend(SimOptions(latency="zero")))
    assert not any("loss/sampler_kl" in m for m in plain)


def test_drifting_workloads_build_and_simulate_slower_than_their_start() -> None:
    from rllm_async.plan.simulate import run_workload

    assert set(DRIFTING_WORKLOADS) == {"D1", "D2", "D3", "D4"}
    for name in DRIFTING_WORKLOADS:
        config = workload_config(name)
        SimBackend.from_config(config)
        SimWorkflow(**config.workflow.args)
    d1 = workload_config("D1")
    assert (d1.workflow.args["drift_steps"], d1.workflow.args["len_growth"]) == (60, 3.0)
    common = ["mode=async", "coordinator.max_staleness=null", "train.total_steps=6"]
    grown = run_workload("D1", [*common, "workflow.args.drift_steps=1"])
    steady = run_workload("D1", [*common, "workflow.args.drift_steps=0"])
    assert grown["time_s"] > 1.5 * steady["time_s"]
