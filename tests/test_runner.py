"""The runner on its own: `run_rollout`'s attempts (each under its own deadline, retried, their
failures reported as metrics and the last one's reason kept), `configured_parser`, and
`build_workflow` from `workflow.cls` and `workflow.args`."""

from __future__ import annotations

import asyncio
import re
from collections.abc import Callable
from typing import Any

import pytest

from rllm_async.config import ConfigError
from rllm_async.protocols import SamplingParams
from rllm_async.rollout import RolloutContext, SyncPause
from rllm_async.rollout.reply_parser import reply_parser
from rllm_async.runner import Rollout, build_workflow, configured_parser, run_rollout
from rllm_async.types import Episode
from rllm_async.vclock import run
from rllm_async.workflows.base import Workflow
from tests.fakes import FakePolicy, ScriptedWorkflow, make_config

TASK = {"id": "t0", "prompt": "task 0"}
TOKENS = 3  # FakePolicy's completions


class Attempts(Workflow):
    """Generates once, then does what `script(attempt)` says: "ok" (reward 1), "raise" or "hang"
    (waits on an event that never fires); keeps the context of every attempt."""

    def __init__(self, script: Callable[[int], str], *, generate_first: bool = True) -> None:
        self.script = script
        self.generate_first = generate_first
        self.contexts: list[RolloutContext] = []

    async def run(self, task: dict[str, Any], ctx: RolloutContext) -> float:
        self.contexts.append(ctx)
        if self.generate_first:
            await ctx.generate([1, 2, 3])
        what = self.script(ctx.attempt)
        if what == "raise":
            raise ValueError(f"attempt {ctx.attempt} failed")
        if what == "hang":
            await asyncio.Event().wait()
        return 1.0

    @property
    def attempts(self) -> list[int]:
        return [ctx.attempt for ctx in self.contexts]


def rollout(
    workflow: Workflow,
    policy: FakePolicy,
    *,
    timeout_s: float = 10.0,
    retries: int = 0,
    pin: bool = True,
    pause: SyncPause | None = None,
    **kwargs: Any,
) -> tuple[Rollout, list[dict[str, float]]]:
    """`run_rollout` of TASK on the virtual clock: what it came to, and every report it made."""
    reports: list[dict[str, float]] = []
    out = run(
        run_rollout(
            workflow,
            TASK,
            policy,
            sampling=SamplingParams(),
            pin=pin,
            timeout_s=timeout_s,
            retries=retries,
            pause=pause or SyncPause(),
            report=reports.append,
            **kwargs,
        ),
        virtual=True,
    )
    return out, reports


def failed(kind: str, tokens: int = TOKENS) -> dict[str, float]:
    return {kind: 1, "tokens/generated": tokens, "tokens/wasted": tokens}


RETRY = {"rollout/retries": 1}


# run_rollout


def test_a_first_attempt_that_succeeds_reports_nothing_and_names_the_task() -> None:
    class OtherId(Workflow):
        async def run(self, task: dict[str, Any], ctx: RolloutContext) -> Episode:
            await ctx.generate([1])
            return Episode(task_id="something else", reward=0.5)

    policy = FakePolicy()
    out, reports = rollout(OtherId(), policy, retries=3)
    assert out.episode is not None and out.last_error == ""
    assert out.episode.task_id == "t0"  # whatever the workflow put there
    assert out.episode.reward == 0.5
    assert [len(t.steps) for t in out.episode.trajectories] == [1]
    assert reports == []
    assert policy.calls == 1


def test_errors_are_retried_and_each_failed_attempt_is_reported() -> None:
    workflow = Attempts(lambda attempt: "raise" if attempt < 2 else "ok")
    out, reports = rollout(workflow, FakePolicy(), retries=2)
    assert out.episode is not None and out.episode.reward == 1.0
    assert workflow.attempts == [0, 1, 2]
    assert reports == [failed("rollout/errors"), RETRY, failed("rollout/errors"), RETRY]


def test_when_every_attempt_fails_the_last_error_is_kept() -> None:
    workflow = Attempts(lambda attempt: "raise")
    out, reports = rollout(workflow, FakePolicy(), retries=2)
    assert out.episode is None
    assert out.last_error == "ValueError: attempt 2 failed"
    assert workflow.attempts == [0, 1, 2]
    assert reports == [failed("rollout/errors"), RETRY] * 2 + [failed("rollout/errors")]


