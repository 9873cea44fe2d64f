"""Task datasets (JSONL, JSON or parquet files, Hugging Face datasets, or generator callables) and
the TaskSource the trainer draws from."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
from collections import deque
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np

from rllm_async.config import Config, DatasetConfig, HFDatasetConfig
from rllm_async.imports import import_object


class DataError(ValueError):
    """A dataset row or file that cannot be used; the message names where and how to fix it."""


def load_tasks(spec: DatasetConfig, split: str) -> list[dict[str, Any]]:
    """Load the task dicts of one split, each with a unique string `id`."""
    if spec.path is not None:
        rows = _read_rows(Path(spec.path))
        where = spec.path
    elif spec.hf is not None:
        rows = _read_hf(spec.hf, split)
        where = f"the Hugging Face dataset {spec.hf.path} ({spec.hf.split})"
    else:
        assert spec.generator is not None
        fn = import_object(spec.generator, f"data.{split}.generator")
        rows = list(fn(**spec.args))
        where = spec.generator
    if spec.limit is not None:
        rows = rows[: spec.limit]
    if not rows:
        raise DataError(f"data.{split}: {where} has no tasks")
    seen: set[str] = set()
    tasks = []
    for i, row in enumerate(rows):
        if not isinstance(row, dict):
            raise DataError(
                f"data.{split}: row {i} of {where} is a {type(row).__name__}, not an object; "
                'each task must be a JSON object such as {"id": ..., "prompt": ...}'
            )
        row = {**row, **_mapped(row, spec.columns, f"data.{split}: row {i} of {where}")}
        task_id = str(row.get("id", f"{split}-{i}"))
        if task_id in seen:
            raise DataError(
                f"data.{split}: duplicate task id '{task_id}' (row {i} of {where}); ids must be unique"
            )
        seen.add(task_id)
        tasks.append({**row, "id": task_id})
    return tasks


def _mapped(row: dict[str, Any], columns: dict[str, str], where: str) -> dict[str, Any]:
    """The task fields `columns` (task field -> dataset field) take from `row`."""
    missing = [theirs for theirs in columns.values() if theirs not in row]
    if missing:
        raise DataError(
            f"{where} has no field {missing[0]!r} (data.<split>.columns maps onto it); its fields "
            f"are {sorted(row)}"
        )
    return {ours: row[theirs] for ours, theirs in columns.items()}


def _read_rows(path: Path) -> list[Any]:
    if not path.exists():
        raise DataError(f"dataset file not found: {path}")
    if path.suffix == ".parquet":
        try:
            import pyarrow.parquet as pq
        except ImportError:
            raise DataError(
                f"{path}: reading .parquet needs pyarrow: pip install pyarrow"
            ) from None
        try:
            return list(pq.read_table(path).to_pylist())
        except Exception as e:  # pyarrow's own errors: not a parquet file, corrupt pages
            raise DataError(f"{path}: not a readable parquet file ({e})") from None
    text = path.read_text(encoding="utf-8")
    if path.suffix == ".json":
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise DataError(f"{path}: invalid JSON at line {e.lineno}: {e.msg}") from None
        if not isinstance(data, list):
            raise DataError(f"{path}: a .json dataset must be a list of task objects")
        return data
    rows = []
    for lineno, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError as e:
            raise DataError(
                f"{path}:{lineno}: invalid JSON ({e.msg}); each line must be one JSON object"
            ) from None
    return rows


def _read_hf(spec: HFDatasetConfig, split: str) -> list[Any]:
    """The rows of a Hugging Face dataset, read with the Hub switched off: local files or the cache."""
    try:
        import datasets
    except ImportError:
        raise DataError(
            f"data.{split}.hf needs the `datasets` package: pip install 'rllm-async[datasets]'"
        ) from None
    local = Path(spec.path).expanduser()
    with _offline():
        try:
            if (local / "dataset_info.json").is_file() or (local / "dataset_dict.json").is_file():
                data = datasets.load_from_disk(str(local))  # written by save_to_disk
                if isinstance(data, datasets.DatasetDict):
                    if spec.split not in data:
                        raise DataError(
                            f"data.{split}.hf: {local} has no split {spec.split!r} (it has "
                            f"{sorted(data)}): set data.{split}.hf.split"
                        )
                    data = data[spec.split]
            else:
                data = datasets.load_dataset(
                    spec.path, spec.name, split=spec.split, data_files=spec.data_files
                )
        except DataError:
            raise
        except Exception as e:  # datasets' own errors: not cached, no such split or config
            raise DataError(_hf_error(spec, split, e)) from None
    return list(data.to_list())


def _hf_error(spec: HFDatasetConfig, split: str, error: Exception) -> str:
    """Why `spec` did not load, and, for a Hub name, how to get its files without the trainer
    using the network."""
    if Path(spec.path).expanduser().exists() or spec.data_files is not None:
        return f"data.{split}.hf: cannot load {spec.path!r} ({type(error).__name__}: {error})"
    args = ", ".join(
        [repr(spec.path), *([repr(spec.name)] if spec.name else []), f"split={spec.split!r}"]
    )
    return (
        f"data.{split}.hf: cannot load {spec.path!r} without the network ({type(error).__name__}: "
        f"{error}). Training never downloads: fetch it once into the Hugging Face cache with "
        f'`python -c "import datasets; datasets.load_dataset({args})"`, or save it with '
        "save_to_disk and give that directory as the path"
    )


@contextlib.contextmanager
def _offline() -> Iterator[None]:
    """Hugging Face Hub and datasets in offline mode: the environment, and the flags both read
    from it at import."""
    import datasets.config
    import huggingface_hub.constants

    env = {name: os.environ.get(name) for name in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE")}
    flags = [
        (datasets.config, "HF_HUB_OFFLINE"),
        (datasets.config, "HF_DATASETS_OFFLINE"),
        (huggingface_hub.constants, "HF_HUB_OFFLINE"),
    ]
    saved = [getattr(module, name, None) for module, name in flags]
    os.environ.update(dict.fromkeys(env, "1"))
    for module, name in flags:
        setattr(module, name, True)
    try:
        yield
    finally:
        for (module, name), value in zip(flags, saved, strict=True):
            setattr(module, name, value)
        for name, value in env.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


# A task solved by every rollout of its last k groups is skipped on its next 2**(k-1) draws, up to
# this many: it is still tried now and then, so that a task the policy forgets comes back.
_MAX_SKIPS = 32


class TaskSource:
    """Tasks in a seeded order, epoch after epoch, with requeued tasks served first.

    With `skip_solved`, a task whose groups keep coming back solved by every rollout is skipped
    on its next draws, for longer each time (1, 2, 4, ... draws): datasets that repeat a problem
    stop spending generation on problems that teach nothing. Tasks with the same content but
    different ids count as one.

    Its state (epoch, cursor, requeued tasks, solved streaks) is part of a checkpoint, so that a
    resumed run continues the same order.
    """

    def __init__(
        self,
        tasks: list[dict[str, Any]],
        *,
        seed: int,
        shuffle: bool,
        total_epochs: int | None,
        skip_solved: bool = False,
        on_epoch_start: Callable[[int], None] | None = None,
        on_epoch_end: Callable[[int], None] | None = None,
    ) -> None:
        self.tasks = tasks
        self.seed = seed
        self.shuffle = shuffle
        self.total_epochs = total_epochs
        self.epoch = 0
        self.cursor = 0
        self.requeued: deque[dict[str, Any]] = deque()
        self.skip_solved = skip_solved
        self._solved: dict[str, list[int]] = {}  # content key -> [solved streak, draws to skip]
        self._skipped = 0
        self._on_epoch_start = on_epoch_start
        self._on_epoch_end = on_epoch_end
        self._order = self._permutation(0)

    @classmethod
    def from_config(
        cls,
        config: Config,
        tasks: list[dict[str, Any]],
        on_epoch_start: Callable[[int], None] | None = None,
        on_epoch_end: Callable[[int], None] | None = None,
    ) -> TaskSource:
        """The training tasks of a fit of `config`, in the order `seed` and `data.train` ask."""
        train = config.data.train
        return cls(
            tasks,
            seed=config.seed,
            shuffle=train.shuffle if train is not None else True,
            total_epochs=config.train.total_epochs,
            skip_solved=config.algorithm.skip_solved,
            on_epoch_start=on_epoch_start,
            on_epoch_end=on_epoch_end,
        )

    def _permutation(self, epoch: int) -> list[int]:
        if not self.shuffle:
            return list(range(len(self.tasks)))
        return np.random.default_rng([self.seed, epoch]).permutation(len(self.tasks)).tolist()

    @property
    def exhausted(self) -> bool:
        return (
            not self.requeued and self.total_epochs is not None and self.epoch >= self.total_epochs
        )

    def pop(self) -> dict[str, Any] | None:
        """The next task, or None once every epoch has been served and nothing is requeued."""
        if self.requeued:
            return self.requeued.popleft()
        while not self.exhausted:
            task = self._next_in_order()
            if not self._skip(task):
                return task
        return None

    def _next_in_order(self) -> dict[str, Any]:
        if self.cursor == 0 and self._on_epoch_start is not None:
            self._on_epoch_start(self.epoch)
        task = self.tasks[self._order[self.cursor]]
        self.cursor += 1
        if self.cursor == len(self.tasks):
            if self._on_epoch_end is not None:
                self._on_epoch_end(self.epoch)
            self.epoch += 1
            self.cursor = 0
            self._order = self._permutation(self.epoch)
        return task

    def _skip(self, task: dict[str, Any]) -> bool:
        entry = self._solved.get(_content_key(task)) if self._solved else None
        if entry is None or entry[1] == 0:
            return False
        entry[1] -= 1
        self._skipped += 1
        return True

    def group_ended(self, task: dict[str, Any], *, solved: bool) -> None:
        """Note how a group of `task` ended: `solved` when every one of its rollouts was correct."""
        if not self.skip_solved:
            return
        key = _content_key(task)
        if not solved:
            self._solved.pop(key, None)
            return
        streak = self._solved[key][0] + 1 if key in self._solved else 1
        self._solved[key] = [streak, min(2 ** (streak - 1), _MAX_SKIPS)]

    def take_skipped(self) -> int:
        """Draws skipped as solved since the last call."""
        skipped, self._skipped = self._skipped, 0
        return skipped

    def requeue(self, task: dict[str, Any]) -> None:
        self.requeued.append(task)

    def state(self, pending: list[dict[str, Any]]) -> dict[str, Any]:
        """Checkpoint state; `pending` (dispatched, not yet resolved) tasks are served again first."""
        return {
            "epoch": self.epoch,
            "cursor": self.cursor,
            "requeued": [*pending, *self.requeued],
            "solved": self._solved,
        }

    def load_state(self, state: dict[str, Any]) -> None:
        self.epoch = state["epoch"]
        self.cursor = state["cursor"]
        self.requeued = deque(state["requeued"])
        self._solved = state["solved"]
        self._order = self._permutation(self.epoch)


def _content_key(task: dict[str, Any]) -> str:
    """The same for tasks that differ only in their id."""
    content = {k: v for k, v in task.items() if k != "id"}
    return hashlib.sha1(json.dumps(content, sort_keys=True).encode()).hexdigest()
