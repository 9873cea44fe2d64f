"""Infrastructure failures are not rewards: a rollout whose tool, sandbox or environment died is
left out of its group (the survivors' advantages are those of a group of the survivors alone),
never trained, counted in the records, and a run whose infrastructure is broken is stopped by the
breaker; a model error is still scored."""

from __future__ import annotations

import asyncio
import json
import random
from collections.abc import Callable
from typing import Any

import pytest

from rllm_async import InfraError, InfraFailureRateError, register_infra_error
from rllm_async.algorithms.advantages import get_advantage_fn
from rllm_async.buffer import Dispatch, TrajectoryGroupBuffer
from rllm_async.config import Config, CoordinatorConfig, config_from_dict
from rllm_async.coordinator import GroupState, SyncCoordinator
from rllm_async.health import FailureRateBreaker, FailureRateError
from rllm_async.protocols import SamplingParams
from rllm_async.rollout import RolloutContext, SyncPause
from rllm_async.runner import Rollout, run_rollout
from rllm_async.trainer import UnifiedTrainer
from rllm_async.types import Termination
from rllm_async.vclock import run
from rllm_async.workflows import EnvWorkflow, MultiTurnWorkflow, Tool, Workflow
from tests.fakes import FakeBackend, make_config, tasks
from tests.scripted import ScriptedPolicy


class SandboxError(InfraError):
    """What a sandbox tool raises when its container dies (as the sandbox tool does)."""


# -- a sandboxed code tool, scripted per call ------------------------------------------------------


def tool_call(code: str) -> str:
    return json.dumps({"name": "run_code", "arguments": {"code": code}}).join(
        ("<tool_call>", "</tool_call>")
    )


def coder(prompt: str) -> str:
    """Runs code once, then answers with the tool's output."""
    last = prompt.rsplit("<|end|>", 2)[-2]
    if "<|tool|>" not in last:
        return tool_call("print(answer)")
    return prompt.rsplit("<|tool|>", 1)[1].split("<|end|>")[0]


class Sandbox:
    """`run_code`'s outcomes, one per call in call order: a number it prints, "dead" (the
    container died: SandboxError), or "bad" (the model's code raised: a model error)."""

    def __init__(self, outcomes: list[str]) -> None:
        self.outcomes = list(outcomes)

    def run_code(self, code: str) -> str:
        outcome = self.outcomes.pop(0)
        if outcome == "dead":
            raise SandboxError("sandbox 3f2a: container exited (OOM-killed)")
        if outcome == "bad":
            raise NameError("name 'answer' is not defined")
        return outcome


def scored(task: dict[str, Any], messages: list[dict[str, Any]]) -> float:
    """The number the model answered (0 when it answered no number)."""
    try:
        return float(messages[-1]["content"])
    except ValueError:
        return 0.0


def coding_workflow(sandbox: Sandbox) -> MultiTurnWorkflow:
    schema = {"type": "object", "properties": {"code": {"type": "string"}}}
    return MultiTurnWorkflow(reward_fn=scored, tools=[Tool(sandbox.run_code, schema)], max_turns=3)


async def rollout(
    workflow: Workflow, policy: Any, index: int = 0, retries: int = 0, report: Any = None
) -> Rollout:
    return await run_rollout(
        workflow,
        {"id": "t0", "prompt": "print the answer"},
        policy,
        sampling=SamplingParams(max_tokens=128),
        pin=True,
        timeout_s=60.0,
        retries=retries,
        pause=SyncPause(),
        report=report or (lambda metrics: None),
        rollout_index=index,
    )


async def _no_hook(version: int) -> None:
    return None


def buffer(group_size: int, min_group_size: int, normalize_std: bool, advantage: str):
    coord = SyncCoordinator(CoordinatorConfig(pipeline_depth=3, stall_timeout_s=60.0), 4, _no_hook)
    buf = TrajectoryGroupBuffer(
        coord,
        group_size=group_size,
        min_group_size=min_group_size,
        advantage_fn=get_advantage_fn(advantage),
        normalize_std=normalize_std,
        filter_zero_variance=False,
        filter_unsolved=False,
        capacity=4,
    )
    coord.dispatch()
    buf.open(Dispatch(0, {"id": "t0"}, "t0", 0))
    return coord, buf


