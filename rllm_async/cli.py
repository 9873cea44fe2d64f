"""`rllm-async`: train, evaluate, serve, export, simulate, plan and plot from the command line."""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import logging
import os
import signal
import sys
import threading
from collections.abc import Iterator, Sequence
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING

from rllm_async.config import ConfigError, load_config
from rllm_async.coordinator import StallError, SyncTimeoutError
from rllm_async.data import DataError
from rllm_async.health import FailureRateError, NoSignalError
from rllm_async.metrics import ProgressBarSink
from rllm_async.protocols import BackendError

if TYPE_CHECKING:
    from rllm_async.trainer import UnifiedTrainer

DEFAULT_CONFIG = Path("examples/countdown/local_async.yaml")
_STDERR = logging.StreamHandler()  # the command line's log handler, added once per process


def _split_args(args: Sequence[str]) -> tuple[str | None, list[str]]:
    """`[CONFIG] [key=value ...]`: the first argument without '=' is the config file."""
    config = None
    overrides = []
    for arg in args:
        if "=" in arg:
            overrides.append(arg)
        elif config is None:
            config = arg
        else:
            raise ConfigError(f"unexpected argument '{arg}': overrides look like key=value")
    return config, overrides


def cmd_train(args: argparse.Namespace) -> int:
    from rllm_async.trainer import UnifiedTrainer

    path, overrides = _split_args(args.rest)
    if path is None:
        if not DEFAULT_CONFIG.exists():
            raise ConfigError(
                f"no config given and {DEFAULT_CONFIG} not found: run from the repository root "
                "or pass a config file: rllm-async train CONFIG.yaml [key=value ...]"
            )
        path = str(DEFAULT_CONFIG)
    config = load_config(path, overrides)
    trainer = UnifiedTrainer(config)
    with _ctrl_c_stops(trainer), collector_for_rollouts():
        records = trainer.run()
    last = records[-1] if records else {}
    print(json.dumps({"run_dir": str(config.run_path), "steps": len(records), "last": last}))
    return 130 if trainer.interrupted else 0


@contextlib.contextmanager
def collector_for_rollouts() -> Iterator[None]:
    """The garbage collector set for thousands of rollouts in flight, restored after: start-up's
    objects frozen out of its passes, the youngest collected once tracked objects grew by 500,000
    instead of 700, so that a rollout's objects are freed before a pass scans them (with the
    defaults, passes paused the loop for 120-430 ms at 16,384 rollouts in flight). Process-wide:
    the command that owns the process sets it; a library user opts in the same way."""
    thresholds = gc.get_threshold()
    gc.freeze()
    gc.set_threshold(500_000, *thresholds[1:])
    try:
        yield
    finally:
        gc.set_threshold(*thresholds)
        gc.unfreeze()


@contextlib.contextmanager
def _ctrl_c_stops(trainer: UnifiedTrainer) -> Iterator[None]:
    """Ctrl-C stops the run after a final checkpoint (`UnifiedTrainer.interrupt`); a second
    Ctrl-C exits at once, leaving the checkpoints already complete."""
    if threading.current_thread() is not threading.main_thread():
        yield  # signals reach the main thread alone
        return
    pressed = False

    def on_sigint(signum: int, frame: FrameType | None) -> None:
        nonlocal pressed
        if pressed:
            print("rllm-async: interrupted again: exiting now", file=sys.stderr, flush=True)
            os._exit(130)
        pressed = True
        if not trainer.interrupt():
            raise KeyboardInterrupt
        print(
            "rllm-async: interrupted: writing a final checkpoint (Ctrl-C again to exit now)",
            file=sys.stderr,
            flush=True,
        )

    previous = signal.signal(signal.SIGINT, on_sigint)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


def cmd_simulate(args: argparse.Namespace) -> int:
    from rllm_async.plan.simulate import simulate

    result = simulate(
        args.workload,
        mode=args.mode,
        pipeline_depth=args.pipeline_depth,
        max_staleness=args.max_staleness,
        steps=args.steps,
        seed=args.seed,
        overrides=args.set,
    )
    if args.json:
        print(json.dumps(result))
    else:
        for key, value in result.items():
            print(f"{key:>24}: {value}")
    return 0


def _depth(text: str) -> int | str:
    """A pipeline depth: a number, or `auto`."""
    return "auto" if text == "auto" else int(text)


def _devices_pair(text: str) -> tuple[int, int]:
    """`G:T` as (G, T); a ConfigError naming the form otherwise."""
    gen, sep, train = text.partition(":")
    if not (sep and gen.isdigit() and train.isdigit()):
        raise ConfigError(
            f"--recorded-devices {text!r}: write GEN:TRAIN, the recorded run's generation and "
            "training devices, e.g. 1:1 for one shared device or 4:4"
        )
    return int(gen), int(train)


