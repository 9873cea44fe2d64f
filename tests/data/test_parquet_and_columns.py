"""Datasets as other projects keep them: parquet files (verl's format, with a conversational
`prompt` column) and `data.<split>.columns` mapping their fields onto the workflow's."""

from __future__ import annotations

import pytest

from rllm_async.config import DatasetConfig
from rllm_async.data import DataError, load_tasks
from rllm_async.workflows.prompt import task_messages

pq = pytest.importorskip("pyarrow.parquet", reason="parquet needs pyarrow: pip install pyarrow")
import pyarrow as pa  # noqa: E402

ROWS = [
    {
        "uid": "g1",
        "prompt": [{"role": "user", "content": "What is 6*12?"}],
        "reward_model": {"ground_truth": "72"},
        "solution": "#### 72",
    },
    {
        "uid": "g2",
        "prompt": [{"role": "user", "content": "What is 2+2?"}],
        "reward_model": {"ground_truth": "4"},
        "solution": "#### 4",
    },
]


def test_parquet_rows_with_chat_prompts_and_mapped_columns(tmp_path) -> None:
    path = tmp_path / "train.parquet"
    pq.write_table(pa.Table.from_pylist(ROWS), path)
    spec = DatasetConfig(path=str(path), columns={"id": "uid", "answer": "solution"})
    tasks = load_tasks(spec, "train")
    assert [t["id"] for t in tasks] == ["g1", "g2"]
    assert tasks[0]["answer"] == "#### 72" and tasks[0]["reward_model"] == {"ground_truth": "72"}
    assert task_messages(tasks[0], "prompt", None) == [{"role": "user", "content": "What is 6*12?"}]


def test_a_missing_mapped_column_and_a_bad_file_are_named(tmp_path) -> None:
    path = tmp_path / "train.parquet"
    pq.write_table(pa.Table.from_pylist(ROWS), path)
    with pytest.raises(DataError, match=r"has no field 'question'.*its fields are \['prompt'"):
        load_tasks(DatasetConfig(path=str(path), columns={"prompt": "question"}), "train")
    bad = tmp_path / "bad.parquet"
    bad.write_text("not parquet")
    with pytest.raises(DataError, match="not a readable parquet file"):
        load_tasks(DatasetConfig(path=str(bad)), "train")


def test_columns_map_jsonl_fields_too(tmp_path) -> None:
    path = tmp_path / "train.jsonl"
    path.write_text('{"question": "q1", "final": "1"}\n')
    (task,) = load_tasks(DatasetConfig(path=str(path), columns={"prompt": "question"}), "train")
    assert task == {"question": "q1", "final": "1", "prompt": "q1", "id": "train-0"}