def test_no_retries_means_one_attempt() -> None:
    workflow = Attempts(lambda attempt: "raise")
    out, reports = rollout(workflow, FakePolicy(), retries=0)
    assert out.episode is None and out.last_error == "ValueError: attempt 0 failed"
    assert workflow.attempts == [0]
    assert reports == [failed("rollout/errors")]


def test_a_failure_before_any_model_call_wastes_no_tokens() -> None:
    workflow = Attempts(lambda attempt: "raise", generate_first=False)
    out, reports = rollout(workflow, FakePolicy())
    assert out.episode is None
    assert reports == [failed("rollout/errors", tokens=0)]


def test_an_episode_the_context_refuses_is_a_failed_attempt() -> None:
    class BadMetric(Workflow):
        async def run(self, task: dict[str, Any], ctx: RolloutContext) -> Episode:
            await ctx.generate([1])
            return Episode(task_id=task["id"], metrics={"score": "high"})

    out, reports = rollout(BadMetric(), FakePolicy(), retries=1)
    assert out.episode is None
    assert out.last_error.startswith("ValueError: Episode.metrics['score'] is 'high'")
    assert reports == [failed("rollout/errors"), RETRY, failed("rollout/errors")]


def test_a_rollout_that_never_returns_times_out_on_every_attempt() -> None:
    workflow = Attempts(lambda attempt: "hang")
    policy = FakePolicy()
    out, reports = rollout(workflow, policy, timeout_s=0.5, retries=1)
    assert out.episode is None
    assert out.last_error == "rollout timed out after rollout.timeout_s=0.5s"
    assert workflow.attempts == [0, 1]
    assert reports == [failed("rollout/timeouts"), RETRY, failed("rollout/timeouts")]
    assert policy.live == {}, "every attempt's pinned snapshot is released"


def test_each_attempt_gets_a_deadline_of_its_own() -> None:
    class HangsThenSlow(Workflow):
        """Attempt 0 never returns; attempt 1 takes 0.8 of the timeout: it succeeds only with a
        fresh deadline, not with what attempt 0 left of its own."""

        async def run(self, task: dict[str, Any], ctx: RolloutContext) -> float:
            if ctx.attempt == 0:
                await asyncio.Event().wait()
            await asyncio.sleep(0.8)
            await ctx.generate([1])
            return 1.0

    out, reports = rollout(HangsThenSlow(), FakePolicy(), timeout_s=1.0, retries=1)
    assert out.episode is not None and out.episode.reward == 1.0
    assert reports == [failed("rollout/timeouts", tokens=0), RETRY]


def test_a_model_call_cut_by_the_timeout_is_metered_to_its_end() -> None:
    class Meter:
        def __init__(self) -> None:
            self.began = self.ended = 0

        def call_began(self) -> None:
            self.began += 1

        def call_ended(self) -> None:
            self.ended += 1

    meter = Meter()
    policy = FakePolicy(latency=lambda: 60.0)  # every call outlasts the rollout's timeout
    out, reports = rollout(ScriptedWorkflow(), policy, timeout_s=1.0, retries=1, meter=meter)
    assert out.episode is None and out.last_error.startswith("rollout timed out")
    assert reports == [failed("rollout/timeouts", tokens=0), RETRY, failed("rollout/timeouts", 0)]
    assert (meter.began, meter.ended) == (2, 2)
    assert policy.live == {}


def test_the_context_gets_the_rollout_the_version_and_the_parser() -> None:
    workflow = Attempts(lambda attempt: "raise" if attempt == 0 else "ok")
    policy = FakePolicy()
    policy.version = 9
    parser = reply_parser(policy.tokenizer, "mistral", "none")
    out, _ = rollout(workflow, policy, retries=1, rollout_index=5, version=7, parser=parser)
    assert out.episode is not None
    assert [(c.task_id, c.rollout_index, c.attempt) for c in workflow.contexts] == [
        ("t0", 5, 0),
        ("t0", 5, 1),
    ]
    assert all(c.parser is parser for c in workflow.contexts)
    assert out.episode.trajectories[0].steps[0].versions == [7] * TOKENS  # not the policy's 9
    assert policy.live == {}, "a version given by the caller is the caller's to release"


