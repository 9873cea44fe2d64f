"""`rllm-async plot`: PNG curves of one or more runs' metrics.jsonl, over steps and over wall time."""

from __future__ import annotations

import json
from pathlib import Path

# Each panel: (title, [metric keys]); a run missing a key is simply not drawn in that panel.
PANELS: list[tuple[str, list[str]]] = [
    ("reward", ["reward/mean", "eval/accuracy", "eval/reward/mean"]),
    ("staleness", ["staleness/mean", "staleness/max"]),
    ("throughput (tokens/s)", ["tokens/per_s"]),
    ("idle ratio", ["async/trainer_idle_ratio", "async/generation_idle_ratio"]),
]


def read_records(run_dir: Path) -> list[dict[str, float]]:
    """The run's step records, one per step: a step's later records update its earlier ones (a
    resumed run redoes steps; a run whose data ran out adds its final evaluation to its last step)."""
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        raise FileNotFoundError(f"{path} not found: is {run_dir} a run directory (runs/<name>)?")
    by_step: dict[int, dict[str, float]] = {}
    for lineno, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            raise ValueError(f"{path}:{lineno} is not a JSON object") from None
        by_step.setdefault(int(record["step"]), {}).update(record)
    return [by_step[s] for s in sorted(by_step)]


def plot_runs(run_dirs: list[Path], out_dir: Path) -> list[Path]:
    """Write `by_step.png` and `by_time.png` overlaying every run; returns the files written."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = {d.name if d.name else str(d): read_records(d) for d in run_dirs}
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for axis in ("step", "time"):
        fig, axes = plt.subplots(2, 2, figsize=(12, 8))
        for ax, (title, keys) in zip(axes.flat, PANELS, strict=True):
            for name, records in runs.items():
                xs = _x(records, axis)
                for key in keys:
                    points = [
                        (x, r[key])
                        for x, r in zip(xs, records, strict=True)
                        if r.get(key) is not None
                    ]
                    if points:
                        label = f"{name}: {key}" if len(runs) > 1 or len(keys) > 1 else key
                        ax.plot(
                            *zip(*points, strict=True),
                            label=label,
                            marker="." if len(points) < 40 else None,
                        )
            ax.set_title(title)
            ax.set_xlabel("optimizer step" if axis == "step" else "wall time (s)")
            ax.grid(alpha=0.3)
            if ax.lines:
                ax.legend(fontsize=7)
        fig.tight_layout()
        path = out_dir / f"by_{axis}.png"
        fig.savefig(path, dpi=100)
        plt.close(fig)
        written.append(path)
    return written


def _x(records: list[dict[str, float]], axis: str) -> list[float]:
    if axis == "step":
        return [r["step"] for r in records]
    return [r["time/elapsed_s"] for r in records]
