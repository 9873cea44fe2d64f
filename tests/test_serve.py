"""`serve --train`'s trainer: built from the config's `rollout` and `online` sections, its groups
waiting a day for their episodes unless `rollout.timeout_s` says otherwise, and refusing data."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from rllm_async.config import ConfigError, config_from_dict
from rllm_async.serve import ONLINE_WAIT_S, online_trainer
from rllm_async.workflows.online import OnlineWorkflow


def online(tmp_path: Path, **sections: Any) -> Any:
    config = config_from_dict(
        {
            "run_dir": str(tmp_path),
            "backend": {"name": "local", "model": "tiny"},
            "rollout": {"group_size": 3, "temperature": 0.7, **sections.pop("rollout", {})},
            "online": {"group_by": "prompt", "session_ttl_s": 30},
            **sections,
        }
    )
    return online_trainer(config, host="127.0.0.1", port=0, api_key="k", model="m")


def test_the_online_workflow_and_the_wait_come_from_the_config(tmp_path: Path) -> None:
    trainer = online(tmp_path)
    workflow = trainer.workflow
    assert isinstance(workflow, OnlineWorkflow)
    assert workflow.groups.group_size == 3 and workflow.group_by == "prompt"
    assert workflow.sampling.temperature == 0.7 and workflow.session_ttl_s == 30
    assert (workflow.api_key, workflow.model) == ("k", "m")
    ro, co = trainer.config.rollout, trainer.config.coordinator
    assert ro.timeout_s == ONLINE_WAIT_S and ro.temperature == 0.7
    assert co.stall_timeout_s >= ONLINE_WAIT_S * (ro.retries + 1)
    assert online(tmp_path, rollout={"timeout_s": 60}).config.rollout.timeout_s == 60


@pytest.mark.parametrize("split", ["train", "eval"])
def test_online_training_refuses_a_dataset(tmp_path: Path, split: str) -> None:
    with pytest.raises(ConfigError, match=f"remove data.{split}"):
        online(tmp_path, data={split: {"path": "tasks.jsonl"}})
