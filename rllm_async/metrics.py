"""MetricsAggregator: per-step metrics with reductions declared where recorded, and their sinks."""

from __future__ import annotations

import json
import logging
import math
import os
from pathlib import Path
from typing import Any, Literal, Protocol

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

    def __init__(self, total: int, initial: int = 0, desc: str = "train") -> None:
        from tqdm.auto import tqdm

        self._bar = tqdm(total=total, initial=initial, desc=desc, unit="step", dynamic_ncols=True)
        self._log = _BarLogHandler(self._bar)
        logging.getLogger("rllm_async").addHandler(self._log)

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
        logging.getLogger("rllm_async").removeHandler(self._log)
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
    """Logs each record to Weights & Biases; offline when no API key is configured."""

    def __init__(
        self,
        project: str,
        name: str,
        entity: str | None,
        mode: str,
        config: dict[str, Any],
        directory: Path,
    ) -> None:
        try:
            import wandb
        except ImportError as e:
            raise RuntimeError(
                "logging.wandb.enabled is true but wandb is not installed: "
                "pip install 'rllm-async[wandb]' or set logging.wandb.enabled=false"
            ) from e
        online = mode == "online" or (mode == "auto" and bool(os.environ.get("WANDB_API_KEY")))
        directory.mkdir(parents=True, exist_ok=True)
        self._run = wandb.init(
            project=project,
            name=name,
            entity=entity,
            mode="online" if online else "offline",
            config=config,
            dir=str(directory),
        )

    def write(self, record: dict[str, float]) -> None:
        self._run.log(dict(record), step=int(record["step"]))

    def close(self) -> None:
        self._run.finish()