async def group(
    outcomes: list[str], normalize_std: bool, advantage: str = "grpo", min_group_size: int = 2
):
    """The rollouts of one group, each calling the sandbox once (its outcome in `outcomes`), run
    through `run_rollout` into a buffer of `len(outcomes)`: the group's outcome and ready group."""
    sandbox = Sandbox(outcomes)
    workflow, policy = coding_workflow(sandbox), ScriptedPolicy(coder)
    _, buf = buffer(len(outcomes), min_group_size, normalize_std, advantage)
    rollouts = []
    for i in range(len(outcomes)):  # one after another: call i is rollout i's
        r = await rollout(workflow, policy, i)
        rollouts.append(r)
        buf.add(0, i, r.episode, r.infra_failed)
    outcome = await buf.complete(0)
    ready = await buf.get() if outcome.state is GroupState.BUFFERED else None
    return rollouts, outcome, ready


@pytest.mark.parametrize("advantage", ["grpo", "rloo"])
@pytest.mark.parametrize("normalize_std", [False, True])
@pytest.mark.parametrize("seed", range(8))
def test_survivors_of_sandbox_deaths_get_the_advantages_of_a_group_without_the_dead(
    seed: int, normalize_std: bool, advantage: str
) -> None:
    rng = random.Random(seed)
    size = rng.randint(4, 12)
    rewards = [str(rng.choice([0, 1, 2, 5, rng.randint(-3, 9)])) for _ in range(size)]
    dead = set(rng.sample(range(size), rng.randint(1, size - 2)))
    with_deaths = ["dead" if i in dead else r for i, r in enumerate(rewards)]
    survivors = [r for i, r in enumerate(rewards) if i not in dead]

    rollouts, outcome, ready = run(group(with_deaths, normalize_std, advantage), virtual=True)
    _, alone_outcome, alone = run(group(survivors, normalize_std, advantage), virtual=True)
    assert alone_outcome.infra_failed == 0

    assert [r.infra_failed for r in rollouts] == [i in dead for i in range(size)]
    assert outcome.state is GroupState.BUFFERED and outcome.infra_failed == len(dead)
    assert ready is not None and alone is not None
    [g], [g_alone] = ready.groups, alone.groups
    assert g.rewards == g_alone.rewards == [float(r) for r in survivors]
    assert g.advantages == g_alone.advantages  # exactly: the same floats
    # The dead are not trained: a sequence per survivor, none of theirs.
    assert len(list(g.training_sequences())) == len(survivors)
    assert len(ready.episodes) == len(survivors)


def test_a_group_with_too_few_survivors_fails_and_says_its_infrastructure_was_among_the_causes():
    rollouts, outcome, ready = run(group(["dead", "dead", "dead", "1"], False), virtual=True)
    assert [r.infra_failed for r in rollouts] == [True, True, True, False]
    assert outcome.state is GroupState.FAILED and ready is None
    assert outcome.infra_failed == 3 and len(outcome.episodes) == 1


def test_a_model_error_in_a_tool_is_still_the_models_reward() -> None:
    sandbox = Sandbox(["bad"])
    r = run(rollout(coding_workflow(sandbox), ScriptedPolicy(coder)), virtual=True)
    assert not r.infra_failed and r.episode is not None
    assert r.episode.metrics["tool_calls"] == 1
    # The model saw its error and answered with it: scored (0, as it is no number), trained.
    assert "NameError" in r.episode.trajectories[0].steps[-1].messages[-1]["content"]
    assert r.episode.reward == 0.0 and r.episode.termination is Termination.DONE


def test_an_infra_failure_is_retried_and_the_retry_counts() -> None:
    sandbox = Sandbox(["dead", "7"])
    seen: list[dict[str, float]] = []
    r = run(
        rollout(coding_workflow(sandbox), ScriptedPolicy(coder), retries=1, report=seen.append),
        virtual=True,
    )
    assert r.episode is not None and r.episode.reward == 7.0 and not r.infra_failed
    assert [m.get("rollout/infra_errors", 0) for m in seen] == [1, 0]
    assert seen[1] == {"rollout/retries": 1}


