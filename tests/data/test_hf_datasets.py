"""`data.<split>.hf`: Hugging Face datasets, read from local files or the cache with the Hub off."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest

from rllm_async.config import ConfigError, DatasetConfig, config_from_dict
from rllm_async.data import DataError, load_tasks
from rllm_async.workflows.prompt import task_messages

datasets = pytest.importorskip("datasets", reason="pip install 'rllm-async[datasets]'")

ROWS = [
    {"uid": "g1", "question": "What is 6*12?", "answer": "#### 72", "meta": {"level": 1}},
    {"uid": "g2", "question": "What is 2+2?", "answer": "#### 4", "meta": {"level": 2}},
    {"uid": "g3", "question": "What is 9-3?", "answer": "#### 6", "meta": {"level": 1}},
]
OFFLINE = ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE")


@pytest.fixture(autouse=True)
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A fresh datasets cache, so that the tests read nothing a earlier run left there."""
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "hf-cache")
    for name in OFFLINE:
        monkeypatch.delenv(name, raising=False)


def hf(**spec: Any) -> DatasetConfig:
    return DatasetConfig.model_validate(
        {"hf": spec, "columns": {"id": "uid", "prompt": "question"}}
    )


def test_a_dataset_saved_to_disk_loads_with_its_split_and_columns(tmp_path: Path) -> None:
    path = tmp_path / "saved"
    datasets.Dataset.from_list(ROWS).save_to_disk(str(path))
    tasks = load_tasks(hf(path=str(path)), "train")
    assert [t["id"] for t in tasks] == ["g1", "g2", "g3"]
    assert tasks[1]["prompt"] == "What is 2+2?" and tasks[1]["meta"] == {"level": 2}
    assert task_messages(tasks[0], "prompt", None) == [{"role": "user", "content": "What is 6*12?"}]

    both = tmp_path / "dict"
    datasets.DatasetDict(
        {"train": datasets.Dataset.from_list(ROWS), "test": datasets.Dataset.from_list(ROWS[:1])}
    ).save_to_disk(str(both))
    assert [t["id"] for t in load_tasks(hf(path=str(both), split="test"), "eval")] == ["g1"]
    with pytest.raises(
        DataError, match=r"has no split 'validation' \(it has \['test', 'train'\]\)"
    ):
        load_tasks(hf(path=str(both), split="validation"), "eval")


def test_data_files_load_through_a_builder_and_limit_applies(tmp_path: Path) -> None:
    (tmp_path / "files").mkdir()
    file = tmp_path / "files" / "train.jsonl"
    file.write_text("".join(json.dumps(row) + "\n" for row in ROWS))
    spec = DatasetConfig.model_validate(
        {"hf": {"path": "json", "data_files": {"train": str(file)}}, "limit": 2}
    )
    tasks = load_tasks(spec, "train")
    assert [t["uid"] for t in tasks] == ["g1", "g2"]
    assert [t["id"] for t in tasks] == ["train-0", "train-1"]
    # A directory of data files is a dataset too.
    assert len(load_tasks(hf(path=str(tmp_path / "files")), "train")) == 3
    with pytest.raises(DataError, match=r"cannot load 'json' .*FileNotFoundError"):
        load_tasks(hf(path="json", data_files=str(tmp_path / "missing.jsonl")), "train")


def test_loading_runs_with_the_hub_off_and_restores_the_environment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    seen: dict[str, Any] = {}
    real = datasets.load_dataset

    def spy(*args: Any, **kwargs: Any) -> Any:
        import huggingface_hub.constants

        seen.update({name: os.environ.get(name) for name in OFFLINE})
        seen["flags"] = (datasets.config.HF_HUB_OFFLINE, huggingface_hub.constants.HF_HUB_OFFLINE)
        return real(*args, **kwargs)

    monkeypatch.setattr(datasets, "load_dataset", spy)
    file = tmp_path / "rows.json"
    file.write_text(json.dumps(ROWS))
    load_tasks(hf(path="json", data_files=str(file)), "train")
    assert seen == {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "flags": (True, True)}
    assert all(name not in os.environ for name in OFFLINE)
    assert datasets.config.HF_HUB_OFFLINE is False


def test_a_dataset_not_in_the_cache_says_how_to_get_it() -> None:
    spec = hf(path="nobody-here/no-such-dataset", name="main", split="test")
    with pytest.raises(DataError) as error:
        load_tasks(spec, "eval")
    message = str(error.value)
    assert "without the network" in message
    assert "datasets.load_dataset('nobody-here/no-such-dataset', 'main', split='test')" in message
    assert "save_to_disk" in message


def test_a_split_names_exactly_one_source() -> None:
    with pytest.raises(ConfigError, match="exactly one of `path`"):
        config_from_dict({"data": {"train": {"path": "a.jsonl", "hf": {"path": "gsm8k"}}}})
    config = config_from_dict({"data": {"train": {"hf": {"path": "openai/gsm8k", "name": "main"}}}})
    assert config.data.train is not None and config.data.train.hf is not None
    assert config.data.train.hf.split == "train"
