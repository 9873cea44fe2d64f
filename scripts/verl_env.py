"""Create (or reuse) `.venv-verl/`: verl 0.9.1, a pinned torch and this repo, kept apart from the
main interpreter because verl pins its own transformers, tensordict and Ray.

    python scripts/verl_env.py setup                 # idempotent; prints what it did and how long
    python scripts/verl_env.py setup --fresh         # delete .venv-verl/, then build it anew (CI)
    .venv-verl/bin/python -m pytest tests/verl       # the verl backend's tests

`--torch` picks the torch requirement (default `torch==2.13.0`, the CPU build where one is on the
package index's find-links; elsewhere pass e.g. a CUDA build for GPU machines).
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import time
import venv
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
VENV = ROOT / ".venv-verl"
VERL = "verl[verl-core]==0.9.1"
PROBE = (
    "import importlib.metadata as m, rllm_async.backends.verl.cpu; "
    "assert m.version('verl') == '0.9.1'; import ray, tensordict"
)


def python() -> Path:
    return VENV / "bin" / "python"


def ready() -> bool:
    """Whether the venv exists and imports verl 0.9.1 and this repo."""
    if not python().exists():
        return False
    probe = subprocess.run([python(), "-c", PROBE], cwd="/", capture_output=True)
    return probe.returncode == 0


def setup(torch_spec: str, fresh: bool = False) -> None:
    """Build the venv, or reuse it when it imports verl 0.9.1 and this repo; `fresh` deletes it
    first, so that every package is resolved anew (as on a new machine)."""
    start = time.monotonic()
    if fresh and VENV.exists():
        shutil.rmtree(VENV)
    if ready():
        print(f"{VENV} is ready (verl 0.9.1); nothing to do")
        return
    if not python().exists():
        venv.create(VENV, with_pip=True)
    pip = [str(python()), "-m", "pip", "install", "--disable-pip-version-check"]
    subprocess.run([*pip, VERL, torch_spec, "-e", f"{ROOT}[dev]"], check=True)
    if not ready():
        sys.exit(f"{VENV} was built but cannot import verl 0.9.1 and rllm_async")
    print(f"{VENV} built in {time.monotonic() - start:.0f}s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    cmd = sub.add_parser("setup", help="create or reuse .venv-verl/")
    cmd.add_argument("--torch", default="torch==2.13.0", help="torch requirement to install")
    cmd.add_argument("--fresh", action="store_true", help="delete .venv-verl/, then build it anew")
    args = parser.parse_args()
    setup(args.torch, fresh=args.fresh)


if __name__ == "__main__":
    main()