def cmd_plan(args: argparse.Namespace) -> int:
    from rllm_async.plan.replay import plan, render

    grid = {
        "depths": [_depth(x) for x in args.depths.split(",")],
        "bounds": args.bounds.split(","),
        "policies": args.policies.split(","),
        "concurrency": [float(x) for x in args.concurrency.split(",")],
    }
    try:
        result = plan(
            Path(args.run_dir),
            steps=args.steps,
            seed=args.seed,
            scale_servers=args.scale_servers,
            scale_batch=args.scale_batch,
            max_waste=args.max_waste,
            max_staleness=args.max_staleness,
            grid=grid,
            devices=args.devices,
            recorded_devices=_devices_pair(args.recorded_devices),
            twin=None if args.twin is None else Path(args.twin),
        )
    except FileNotFoundError as e:
        raise DataError(str(e)) from None
    print(json.dumps(result) if args.json else render(result))
    return 0


def cmd_eval(args: argparse.Namespace) -> int:
    from rllm_async import checkpoint
    from rllm_async.backends import get_backend_factory
    from rllm_async.evaluation import evaluate_checkpoint
    from rllm_async.vclock import run

    run_dir = Path(args.run_dir)
    if not (run_dir / "config.yaml").exists():
        raise ConfigError(f"{run_dir} has no config.yaml: pass a run directory such as runs/<name>")
    overrides = ["logging.progress_bar=false", "logging.jsonl=false", *args.overrides]
    config = load_config(run_dir / "config.yaml", overrides)
    if config.data.eval is None:
        raise ConfigError(
            f"{run_dir}/config.yaml has no data.eval: add one with data.eval.path=..."
        )
    path = checkpoint.resolve(Path(args.checkpoint) if args.checkpoint else run_dir, "--checkpoint")
    factory = get_backend_factory(config.backend.name)
    metrics = run(
        evaluate_checkpoint(config, path, factory.from_config(config)),
        virtual=bool(getattr(factory, "virtual_clock", False)),
    )
    print(json.dumps({"checkpoint": str(path), **metrics}))
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    import asyncio
    import os

    from rllm_async import checkpoint
    from rllm_async.serve import serve

    path, overrides = _split_args(args.rest)
    api_key = args.api_key or os.environ.get("RLLM_ASYNC_API_KEY") or None
    if args.train:
        return _serve_train(args, path, overrides, api_key)
    found: Path | None = None
    if args.checkpoint:
        given = Path(args.checkpoint)
        if (given / "config.yaml").exists():  # a run directory: its config unless one is given
            path = path or str(given / "config.yaml")
        found = checkpoint.resolve(given, "--checkpoint")
    config = load_config(path, overrides)
    asyncio.run(
        serve(
            config,
            checkpoint=found,
            host=args.host,
            port=args.port,
            api_key=api_key,
            model=args.model,
            export_path=Path(args.export) if args.export else None,
        )
    )
    return 0


def _serve_train(
    args: argparse.Namespace, path: str | None, overrides: list[str], api_key: str | None
) -> int:
    """`serve --train CONFIG`: serve and train on the episodes the clients reward."""
    from rllm_async.serve import online_trainer

    if path is None:
        raise ConfigError("serve --train needs a config: rllm-async serve --train CONFIG")
    for flag in ("checkpoint", "export"):
        if getattr(args, flag):
            raise ConfigError(
                f"serve --train takes no --{flag}: a run resumes from its own checkpoints "
                "(checkpoint.resume) and trains on what its sessions record"
            )
    config = load_config(path, overrides)
    trainer = online_trainer(
        config, host=args.host, port=args.port, api_key=api_key, model=args.model
    )
    with collector_for_rollouts():
        trainer.run()
    return 0


def cmd_export(args: argparse.Namespace) -> int:
    from rllm_async.export import export_run

    out = Path(args.out)
    source = export_run(Path(args.run_dir), out, args.checkpoint)
    print(json.dumps({"checkpoint": str(source), "out": str(out)}))
    return 0


