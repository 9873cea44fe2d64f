"""MetricsAggregator: per-step metrics with reductions declared where recorded, and their sinks."""

from __future__ import annotations

import importlib
import json
import logging
import math
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Literal, Protocol

if TYPE_CHECKING:
    from rllm_async.config import WandbConfig

logger = logging.getLogger(__name__)

Reduce = Literal["mean", "sum", "min", "max", "last"]
_REDUCES = ("mean", "sum", "min", "max", "last")


class MetricsSink(Protocol):
    """Receives one record (a flat dict of numbers) per optimizer step."""

    def write(self, record: dict[str, float]) -> None: ...

    def close(self) -> None: ...


class _Acc:
    __slots__ = ("count", "last", "max", "min", "reduce", "total")

    def __init__(self, reduce: Reduce) -> None:
        self.reduce = reduce
        self.count = 0
        self.total = 0.0
        self.min = math.inf
        self.max = -math.inf
        self.last = math.nan

    def add(self, value: float) -> None:
        self.count += 1
        self.total += value
        self.last = value
        if value < self.min:
            self.min = value
        if value > self.max:
            self.max = value

    def value(self) -> float:
        if self.reduce == "mean":
            return self.total / self.count
        if self.reduce == "sum":
            return self.total
        return getattr(self, self.reduce)


class MetricsAggregator:
    """Collects metrics for the current step; `flush` reduces them into one record for every sink.

    A key's reduction is declared by the caller at each `record` and must never change, so nothing
    is guessed from a key's name. A step's record is the union of all keys recorded during it.
    """

    def __init__(self, sinks: list[MetricsSink] | None = None) -> None:
        self.sinks = list(sinks or [])
        self._reduces: dict[str, Reduce] = {}
        self._accs: dict[str, _Acc] = {}

    def record(self, key: str, value: float, reduce: Reduce = "mean") -> None:
        acc = self._accs.get(key)
        if acc is None:
            if reduce not in _REDUCES:
                raise ValueError(
                    f"metric '{key}': unknown reduction '{reduce}', use one of {_REDUCES}"
                )
            acc = self._accs[key] = _Acc(self._reduces.setdefault(key, reduce))
        if acc.reduce != reduce:
            raise ValueError(
                f"metric '{key}' was declared with reduction '{acc.reduce}', now '{reduce}'"
            )
        acc.add(float(value))

    def record_total(self, key: str, total: float, count: int, reduce: Reduce) -> None:
        """`count` values of `key` that sum to `total`, at once: for a `sum` or `mean`, which
        need nothing else (a hot path's values, summed where they happen)."""
        if reduce not in ("sum", "mean"):
            raise ValueError(f"metric '{key}': record_total takes sum or mean, not '{reduce}'")
        self.record(key, total, reduce)
        self._accs[key].count += count - 1

    def record_many(self, metrics: dict[str, float], reduce: Reduce = "mean") -> None:
        for key, value in metrics.items():
            self.record(key, value, reduce)

    def peek(self, key: str) -> float | None:
        """The current reduced value of `key` in this step, or None if not recorded yet."""
        acc = self._accs.get(key)
        return acc.value() if acc is not None else None

    def take(self) -> dict[str, float]:
        """Reduce the metrics recorded so far, sorted by key, and start anew; sends nothing."""
        reduced = {key: acc.value() for key, acc in sorted(self._accs.items())}
        self._accs = {}
        return reduced

    def flush(self, step: int) -> dict[str, float]:
        """Reduce this step's metrics, send the record to every sink, and start a new step."""
        record: dict[str, float] = {"step": step, **self.take()}
        for sink in self.sinks:
            sink.write(record)
        return record

    def close(self) -> None:
        for sink in self.sinks:
            sink.close()


class JsonlSink:
    """Appends one JSON object per step to `metrics.jsonl`, flushed at once so a crash loses nothing."""

    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self._file = path.open("a", encoding="utf-8")

    def write(self, record: dict[str, float]) -> None:
        clean = {
            k: (None if isinstance(v, float) and not math.isfinite(v) else v)
            for k, v in record.items()
        }
        self._file.write(json.dumps(clean) + "\n")
        self._file.flush()

    def close(self) -> None:
        if not self._file.closed:
            self._file.close()