def test_the_infra_failure_names_the_tool_and_its_message() -> None:
    r = run(rollout(coding_workflow(Sandbox(["dead"])), ScriptedPolicy(coder)), virtual=True)
    assert r.episode is None and r.infra_failed
    assert r.last_error == (
        "tool run_code: SandboxError: sandbox 3f2a: container exited (OOM-killed)"
    )


class Marking(Workflow):
    """Generates, then says its infrastructure failed (or raises `error`), and returns a reward."""

    def __init__(self, error: Callable[[], BaseException] | None = None) -> None:
        self.error = error

    async def run(self, task: dict[str, Any], ctx: RolloutContext) -> float:
        await ctx.generate([1, 2, 3])
        if self.error is not None:
            raise self.error()
        ctx.mark_infra_failed("grader service: 503 Service Unavailable")
        return 1.0


class ConnectionDropped(Exception):
    """A client library's error that cannot subclass InfraError."""


async def _in_task_group() -> None:
    async def dies() -> None:
        raise SandboxError("pod evicted")

    async with asyncio.TaskGroup() as tg:
        tg.create_task(dies())


@pytest.mark.parametrize(
    ("workflow", "why"),
    [
        (Marking(), "grader service: 503 Service Unavailable"),
        (Marking(lambda: SandboxError("pod evicted")), "SandboxError: pod evicted"),
        (Marking(lambda: ConnectionDropped("reset by peer")), "ConnectionDropped: reset by peer"),
    ],
)
def test_a_workflow_says_so_by_marking_raising_or_a_registered_type(workflow, why) -> None:
    register_infra_error(ConnectionDropped)
    r = run(rollout(workflow, ScriptedPolicy(lambda p: "x")), virtual=True)
    assert r.episode is None and r.infra_failed and r.last_error == why


def test_an_infra_failure_inside_an_exception_group_counts() -> None:
    class Grouped(Workflow):
        async def run(self, task: dict[str, Any], ctx: RolloutContext) -> float:
            await _in_task_group()
            return 1.0

    r = run(rollout(Grouped(), ScriptedPolicy(lambda p: "x")), virtual=True)
    assert r.infra_failed and r.last_error == "SandboxError: pod evicted"


def test_an_ordinary_error_is_not_an_infra_failure() -> None:
    r = run(
        rollout(Marking(lambda: ValueError("bad")), ScriptedPolicy(lambda p: "x")), virtual=True
    )
    assert r.episode is None and not r.infra_failed and r.last_error == "ValueError: bad"


class DyingEnv:
    """An env whose sandbox dies at `reset` or at the first `step`."""

    closed = 0

    def __init__(self, at: str = "step") -> None:
        self.at = at

    def reset(self, task: dict[str, Any]) -> str:
        if self.at == "reset":
            raise SandboxError("sandbox never started: image pull failed")
        return "what is 6*7?"

    def step(self, action: str) -> tuple[str, float, bool]:
        raise SandboxError("sandbox 3f2a: container exited (OOM-killed)")

    def close(self) -> None:
        DyingEnv.closed += 1


@pytest.mark.parametrize("at", ["reset", "step"])
def test_env_infra_failures_mark_the_rollout_and_close_the_env(at: str) -> None:
    DyingEnv.closed = 0
    wf = EnvWorkflow(DyingEnv, env_args={"at": at}, max_turns=3)
    r = run(rollout(wf, ScriptedPolicy(lambda p: "42")), virtual=True)
    assert r.episode is None and r.infra_failed and DyingEnv.closed == 1
    assert r.last_error.startswith("env DyingEnv: SandboxError: sandbox")


# -- the breaker -----------------------------------------------------------------------------------


def _breaker(window: int, max_rate: float, max_infra: float) -> FailureRateBreaker:
    config = Config.model_validate(
        {
            "rollout": {
                "failure_window": window,
                "max_failure_rate": max_rate,
                "max_infra_failure_rate": max_infra,
            }
        }
    )
    return FailureRateBreaker(config)


