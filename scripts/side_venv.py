"""A side virtual environment of this repository (`.venv-vllm/`, `.venv-verl/`): built by a list of
pip steps, checked by a probe, reused while the probe passes, deleted and built anew with --fresh.

Standard library only: the scripts that use it run before any environment exists.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import time
import venv
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# The pip steps (each the arguments of one `pip` command) for a torch requirement.
Steps = Callable[[str], list[list[str]]]


def ready(path: Path, probe: str) -> bool:
    """Whether the venv at `path` exists and runs `probe` (Python code) without error."""
    python = path / "bin" / "python"
    if not python.exists():
        return False
    return subprocess.run([python, "-c", probe], cwd="/", capture_output=True).returncode == 0


def setup(path: Path, what: str, probe: str, steps: list[list[str]], *, fresh: bool) -> None:
    """Build the venv at `path` with `steps`, or reuse it when `probe` passes; `fresh` deletes it
    first, so that every package is resolved anew (as on a new machine)."""
    start = time.monotonic()
    if fresh and path.exists():
        shutil.rmtree(path)
        print(f"deleted {path}")
    if ready(path, probe):
        print(f"{path} is ready ({what}); nothing to do")
        return
    if not (path / "bin" / "python").exists():
        venv.create(path, with_pip=True)
        print(f"created {path}")
    pip = [str(path / "bin" / "python"), "-m", "pip", "--disable-pip-version-check"]
    for step in steps:
        print(f"pip {' '.join(step)}", flush=True)
        subprocess.run([*pip, *step], check=True)
    if not ready(path, probe):
        sys.exit(f"{path} was built but fails its check: {probe}")
    print(f"{path} built in {time.monotonic() - start:.0f}s")


def main(path: Path, what: str, probe: str, steps: Steps, description: str) -> None:
    """The command line: `setup [--torch SPEC] [--fresh]`."""
    parser = argparse.ArgumentParser(description=description)
    sub = parser.add_subparsers(dest="command", required=True)
    cmd = sub.add_parser("setup", help=f"create or reuse {path.name}/")
    cmd.add_argument("--torch", default="torch==2.13.0", help="torch requirement to install")
    cmd.add_argument("--fresh", action="store_true", help=f"delete {path.name}/, then build anew")
    args = parser.parse_args()
    setup(path, what, probe, steps(args.torch), fresh=args.fresh)