class ProgressBarSink:
    """A tqdm bar over optimizer steps with reward, held-out accuracy (where the task judges
    correctness; else held-out reward) and staleness in its postfix. While it is open, the
    package's log lines print above it, and a line's `status` shows in the postfix."""

    # Bars open in this process: other handlers leave the package's lines to them.
    showing: ClassVar[int] = 0

    def __init__(self, total: int, initial: int = 0, desc: str = "train") -> None:
        from tqdm.auto import tqdm

        self._bar = tqdm(total=total, initial=initial, desc=desc, unit="step", dynamic_ncols=True)
        self._log = _BarLogHandler(self._bar)
        logging.getLogger("rllm_async").addHandler(self._log)
        ProgressBarSink.showing += 1

    def write(self, record: dict[str, float]) -> None:
        postfix = {}
        for key, short in (
            ("reward/mean", "reward"),
            ("eval/accuracy" if "eval/accuracy" in record else "eval/reward/mean", "eval"),
            ("staleness/mean", "stale"),
            ("staleness/max", "stale_max"),
        ):
            if key in record:
                postfix[short] = f"{record[key]:.3g}"
        self._bar.set_postfix(postfix, refresh=False)
        self._bar.update(int(record["step"]) - self._bar.n)  # a step-0 eval record moves nothing

    def close(self) -> None:
        if self._log in logging.getLogger("rllm_async").handlers:
            logging.getLogger("rllm_async").removeHandler(self._log)
            ProgressBarSink.showing -= 1
        self._bar.close()


class _BarLogHandler(logging.Handler):
    """Writes log lines above a progress bar, so that the bar stays whole."""

    def __init__(self, bar: Any) -> None:
        super().__init__()
        self.setFormatter(logging.Formatter("%(levelname)s: %(message)s"))
        self._bar = bar

    def emit(self, record: logging.LogRecord) -> None:
        self._bar.write(self.format(record), file=self._bar.fp)
        status = getattr(record, "status", None)
        if status:
            self._bar.set_postfix_str(f"{record.levelname.lower()}: {status}")


class WandbSink:
    """Logs each record to Weights & Biases, its files under `directory` (the run directory).

    The wandb run's id is kept in `directory/wandb_run_id`; with `resume` (a run resumed from a
    checkpoint) the sink continues the wandb run of that id instead of starting another."""

    def __init__(
        self,
        settings: WandbConfig,
        name: str,
        config: dict[str, Any],
        directory: Path,
        resume: bool = False,
    ) -> None:
        wandb = _import("wandb", "logging.wandb.enabled", "wandb")
        mode = wandb_mode(settings.mode)
        directory.mkdir(parents=True, exist_ok=True)
        id_file = directory / "wandb_run_id"
        resume_id = id_file.read_text().strip() if resume and id_file.is_file() else None
        self._run = wandb.init(
            project=settings.project,
            name=name,
            entity=settings.entity,
            group=settings.group,
            tags=settings.tags,
            notes=settings.notes,
            mode=mode,
            config=config,
            dir=str(directory),
            id=resume_id,
            resume="allow" if resume_id else None,
        )
        self.run_id: str = self._run.id
        id_file.write_text(self.run_id)

    def write(self, record: dict[str, float]) -> None:
        self._run.log(dict(record), step=int(record["step"]))

    def close(self) -> None:
        self._run.finish()


def wandb_mode(mode: str) -> str:
    """The mode wandb runs in, logged with the reason. `auto` follows `$WANDB_MODE` when set, else
    is online when wandb finds credentials where it keeps them (`$WANDB_API_KEY`, `wandb login`'s
    netrc, its settings), offline with a warning when it finds none."""
    level, env = logging.INFO, os.environ.get("WANDB_MODE")
    if mode != "auto":
        why = f"logging.wandb.mode is {mode}"
    elif env:
        mode, why = env, f"logging.wandb.mode is auto and WANDB_MODE={env}"
    else:
        import wandb

        if wandb.login(prompt=False, verify=False):
            mode = "online"
            why = "wandb found credentials: WANDB_API_KEY, `wandb login`'s netrc or its settings"
        else:
            level, mode = logging.WARNING, "offline"
            why = (
                "wandb found no credentials: run `wandb login` or set WANDB_API_KEY to log "
                "online; `wandb sync` uploads an offline run later"
            )
    logger.log(level, "wandb: logging %s (%s)", mode, why)
    return mode


class TensorBoardSink:
    """Writes each record's numbers as TensorBoard scalars under `directory`. A run resumed after
    `initial_step` drops the scalars an earlier attempt wrote for the steps after it."""

    def __init__(self, directory: Path, initial_step: int = 0) -> None:
        _import("tensorboard", "logging.tensorboard", "tensorboard")
        from torch.utils.tensorboard import SummaryWriter

        self._writer = SummaryWriter(
            str(directory), purge_step=initial_step + 1 if initial_step else None
        )

    def write(self, record: dict[str, float]) -> None:
        step = int(record["step"])
        for key, value in record.items():
            if key != "step":
                self._writer.add_scalar(key, value, global_step=step)
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()


def _import(module: str, setting: str, extra: str) -> Any:
    """An optional extra's module, or an error naming the setting and how to install it."""
    try:
        return importlib.import_module(module)
    except ImportError as e:
        raise RuntimeError(
            f"{setting} is on but {module} is not installed: "
            f"pip install 'rllm-async[{extra}]' or turn {setting} off"
        ) from e