@pytest.mark.parametrize("seed", range(20))
def test_the_breaker_counts_infra_failures_apart_and_trips_on_each_limit_exactly(seed) -> None:
    rng = random.Random(seed)
    window = rng.choice([1, 5, 40, 200])
    max_rate, max_infra = rng.choice([0.1, 0.3, 0.5, 0.9]), rng.choice([0.1, 0.3, 0.5, 0.9])
    p_fail, p_infra = rng.uniform(0.0, 0.4), rng.uniform(0.0, 0.6)
    breaker = _breaker(window, max_rate, max_infra)
    kinds: list[str] = []
    for _ in range(1000):
        u = rng.random()
        kind = "infra" if u < p_infra else "error" if u < p_infra + p_fail else "ok"
        kinds.append(kind)
        recent = kinds[-window:]
        full = len(recent) >= min(window, 32)
        infra_trips = full and recent.count("infra") / len(recent) > max_infra
        error_trips = full and recent.count("error") / len(recent) > max_rate
        args = (kind != "ok", f"{kind} boom" if kind != "ok" else "", kind == "infra")
        if infra_trips:
            with pytest.raises(InfraFailureRateError, match="last error: infra boom"):
                breaker.observe(*args)
            return
        if error_trips:
            with pytest.raises(FailureRateError, match="last error: error boom") as e:
                breaker.observe(*args)
            assert not isinstance(e.value, InfraFailureRateError)
            return
        breaker.observe(*args)


# -- whole runs ------------------------------------------------------------------------------------


class SandboxWorkflow(Workflow):
    """Generates, then runs the model's code in a sandbox: rollout `i` of a task scores `i % 2`,
    unless `dies(task, i, attempt)`, when the sandbox dies (SandboxError)."""

    def __init__(self, dies: Callable[[dict[str, Any], int, int], bool]) -> None:
        self.dies = dies

    async def run(self, task: dict[str, Any], ctx: RolloutContext) -> float:
        await ctx.generate([1, 2, 3])
        if self.dies(task, ctx.rollout_index, ctx.attempt):
            raise SandboxError(f"sandbox for {task['id']}/{ctx.rollout_index}: container died")
        return float(ctx.rollout_index % 2)


def test_a_run_trains_survivors_counts_the_dead_and_drops_groups_with_too_few(tmp_path) -> None:
    # t0 loses rollout 0 to its sandbox (3 of 4 survive); t1 loses three (1 < min 2: the group
    # fails); no retries, so each loss stays lost.
    def dies(task: dict[str, Any], i: int, attempt: int) -> bool:
        return (task["id"] == "t0" and i == 0) or (task["id"] == "t1" and i < 3)

    backend = FakeBackend(latency=lambda: 0.1)
    cfg = make_config(
        tmp_path,
        train={"total_steps": 3, "groups_per_step": 4, "micro_batch_groups": 4},
        rollout={"retries": 0, "min_group_size": 2, "max_infra_failure_rate": 0.9},
        data={"train": {"generator": "tests.fakes:tasks", "args": {"n": 12}, "shuffle": False}},
        coordinator={"pipeline_depth": 0, "max_staleness": 0},
    )
    records = run(
        UnifiedTrainer(cfg, backend=backend, workflow=SandboxWorkflow(dies)).fit(), virtual=True
    )
    trained = {task_id: rewards for step in backend.trained for task_id, rewards in step}
    assert trained["t0"] == (1.0, 0.0, 1.0)  # rollouts 1-3; rollout 0 never trained
    assert "t1" not in trained
    total = {k: sum(r.get(k, 0) for r in records) for r in records for k in r}
    # t0 runs again in the data's second epoch (13 groups dispatched), and loses rollout 0 again.
    assert total["rollout/infra_failed"] == 5 and total["rollout/infra_errors"] == 5
    assert sum(r.get("rollout/failures", 0) for r in records) == 0
    assert total["groups/failed"] == 1 and total["groups/failed_infra"] == 1
    # Of the rollouts that ended in each record: 4 of step 1's 5 groups' 20, then of 16 each.
    assert [r["rollout/infra_failed_frac"] for r in records] == [4 / 20, 0.0, 1 / 16]
    assert [len(step) for step in backend.trained] == [4, 4, 4]