def cmd_plot(args: argparse.Namespace) -> int:
    from rllm_async.plot import plot_runs

    runs = [Path(p) for p in args.runs]
    out = Path(args.out) if args.out else runs[0] / "plots"
    try:
        written = plot_runs(runs, out)
    except (FileNotFoundError, ValueError) as e:
        raise DataError(str(e)) from None
    for path in written:
        print(path)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="rllm-async", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    train = sub.add_parser("train", help="train with a config file and key=value overrides")
    train.add_argument("rest", nargs="*", metavar="[CONFIG] [key=value ...]")
    train.set_defaults(func=cmd_train)

    sim = sub.add_parser("simulate", help="run a workload on the simulator: async vs sync")
    sim.add_argument("--workload", default="W1", help="W1-W4 (stationary) or D1-D4 (drifting)")
    sim.add_argument("--mode", choices=["sync", "async"], default="async")
    sim.add_argument(
        "--pipeline-depth", type=_depth, default=4, help="d, or auto (the depth controller)"
    )
    sim.add_argument("--max-staleness", type=int, default=None, help="hard bound K (default: none)")
    sim.add_argument("--steps", type=int, default=60)
    sim.add_argument("--seed", type=int, default=0)
    sim.add_argument("--set", nargs="*", default=[], metavar="key=value", help="config overrides")
    sim.add_argument("--json", action="store_true", help="print one JSON line")
    sim.set_defaults(func=cmd_simulate)

    pl = sub.add_parser("plan", help="replay a recorded run's workload under candidate settings")
    pl.add_argument("run_dir", metavar="RUN_DIR", help="a run directory with workload.jsonl")
    pl.add_argument("--max-waste", type=float, default=None, help="e.g. 0.02 for 2%% of tokens")
    pl.add_argument("--max-staleness", type=int, default=None, help="largest staleness allowed")
    pl.add_argument("--scale-servers", type=float, default=1.0, help="N times the rollout servers")
    pl.add_argument("--scale-batch", type=float, default=1.0, help="N times the groups per step")
    pl.add_argument("--steps", type=int, default=None, help="default: the recorded steps, <= 60")
    pl.add_argument(
        "--depths", default="1,2,4,8", help="pipeline depths to try (auto: the depth controller)"
    )
    pl.add_argument("--bounds", default="none,d,2d", help="max_staleness: none, d, 2d or numbers")
    pl.add_argument("--policies", default="requeue", help="stale_policy values: requeue,drop")
    pl.add_argument(
        "--concurrency", default="1,0.5", help="max_concurrency as fractions of the recorded one"
    )
    pl.add_argument(
        "--devices",
        type=int,
        default=None,
        help="a cluster of N devices: the best setting for each split between generation and "
        "training",
    )
    pl.add_argument(
        "--recorded-devices",
        default="1:1",
        help="GEN:TRAIN devices of the recorded run (1:1: one device, shared or not)",
    )
    pl.add_argument(
        "--twin",
        default=None,
        metavar="RUN_DIR",
        help="a run of the same job in the other mode: that mode is replayed from its record",
    )
    pl.add_argument("--seed", type=int, default=0)
    pl.add_argument("--json", action="store_true", help="print one JSON line")
    pl.set_defaults(func=cmd_plan)
    ev = sub.add_parser("eval", help="held-out evaluation of a run's newest checkpoint")
    ev.add_argument("run_dir", metavar="RUN_DIR")
    ev.add_argument("--checkpoint", default=None, help="a checkpoint directory (default: newest)")
    ev.add_argument("overrides", nargs="*", metavar="key=value", help="e.g. eval.temperature=0.7")
    ev.set_defaults(func=cmd_eval)

    srv = sub.add_parser("serve", help="the OpenAI-compatible gateway over a checkpoint's policy")
    srv.add_argument("rest", nargs="*", metavar="[CONFIG] [key=value ...]")
    srv.add_argument(
        "--checkpoint", default=None, help="a run directory (its newest checkpoint) or a checkpoint"
    )
    srv.add_argument("--host", default="127.0.0.1", help="bind address (default: loopback only)")
    srv.add_argument("--port", type=int, default=8000)
    srv.add_argument("--api-key", default=None, help="required key (default: $RLLM_ASYNC_API_KEY)")
    srv.add_argument("--model", default="policy", help="the model name clients ask for")
    srv.add_argument("--export", default=None, help="append closed sessions' records to this JSONL")
    srv.add_argument(
        "--train",
        action="store_true",
        help="train on the episodes clients reward (POST /sessions/{id}/reward); docs/online_rl.md",
    )
    srv.set_defaults(func=cmd_serve)

    exp = sub.add_parser("export", help="a checkpoint as a Hugging Face model directory")
    exp.add_argument("run_dir", metavar="RUN_DIR")
    exp.add_argument(
        "--checkpoint",
        default=None,
        help="a step number N or a checkpoint directory (default: newest)",
    )
    exp.add_argument("--out", required=True, help="the new directory to write")
    exp.set_defaults(func=cmd_export)

    plot = sub.add_parser("plot", help="PNG curves of one or more runs (overlaid)")
    plot.add_argument("runs", nargs="+", metavar="RUN_DIR")
    plot.add_argument("--out", default=None, help="output folder (default: RUN_DIR/plots)")
    plot.set_defaults(func=cmd_plot)
    return parser


def log_to_stderr() -> None:
    """The package's log lines, INFO and above, on stderr (above the progress bar while one
    shows): which model path runs, that generation goes on while no step is recorded, warnings."""
    root = logging.getLogger()
    if _STDERR not in root.handlers:
        _STDERR.setFormatter(logging.Formatter("%(levelname)s: %(message)s"))
        _STDERR.setLevel(logging.INFO)
        _STDERR.addFilter(lambda record: not ProgressBarSink.showing)  # the bar prints them
        root.addHandler(_STDERR)
    logging.getLogger("rllm_async").setLevel(logging.INFO)


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    log_to_stderr()
    try:
        return int(args.func(args))
    except (ConfigError, DataError) as e:
        print(f"rllm-async: error: {e}", file=sys.stderr)
        return 2
    except (BackendError, FailureRateError, NoSignalError, StallError, SyncTimeoutError) as e:
        print(f"rllm-async: the run stopped: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("rllm-async: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
