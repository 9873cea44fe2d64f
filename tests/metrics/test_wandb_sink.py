"""The wandb sink (offline): which mode `auto` picks and says, the run's group/tags/notes, and a
resumed run continuing the same wandb run."""

from __future__ import annotations

import logging
import re

import pytest

from rllm_async.config import WandbConfig
from rllm_async.metrics import WandbSink, wandb_mode
from rllm_async.trainer import UnifiedTrainer
from rllm_async.vclock import run
from tests.fakes import FakeBackend, ScriptedWorkflow, make_config, tasks

wandb = pytest.importorskip("wandb", reason="an optional extra: pip install 'rllm-async[wandb]'")


@pytest.fixture(autouse=True)
def no_credentials(tmp_path, monkeypatch):
    """No credentials anywhere wandb looks, and none left in the session afterwards."""
    for var in ("WANDB_API_KEY", "WANDB_MODE", "WANDB_BASE_URL"):
        monkeypatch.delenv(var, raising=False)
    (tmp_path / "netrc").write_text("")
    monkeypatch.setenv("NETRC", str(tmp_path / "netrc"))
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(tmp_path / "wandb-config"))
    monkeypatch.setenv("WANDB_DIR", str(tmp_path / "wandb-dir"))
    monkeypatch.setenv("WANDB_SILENT", "true")
    yield
    wandb.teardown()


def test_auto_is_online_with_the_credentials_wandb_login_stored(tmp_path, caplog) -> None:
    (tmp_path / "netrc").write_text(f"machine api.wandb.ai\n  login user\n  password {'a' * 40}\n")
    (tmp_path / "netrc").chmod(0o600)
    with caplog.at_level(logging.INFO, logger="rllm_async"):
        assert wandb_mode("auto") == "online"
    assert "wandb: logging online (wandb found credentials" in caplog.text


def test_auto_is_offline_without_credentials_and_says_so(tmp_path, caplog) -> None:
    with caplog.at_level(logging.INFO, logger="rllm_async"):
        assert wandb_mode("online") == "online"
    assert "wandb: logging online (logging.wandb.mode is online)" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="rllm_async"):
        sink = WandbSink(WandbConfig(mode="auto"), "run", {}, tmp_path)
        sink.close()
    [line] = [r for r in caplog.records if "wandb:" in r.getMessage()]
    assert line.levelno == logging.WARNING
    assert "logging offline" in line.getMessage() and "wandb login" in line.getMessage()


def test_group_tags_and_notes_reach_the_run(tmp_path) -> None:
    settings = WandbConfig(mode="offline", group="sweep-1", tags=["grpo", "tiny"], notes="a note")
    sink = WandbSink(settings, "run", {"lr": 1e-3}, tmp_path)
    try:
        assert sink._run.group == "sweep-1"
        assert tuple(sink._run.tags) == ("grpo", "tiny")
        assert sink._run.notes == "a note"
    finally:
        sink.close()
    assert (tmp_path / "wandb_run_id").read_text() == sink.run_id


def test_a_resumed_run_continues_the_same_wandb_run(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("WANDB_MODE", "offline")

    def fit(total_steps: int) -> list[dict[str, float]]:
        cfg = make_config(
            tmp_path,
            train={"total_steps": total_steps},
            checkpoint={"resume": "auto", "at_end": True},
            logging={"wandb": {"enabled": True}},
        )
        trainer = UnifiedTrainer(
            cfg, backend=FakeBackend(), workflow=ScriptedWorkflow(), train_tasks=tasks(40)
        )
        return run(trainer.fit(), virtual=True)

    assert fit(2)[-1]["step"] == 2
    run_path = tmp_path / "runs" / "test"
    first_id = (run_path / "wandb_run_id").read_text()
    assert fit(4)[0]["step"] == 3, "the second fit resumed from the checkpoint of step 2"
    assert (run_path / "wandb_run_id").read_text() == first_id
    runs = sorted((run_path / "wandb").glob("offline-run-*"))  # -N: a second one that second
    assert len(runs) == 2 and all(re.search(rf"-{first_id}(-\d+)?$", r.name) for r in runs)
    assert all(list(r.glob("*.wandb")) for r in runs), "each with its log of the records"