def test_infra_failures_retried_away_leave_every_group_whole(tmp_path) -> None:
    backend = FakeBackend(latency=lambda: 0.1)
    cfg = make_config(tmp_path, rollout={"retries": 1})
    workflow = SandboxWorkflow(lambda task, i, attempt: i == 0 and attempt == 0)
    records = run(
        UnifiedTrainer(cfg, backend=backend, workflow=workflow, train_tasks=tasks(30)).fit(),
        virtual=True,
    )
    assert sum(r.get("rollout/infra_errors", 0) for r in records) >= 20
    assert sum(r.get("rollout/infra_failed", 0) for r in records) == 0
    assert all(len(rewards) == 4 for step in backend.trained for _, rewards in step)


class ScriptedBackend(FakeBackend):
    """The fake learner, its policy a scripted chat model."""

    def __init__(self, reply: Callable[[str], str]) -> None:
        super().__init__()
        self._policy = ScriptedPolicy(reply)  # type: ignore[assignment]


def test_the_breaker_stops_a_run_whose_every_tool_call_dies(tmp_path) -> None:
    sandbox = Sandbox(["dead"] * 10_000)
    cfg = make_config(tmp_path, rollout={"retries": 1, "max_concurrency": 8, "max_tokens": 128})
    trainer = UnifiedTrainer(
        cfg,
        backend=ScriptedBackend(coder),
        workflow=coding_workflow(sandbox),
        train_tasks=tasks(50),
    )
    with pytest.raises(InfraFailureRateError) as e:
        run(trainer.fit(), virtual=True)
    message = str(e.value)
    assert "100% of the last 32 rollouts failed for their infrastructure, not the model" in message
    assert "tool run_code: SandboxError: sandbox 3f2a: container exited (OOM-killed)" in message
    assert "rollout.max_infra_failure_rate" in message and "Fix that service" in message


def test_the_breaker_stops_a_sim_backend_run_whose_environment_always_dies(tmp_path) -> None:
    config = config_from_dict(
        {
            "name": "dead-sandbox",
            "run_dir": str(tmp_path),
            "backend": {"name": "sim", "latency": "zero"},
            "workflow": {
                "cls": "rllm_async.workflows:EnvWorkflow",
                "args": {"env": "tests.test_infra_failures:DyingEnv", "max_turns": 2},
            },
            "data": {
                "train": {
                    "generator": "rllm_async.workflows.sim:synthetic_tasks",
                    "args": {"n": 64},
                }
            },
            "rollout": {"group_size": 4, "max_tokens": 8},
            "train": {"total_steps": 3, "groups_per_step": 2},
            "checkpoint": {"resume": "never", "at_end": False},
            "logging": {"progress_bar": False},
        }
    )
    with pytest.raises(InfraFailureRateError, match=r"last error: env DyingEnv: SandboxError"):
        UnifiedTrainer(config).run()


def test_an_evaluation_counts_infra_failures_and_leaves_them_out_of_its_means(tmp_path) -> None:
    from rllm_async.evaluation import Evaluator
    from tests.fakes import FakePolicy

    workflow = SandboxWorkflow(lambda task, i, attempt: task["id"] in ("t1", "t2"))
    cfg = make_config(tmp_path, eval={"every_steps": 1})
    evaluator = Evaluator(cfg, workflow, tasks(5), [], 256)
    out = run(evaluator.evaluate(FakePolicy(), SyncPause()), virtual=True)
    assert out["eval/n"] == 3 and out["eval/failed"] == 2 and out["eval/infra_failed"] == 2
    assert out["eval/reward/mean"] == 0.0  # rollout 0 of each task scores 0; the dead are not 0s


def test_only_exception_types_can_be_registered() -> None:
    with pytest.raises(TypeError, match="exception types"):
        register_infra_error("requests.ConnectionError")  # type: ignore[arg-type]
