"""Reward functions from config: files and modules beside the config, weighted sums with a metric
each, and conversational prompts."""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from rllm_async.config import ConfigError, config_dirs, load_config
from rllm_async.imports import import_object
from rllm_async.workflows import SingleTurnWorkflow
from rllm_async.workflows.callables import load_rewards, score_all
from rllm_async.workflows.prompt import task_messages
from tests.scripted import ScriptedPolicy, context

REWARD_FILE = """
def shout(task, text):
    return 1.0 if text.isupper() else 0.0
"""


@pytest.fixture
def config_dir(tmp_path, monkeypatch) -> Iterator[Path]:
    """A config file in a directory of its own, loaded from another working directory."""
    (tmp_path / "cfg").mkdir()
    (tmp_path / "cfg" / "run.yaml").write_text("name: r\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", list(sys.path))
    saved = list(config_dirs)
    config_dirs.clear()
    yield tmp_path / "cfg"
    config_dirs[:] = saved


def test_a_reward_file_or_module_beside_the_config_is_found(config_dir) -> None:
    (config_dir / "myreward.py").write_text(REWARD_FILE)
    (config_dir / "sub").mkdir()
    (config_dir / "sub" / "other.py").write_text(REWARD_FILE)
    with pytest.raises(ConfigError, match="cannot import module 'myreward'"):
        import_object("myreward:shout", "workflow.args.reward_fn")
    load_config(config_dir / "run.yaml")
    assert import_object("myreward:shout", "x")({}, "HI") == 1.0
    fn = import_object("sub/other.py:shout", "x")
    assert fn({}, "hi") == 0.0
    assert import_object(str(config_dir / "sub" / "other.py") + ":shout", "x") is fn
    with pytest.raises(ConfigError, match=r"file 'nope.py' not found"):
        import_object("nope.py:shout", "x")
    with pytest.raises(ConfigError, match="has no attribute 'missing'"):
        import_object("myreward:missing", "x")


def test_load_config_records_the_config_directory(tmp_path) -> None:
    (tmp_path / "a.yaml").write_text("name: a\n")
    load_config(tmp_path / "a.yaml")
    assert config_dirs[0] == tmp_path.resolve()


def test_a_reward_module_in_the_working_directory_is_found(config_dir) -> None:
    (config_dir.parent / "cwdreward.py").write_text(REWARD_FILE)
    assert import_object("cwdreward.shout", "x")({}, "OK") == 1.0


def length(task: dict[str, Any], text: str) -> float:
    return float(len(text))


def exact(task: dict[str, Any], text: str) -> tuple[float, bool]:
    return (1.0, True) if text == task["answer"] else (0.0, False)


def test_weighted_rewards_sum_and_report_each_part() -> None:
    rewards = load_rewards(
        [f"{__name__}:exact", {"fn": f"{__name__}:length", "weight": 0.5, "name": "len"}], "r"
    )
    assert [(r.name, r.weight) for r in rewards] == [("exact", 1.0), ("len", 0.5)]
    assert score_all(rewards, {"answer": "ab"}, "ab") == (2.0, True, {"exact": 1.0, "len": 2.0})
    assert score_all(rewards, {"answer": "x"}, "ab") == (1.0, False, {"exact": 0.0, "len": 2.0})
    assert score_all(load_rewards(length, "r"), {}, "abc") == (3.0, None, {"length": 3.0})
    with pytest.raises(ConfigError, match="repeat"):
        load_rewards([length, length], "r")
    with pytest.raises(ConfigError, match=r"r\[0\].weight: 'a lot' is not a finite number"):
        load_rewards([{"fn": length, "weight": "a lot"}], "r")
    with pytest.raises(ConfigError, match="give a function"):
        load_rewards([{"function": length}], "r")
    with pytest.raises(ConfigError, match="empty list"):
        load_rewards([], "r")


def test_single_turn_logs_each_weighted_reward_and_takes_chat_prompts() -> None:
    workflow = SingleTurnWorkflow(
        reward_fn=[exact, {"fn": length, "weight": 0.5}], system_prompt="Be brief."
    )
    policy = ScriptedPolicy(lambda prompt: "ab")
    chat = [{"role": "user", "content": "say ab"}]
    episode = asyncio.run(
        workflow.run({"id": "t", "prompt": chat, "answer": "ab"}, context(policy))
    )
    assert episode.trajectories[0].reward == 2.0 and episode.is_correct
    assert episode.metrics == {"reward/exact": 1.0, "reward/length": 2.0}
    (step,) = episode.trajectories[0].steps
    assert step.messages[:2] == [{"role": "system", "content": "Be brief."}, *chat]
    assert chat == [{"role": "user", "content": "say ab"}]  # the row itself is not changed


def test_conversational_prompts_are_messages() -> None:
    own_system = [{"role": "system", "content": "S"}, {"role": "user", "content": "q"}]
    assert task_messages({"p": own_system}, "p", "ignored") == own_system
    assert task_messages({"p": "q"}, "p", None) == [{"role": "user", "content": "q"}]
    with pytest.raises(ValueError, match="must be chat messages"):
        task_messages({"id": "t", "p": ["just text"]}, "p", None)
