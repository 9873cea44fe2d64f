"""A local Tinker API server for tests: SkyRL 0.3.0's open-source server, JAX on CPU, a tiny Qwen3.

    python scripts/tinker_server/manage.py setup         # .venv-skyrl/ (reused when present)
    python scripts/tinker_server/manage.py setup --fresh # delete .venv-skyrl/ and build it anew (CI)
    python scripts/tinker_server/manage.py build-model   # .tinker-server/model/ (random weights)
    python scripts/tinker_server/manage.py serve --port 8000

`setup` installs skyrl[tinker,jax]==0.3.0 and tinker==0.24.1 (the last SDK that speaks the JSON
protocol this server does) into their own venv, with this repository (editable) and the test
tools, so tests and `rllm-async` can run there against the server. Nothing is ever downloaded from
a model hub: the server runs with HF_HUB_OFFLINE=1 on a checkpoint built here. JAX's compiled
kernels are cached in .tinker-server/jax-cache/, so only the first server start compiles them.
Standard library only; importable by the pytest fixture (`start`, `stop`).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
VENV = REPO / ".venv-skyrl"
STATE = REPO / ".tinker-server"
MODEL = STATE / "model"
PACKAGES = ["skyrl[tinker,jax]==0.3.0", "tinker==0.24.1"]
# The test tools of the dev extra in pyproject.toml, with the same bounds.
TEST_TOOLS = ["pytest>=8.4", "pytest-timeout>=2.3.1", "hypothesis>=6.130.12,<7", "pyyaml>=6.0.1"]
JAX_CACHE = STATE / "jax-cache"
ENV = {
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "JAX_PLATFORMS": "cpu",
    # JAX's compiled kernels persist across server starts: only the first start pays for them.
    "JAX_COMPILATION_CACHE_DIR": str(JAX_CACHE),
}
# Fixed batch shapes, so that JAX compiles few kernels: every sampling batch is padded to 8
# sequences, every forward/backward is split into micro-batches of 4.
BACKEND_CONFIG = {
    "max_lora_adapters": 32,
    "max_lora_rank": 32,
    "sample_max_num_sequences": 8,
    "train_micro_batch_size": 4,
}


def venv_python(venv: Path = VENV) -> Path:
    return venv / "bin" / "python"


def _torch_pin() -> list[str]:
    """Pin this interpreter's CPU torch build, so the venv does not pull CUDA wheels from PyPI.

    Run this script with the interpreter of the environment that has the torch to copy (CI runs it
    from its own venv, where `pip install -e '.[dev]'` put the CPU build): an interpreter without
    torch, or with a CUDA build, pins nothing."""
    try:
        import torch
    except ImportError:
        return []
    return [f"torch=={torch.__version__}"] if "+cpu" in torch.__version__ else []


def setup(venv: Path = VENV, force: bool = False, fresh: bool = False) -> Path:
    """Create the server venv and install SkyRL, the SDK and this repo; reuse it when complete.

    `force` reinstalls into the venv as it is; `fresh` deletes it first, so that every package is
    resolved anew (as on a new machine)."""
    marker = venv / ".rllm-async-setup"
    if fresh and venv.exists():
        shutil.rmtree(venv)
    # The repo without its dev extra, which wants the current SDK: the tests' tools instead.
    packages = [*PACKAGES, *_torch_pin(), *TEST_TOOLS]
    editable = str(REPO)
    if not force and marker.is_file() and json.loads(marker.read_text()) == [*packages, editable]:
        return venv_python(venv)
    start = time.monotonic()
    if not venv_python(venv).exists():
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    pip = [str(venv_python(venv)), "-m", "pip", "install", "--quiet"]
    subprocess.run([*pip, *packages], check=True)
    subprocess.run([*pip, "-e", editable], check=True)
    marker.write_text(json.dumps([*packages, editable]))
    print(f"set up {venv} in {time.monotonic() - start:.0f}s", file=sys.stderr)
    return venv_python(venv)


def build_model(out: Path = MODEL, python: Path | None = None) -> Path:
    """Build the tiny checkpoint + tokenizer once (about 10 s)."""
    if not (out / "config.json").is_file():
        python = python or setup()
        env = {**os.environ, **ENV}
        subprocess.run([str(python), str(HERE / "build_model.py"), str(out)], check=True, env=env)
    return out


def server_command(python: Path, model: Path, workdir: Path, port: int) -> list[str]:
    """The command line that starts SkyRL's API server (and, through it, its engine)."""
    return [
        str(python),
        str(HERE / "launch.py"),
        "api",
        "--base-model",
        str(model),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--database-url",
        f"sqlite:///{workdir / 'tinker.db'}",
        "--checkpoints-base",
        str(workdir / "checkpoints"),
        "--external-inference-lora-base",
        str(workdir / "lora"),
        "--backend-config",
        json.dumps(BACKEND_CONFIG),
    ]


def start(
    workdir: Path, port: int, python: Path | None = None, timeout_s: float = 180.0
) -> subprocess.Popen[bytes]:
    """Start the server in its own process group, logging to workdir/server.log; wait until healthy."""
    python = python or setup()
    model = build_model(python=python)
    workdir.mkdir(parents=True, exist_ok=True)
    with (workdir / "server.log").open("wb") as log:
        proc = subprocess.Popen(
            server_command(python, model, workdir, port),
            stdout=log,
            stderr=subprocess.STDOUT,
            env={**os.environ, **ENV},
            start_new_session=True,
        )
    url = f"http://127.0.0.1:{port}/api/v1/healthz"
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(
                f"the Tinker server exited with {proc.returncode}; see {workdir / 'server.log'}"
            )
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                if r.status == 200:
                    return proc
        except OSError:
            time.sleep(0.3)
    stop(proc)
    raise TimeoutError(f"the Tinker server did not answer {url} within {timeout_s:.0f}s")


def stop(proc: subprocess.Popen[bytes], timeout_s: float = 20.0) -> None:
    """SIGTERM the server (it stops its engine), then SIGKILL its process group if it lingers."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = parser.add_subparsers(dest="cmd", required=True)
    cmd = sub.add_parser("setup")
    cmd.add_argument("--force", action="store_true", help="reinstall into the venv as it is")
    cmd.add_argument("--fresh", action="store_true", help="delete the venv, then build it anew")
    sub.add_parser("build-model").add_argument("--out", type=Path, default=MODEL)
    serve = sub.add_parser("serve")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument("--workdir", type=Path, default=STATE / "run")
    args = parser.parse_args()
    if args.cmd == "setup":
        print(setup(force=args.force, fresh=args.fresh))
    elif args.cmd == "build-model":
        print(build_model(args.out))
    else:
        proc = start(args.workdir, args.port)
        print(f"Tinker API at http://127.0.0.1:{args.port} (base model {MODEL}); Ctrl-C stops it")
        try:
            proc.wait()
        except KeyboardInterrupt:
            stop(proc)


if __name__ == "__main__":
    main()