def test_pin_holds_the_first_calls_version_and_releases_it() -> None:
    class TwoCalls(Workflow):
        def __init__(self, policy: FakePolicy) -> None:
            self.policy = policy

        async def run(self, task: dict[str, Any], ctx: RolloutContext) -> float:
            await ctx.generate([1])
            self.policy.version += 1  # a weight sync between the two calls
            await ctx.generate([2])
            return 0.0

    policy = FakePolicy()
    policy.version = 3
    out, _ = rollout(TwoCalls(policy), policy)
    assert out.episode is not None
    assert [s.versions for s in out.episode.trajectories[0].steps] == [[3] * TOKENS] * 2
    assert policy.live == {}

    policy.version = 3
    out, _ = rollout(TwoCalls(policy), policy, pin=False)
    assert out.episode is not None
    assert [s.versions for s in out.episode.trajectories[0].steps] == [[3] * TOKENS, [4] * TOKENS]


# configured_parser


@pytest.mark.parametrize(
    ("tool_parser", "reasoning_parser", "tool", "reasoning"),
    [
        ("auto", "auto", "hermes", None),  # the byte tokenizer names no family
        ("mistral", "think", "mistral", ("<think>", "</think>")),
        ("harmony", "mistral_think", "harmony", ("[THINK]", "[/THINK]")),
        ("llama3_json", "none", "llama3_json", None),
    ],
)
def test_configured_parser_follows_the_rollout_section(
    tmp_path, tool_parser: str, reasoning_parser: str, tool: str, reasoning: Any
) -> None:
    config = make_config(
        tmp_path, rollout={"tool_parser": tool_parser, "reasoning_parser": reasoning_parser}
    )
    parser = configured_parser(config, FakePolicy())
    assert parser.tool.name == tool
    assert parser.reasoning == reasoning


# build_workflow


class Greeter(Workflow):
    def __init__(self, greeting: str, times: int = 1) -> None:
        self.greeting = greeting
        self.times = times

    async def run(self, task: dict[str, Any], ctx: RolloutContext) -> float:
        return 0.0


def not_a_class() -> None:
    return None


def test_build_workflow_builds_the_named_class_with_its_args(tmp_path) -> None:
    config = make_config(
        tmp_path, workflow={"cls": f"{__name__}:Greeter", "args": {"greeting": "hi", "times": 2}}
    )
    workflow = build_workflow(config)
    assert isinstance(workflow, Greeter)
    assert (workflow.greeting, workflow.times) == ("hi", 2)
    dotted = make_config(tmp_path, workflow={"cls": "tests.fakes.ScriptedWorkflow"})
    assert type(build_workflow(dotted)) is ScriptedWorkflow


@pytest.mark.parametrize(
    ("cls", "error"),
    [
        (
            "no_such_package_here:Workflow",
            "workflow.cls: cannot import module 'no_such_package_here'",
        ),
        ("tests.fakes:NoSuchWorkflow", "workflow.cls: module 'tests.fakes' has no attribute"),
        ("Workflow", "workflow.cls: 'Workflow' is not an import path"),
        (
            "tests.fakes:FakePolicy",
            "workflow.cls: tests.fakes:FakePolicy is not a Workflow subclass",
        ),
        (f"{__name__}:not_a_class", "is not a Workflow subclass"),
    ],
)
def test_build_workflow_refuses_what_is_not_a_workflow_class(
    tmp_path, cls: str, error: str
) -> None:
    config = make_config(tmp_path, workflow={"cls": cls})
    with pytest.raises(ConfigError, match=re.escape(error)):
        build_workflow(config)


@pytest.mark.parametrize(
    ("cls", "args", "error"),
    [
        (
            f"{__name__}:Greeter",
            {"greeting": "hi", "loudly": True},
            "unexpected keyword argument 'loudly'",
        ),
        (f"{__name__}:Greeter", {}, "missing 1 required positional argument: 'greeting'"),
        ("rllm_async.workflows.SingleTurnWorkflow", {}, "'reward_fn'"),
    ],
)
def test_build_workflow_names_the_class_when_its_args_do_not_fit(
    tmp_path, cls: str, args: dict[str, Any], error: str
) -> None:
    config = make_config(tmp_path, workflow={"cls": cls, "args": args})
    match = re.escape(f"workflow.args for {cls}: ") + ".*" + re.escape(error)
    with pytest.raises(ConfigError, match=match) as raised:
        build_workflow(config)
    assert raised.value.__cause__ is None  # the TypeError's traceback is not the user's to read
